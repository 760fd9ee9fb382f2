"""What a quantized sampler (`rollout_quantization`) buys the vLLM rollout of a recipe: a roofline from its figures.

    python -m maxtext_rl_plugin.aot.low_precision            # the Llama 3.1 70B recipe on v5p-128 and tpu7x-128

Analytic, not compiled: tpu-inference 0.32.0 quantizes a float checkpoint only through Qwix PTQ on a concrete model
(rollout/precision.py), which the AOT path (aot/vllm_programs.py builds the engine with `nnx.eval_shape`) cannot apply
without weights, so the quantized decode step is not a compiled program here. The figures are those the compiled bf16
rows of docs/aot.md are made of, so the bf16 column checks the arithmetic against the compiler: the weights per chip
(131.4 GiB / TP), the KV pool tpu-inference allocates (`hbm_utilization_vllm` x HBM - weights; pages of kv heads
padded to TP, head_dim 128) and the decode step's FLOPs (2 x params x padded tokens / TP). Per decode step a chip reads
its weights once and the running requests' KV pages; the step takes max(FLOPs / peak, bytes / bandwidth) (decode is
bandwidth-bound by 10x here). `calibrated` adds what XLA counts beyond that for the compiled bf16 step (24.5 GB per
call on v5p-128 at TP 8, against 17.8 GB of weights and KV: the kernel's page reads and the rest), assumed unchanged by
the weights' format. Weight-only quantization: the matmuls still run in bf16 (the kernels are read back), so the peak
FLOP/s is bf16's; FP8 activations (vLLM's W8A8 FP8 linear) would halve the FLOP term, which is not the bound.

Quantized: every matmul kernel of the 80 layers (68.45e9 of 70.55e9 parameters); kept in bf16: the embedding and the
untied output head (2.10e9), norms; scales: one float32 per output channel (27 MB for the whole model).
"""

from __future__ import annotations

import dataclasses
import sys

from maxtext_rl_plugin.aot import topology

GIB = 1024**3

BYTES = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0}


@dataclasses.dataclass(frozen=True)
class Model:
  """A dense Llama's shapes (MaxText's `llama3.1-70b`)."""

  emb: int = 8192
  heads: int = 64
  kv_heads: int = 8
  head_dim: int = 128
  mlp: int = 28672
  layers: int = 80
  vocab: int = 128256

  @property
  def layer_kernels(self) -> dict[str, tuple[int, int]]:
    """(in, out) of each quantized kernel of one layer."""
    q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
    e = self.emb
    return {
        "q": (e, q),
        "k": (e, kv),
        "v": (e, kv),
        "o": (q, e),
        "wi_0": (e, self.mlp),
        "wi_1": (e, self.mlp),
        "wo": (self.mlp, e),
    }

  @property
  def quantized_params(self) -> int:
    return self.layers * sum(i * o for i, o in self.layer_kernels.values())

  @property
  def scales(self) -> int:
    return self.layers * sum(o for _, o in self.layer_kernels.values())

  @property
  def float_params(self) -> int:
    return 2 * self.vocab * self.emb + (2 * self.layers + 1) * self.emb  # embedding, head, norms

  def weight_bytes(self, fmt: str) -> float:
    if fmt == "bf16":
      return 2.0 * (self.quantized_params + self.float_params)
    return BYTES[fmt] * self.quantized_params + 4.0 * self.scales + 2.0 * self.float_params


@dataclasses.dataclass(frozen=True)
class Recipe:
  """The vLLM rollout of one compiled recipe in docs/aot.md."""

  topology: str
  tp: int  # devices per replica (rollout_tensor_parallelism)
  sampler_devices: int
  rows: int  # batch_size x num_generations
  prompt: int = 256  # max_prefill_predict_length
  completion: int = 768  # decode steps + 1
  max_model_len: int = 1024
  hbm_utilization: float = 0.72
  padded_decode_tokens: int = 16  # the runner's smallest token bucket
  other_seconds: float = 0.0  # the step's trainer programs (actor_update, reference_logps, sync) as compiled
  compiled_decode_gb: float | None = None  # XLA's bytes per decode call of the compiled bf16 step, when measured


RECIPES = {
    # docs/aot.md "The vLLM rollout": TP 8, 4 replicas of 8 chips, 32 rows; trainer rows 0.06 s.
    "v5p-128": Recipe("v5p-128", tp=8, sampler_devices=32, rows=32, other_seconds=0.06, compiled_decode_gb=24.5),
    # docs/aot.md "Llama 3.1 70B GRPO on tpu7x-128" (batch_size=16 x 4), the same vLLM TP of 8 devices (4 chips):
    # 8 replicas on the 64 sampler devices; trainer rows 0.90 s (actor_update 0.74, reference_logps 0.16).
    "tpu7x-128": Recipe("tpu7x-128", tp=8, sampler_devices=64, rows=64, other_seconds=0.90),
}


def figures(recipe: Recipe, fmt: str, model: Model = Model()) -> dict[str, float]:
  """Per device: weights, KV pool and its tokens and requests, the decode step's roofline, the RL step's."""
  dev = topology.device_spec(recipe.topology)
  weights = model.weight_bytes(fmt) / recipe.tp
  pool = recipe.hbm_utilization * dev.hbm_bytes - weights
  kv_heads = max(1, -(-model.kv_heads // recipe.tp))  # padded to TP, then split
  kv_token = model.layers * 2 * kv_heads * model.head_dim * 2  # bf16 k and v per token per device
  replicas = recipe.sampler_devices // recipe.tp
  requests = -(-recipe.rows // replicas)
  mean_context = recipe.prompt + recipe.completion / 2
  kv_read = requests * mean_context * kv_token
  flops = 2.0 * (model.quantized_params + model.float_params) * recipe.padded_decode_tokens / recipe.tp
  step = max(flops / dev.peak_flops, (weights + kv_read) / dev.hbm_bandwidth)
  out = {
      "weights_gib": weights / GIB,
      "kv_pool_gib": pool / GIB,
      "kv_tokens": pool / kv_token,
      "requests_at_max_len": pool / kv_token // recipe.max_model_len,
      "decode_gb": (weights + kv_read) / 1e9,
      "decode_ms": 1e3 * step,
      "rollout_s": step * (recipe.completion - 1),
  }
  out["rl_step_s"] = out["rollout_s"] + recipe.other_seconds
  if recipe.compiled_decode_gb is not None:
    extra = recipe.compiled_decode_gb * 1e9 - (model.weight_bytes("bf16") / recipe.tp + kv_read)
    calibrated = (weights + kv_read + extra) / dev.hbm_bandwidth
    out["calibrated_decode_ms"] = 1e3 * calibrated
    out["calibrated_rl_step_s"] = calibrated * (recipe.completion - 1) + recipe.other_seconds
  return out


def table(recipes: dict[str, Recipe] | None = None) -> str:
  """The docs' Markdown table: one row per (topology, format)."""
  recipes = RECIPES if recipes is None else recipes
  head = (
      "| target | weights | per device: weights GiB | KV pool GiB | KV tokens (M) | requests of 1,024 tokens | "
      "decode GB/step | decode ms (roofline) | rollout s/step | RL step s | calibrated decode ms / RL step s |\n"
      "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
  )
  rows = [head]
  for name, recipe in recipes.items():
    for fmt in ("bf16", "fp8", "int8"):
      f = figures(recipe, fmt)
      cal = f"{f['calibrated_decode_ms']:.2f} / {f['calibrated_rl_step_s']:.2f}" if "calibrated_decode_ms" in f else "-"
      rows.append(
          f"| {name} TP {recipe.tp} | {fmt} | {f['weights_gib']:.2f} | {f['kv_pool_gib']:.2f} | "
          f"{f['kv_tokens'] / 1e6:.2f} | {int(f['requests_at_max_len']):,} | {f['decode_gb']:.2f} | "
          f"{f['decode_ms']:.2f} | {f['rollout_s']:.2f} | {f['rl_step_s']:.2f} | {cal} |"
      )
  return "\n".join(rows)


def main() -> int:
  print(table())
  return 0


if __name__ == "__main__":
  sys.exit(main())
