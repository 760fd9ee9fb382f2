"""What a quantized sampler (`rollout_quantization`) buys the vLLM rollout of the Llama 3.1 70B recipe, compiled.

    JAX_PLATFORMS=cpu PYTHONPATH=.venv-tpu-libtpu .venv-tpu/bin/python -P -m maxtext_rl_plugin.aot.low_precision \
        --out /tmp/aot_lp          # compiles what /tmp/aot_lp has no report of yet, then prints the table
    python -m maxtext_rl_plugin.aot.low_precision --analytic      # the analytic cross-check alone (< 1 s, any venv)

Compiled: for each target (v5p-128, tpu7x-128) and weight format (bf16, fp8, int8), one `compile_rl` of the recipe's
rollout (`rollout_engine=vllm rollout_quantization=<fmt>`, `MAXTEXT_RL_AOT_PHASES=rollout`) in a subprocess, one at a
time (a 70B compile holds ~5 GB). aot/vllm_programs.py builds tpu-inference's `LlamaForCausalLM` with the Qwix rules
the real engine gets (`additional_config.quantization.qwix`) through tpu-inference's own PTQ pass, so the decode step
reads the QArray kernels (int8 / float8_e4m3fn values, one bf16 scale per output channel) the quantized sync writes;
its KV pool is vLLM's own sizing at the same `hbm_utilization_vllm` with those smaller weights. Each row is that
report's: weights and pool per device, XLA's FLOPs and bytes of one decode call and the roofline
max(FLOPs / peak, bytes / bandwidth) (aot/topology.py's published figures), the rollout's s per RL step (prefill +
767 decode calls). The RL step adds the trainer's programs as compiled for the same recipe in docs/aot.md (unchanged
by the sampler's format: `Recipe.other_seconds`). A format the library cannot build for a target is a
`not compiled:` row with compile_rl's own line.

Analytic (`figures`, the cross-check): the same quantities from the model's shapes (weights 131.4 GiB / TP; pool =
`hbm_utilization_vllm` x HBM - weights; per decode step a device reads its weights once and the running requests' KV
pages; the step is max(FLOPs / peak, bytes / bandwidth)). Quantized there: every matmul kernel of the 80 layers
(68.45e9 of 70.55e9 parameters); kept in bf16: the embedding and untied output head (2.10e9) and norms; scales one
float32 per output channel. The compiled rows agree with it on weights and pool to 0.01 GiB; the decode step differs
by what XLA counts beyond weights and KV pages (`calibrated` adds the compiled bf16 step's extra, assumed unchanged by
the format: the compiled rows show it holds on tpu7x and not on v5p, where the extra halves with the weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

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
  overrides: tuple[str, ...] = ()  # compile_rl's keys for the recipe (besides the model, target and format)


RECIPES = {
    # docs/aot.md "The vLLM rollout": TP 8, 4 replicas of 8 chips, 32 rows; trainer rows 0.06 s.
    "v5p-128": Recipe(
        "v5p-128",
        tp=8,
        sampler_devices=32,
        rows=32,
        other_seconds=0.06,
        compiled_decode_gb=24.5,
        overrides=("batch_size=8", "rl.num_generations=4", "rollout_tensor_parallelism=8"),
    ),
    # docs/aot.md "Llama 3.1 70B GRPO on tpu7x-128" (batch_size=16 x 4), the same vLLM TP of 8 devices (4 chips):
    # 8 replicas on the 64 sampler devices; trainer rows 0.90 s (actor_update 0.74, reference_logps 0.16).
    "tpu7x-128": Recipe(
        "tpu7x-128",
        tp=8,
        sampler_devices=64,
        rows=64,
        other_seconds=0.90,
        overrides=("batch_size=16", "rl.num_generations=4", "rollout_tensor_parallelism=8"),
    ),
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


def analytic_table(recipes: dict[str, Recipe] | None = None) -> str:
  """The analytic cross-check as a Markdown table: one row per (topology, format)."""
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


# ------------------------------------------------------------------------------- compiled

FORMATS = ("bf16", "fp8", "int8")
REQUEST_TOKENS = 1024  # the recipe's max_target_length: one request's prompt + completion
# The recipe's command line (docs/aot.md, "The vLLM rollout"), less the target, its overrides and the format.
MODEL_ARGS = (
    "configs/rl.yml",
    "model_name=llama3.1-70b",
    "tokenizer_path=meta-llama/Llama-3.1-70B-Instruct",
    "load_parameters_path=gs://bucket/ckpt/0/items",
    "compile_topology_num_slices=1",
    "rollout_engine=vllm",
)


def run_name(recipe: Recipe, fmt: str) -> str:
  return f"{recipe.topology}_{fmt}"


def compile_argv(recipe: Recipe, fmt: str, out_dir: str) -> list[str]:
  """compile_rl's command line for the recipe's rollout with `fmt` weights (bf16: the checkpoint's own dtype)."""
  return [
      *MODEL_ARGS,
      f"compile_topology={recipe.topology}",
      *recipe.overrides,
      f"rollout_quantization={'' if fmt == 'bf16' else fmt}",
      f"base_output_directory={out_dir}",
      f"run_name={run_name(recipe, fmt)}",
  ]


def _read(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def paths(out_dir: str, recipe: Recipe, fmt: str) -> tuple[str, str, str]:
  """(compile_rl's JSON report, this module's record of the run, the run's log)."""
  name = run_name(recipe, fmt)
  return (
      os.path.join(out_dir, f"{name}.aot-{recipe.topology}.json"),
      os.path.join(out_dir, f"{name}.run.json"),
      os.path.join(out_dir, f"{name}.log"),
  )


def compile_one(recipe: Recipe, fmt: str, out_dir: str) -> dict:
  """Run compile_rl for (recipe, fmt) in a subprocess of this interpreter and environment (the TPU image's stack, libtpu
  on PYTHONPATH), the rollout phase only; record its command, exit status, wall time, peak RSS and `error:` line."""
  report, record, log = paths(out_dir, recipe, fmt)
  argv = [sys.executable, "-P", "-m", "maxtext_rl_plugin.compile_rl", *compile_argv(recipe, fmt, out_dir)]
  env = dict(os.environ, MAXTEXT_RL_AOT_PHASES="rollout")
  t0 = time.perf_counter()
  with open(log, "w", encoding="utf-8") as f, subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT) as proc:
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its peak RSS, not the largest so far
    proc.returncode = os.waitstatus_to_exitcode(status)
  with open(log, encoding="utf-8") as f:
    lines = f.read().splitlines()
  errors = [line for line in lines if line.startswith("error:")]
  out = {
      "argv": argv[3:],
      "returncode": proc.returncode,
      "wall_s": time.perf_counter() - t0,
      "cpu_s": usage.ru_utime + usage.ru_stime,
      "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9,  # kB on Linux
      "error": (errors or lines[-1:] or ["no output"])[-1] if proc.returncode or not os.path.exists(report) else None,
  }
  with open(record, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)
  return out


def compiled_figures(report: dict, recipe: Recipe) -> dict[str, float]:
  """Per device, from compile_rl's JSON report of the recipe's vLLM rollout: weights (and the bytes in a quantized
  dtype), vLLM's KV pool, its tokens and concurrent requests, one decode call's FLOPs, bytes and roofline, the rollout
  and the RL step per step."""
  v = report["vllm_rollout"]
  decode = next(p for p in report["programs"] if p["name"] == "vllm_decode_step")
  by_dtype = v.get("weights_gib_per_device_by_dtype", {})
  rollout = float(report["step_seconds"]["rollout"])
  return {
      "weights_gib": v["weights_gib_per_device"],
      "quantized_gib": sum(g for k, g in by_dtype.items() if k in ("int8", "float8_e4m3fn")),
      "kv_pool_gib": v["kv_pool_gib_per_device"],
      "kv_tokens": v["tokens_in_pool"],
      "requests": v["tokens_in_pool"] // REQUEST_TOKENS,
      "decode_gflop": decode["gflops"],
      "decode_gb": decode["gbytes"],
      "decode_ms": decode["ms_per_call"],
      "rollout_s": rollout,
      "rl_step_s": rollout + recipe.other_seconds,
  }


def table(out_dir: str, recipes: dict[str, Recipe], formats: tuple[str, ...]) -> str:
  """The compiled Markdown table, the analytic figures beside (weights, decode ms), one row per (target, format)."""
  rows = [
      "| target | weights | weights GiB (analytic) | of it int8/fp8 | KV pool GiB | KV tokens (M) | requests of 1,024 "
      "tokens | decode GFLOP/call | decode GB/call | decode ms, roofline (analytic) | rollout s/step | RL step s | "
      "compile wall s / peak RSS GB |",
      "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for name, recipe in recipes.items():
    for fmt in formats:
      report, record, _ = paths(out_dir, recipe, fmt)
      run = _read(record) if os.path.exists(record) else {}
      head = f"| {name} TP {recipe.tp} | {fmt} |"
      if not os.path.exists(report) or run.get("error"):
        rows.append(f"{head} not compiled: {run.get('error') or 'no report'} |" + " |" * 10)
        continue
      c = compiled_figures(_read(report), recipe)
      a = figures(recipe, fmt)
      cost = f"{run['wall_s']:.0f} / {run['peak_rss_gb']:.1f}" if run else "-"
      rows.append(
          f"{head} {c['weights_gib']:.2f} ({a['weights_gib']:.2f}) | {c['quantized_gib']:.2f} | {c['kv_pool_gib']:.2f} | "
          f"{c['kv_tokens'] / 1e6:.2f} | {int(c['requests']):,} | {c['decode_gflop']:,.0f} | {c['decode_gb']:.2f} | "
          f"{c['decode_ms']:.2f} ({a['decode_ms']:.2f}) | {c['rollout_s']:.2f} | {c['rl_step_s']:.2f} | {cost} |"
      )
  return "\n".join(rows)


def _names(value: str, known, what: str, parser: argparse.ArgumentParser) -> tuple[str, ...]:
  names = tuple(v.strip() for v in value.split(",") if v.strip())
  bad = [n for n in names if n not in known]
  if bad or not names:
    parser.error(f"--{what}: '{(bad or [value])[0]}' is not one of {', '.join(known)}")
  return names


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m maxtext_rl_plugin.aot.low_precision",
      description="The 70B recipe's vLLM decode step with bf16 / fp8 / int8 weights, compiled for each target.",
  )
  parser.add_argument("--out", default="/tmp/aot_low_precision", help="reports (one present is not compiled again)")
  parser.add_argument("--targets", default=",".join(RECIPES), help="comma-separated recipes")
  parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated weight formats")
  parser.add_argument("--recompile", action="store_true", help="compile even where a report exists")
  parser.add_argument("--analytic", action="store_true", help="print the analytic cross-check only (no compile)")
  args = parser.parse_args(argv)
  if args.analytic:
    print(analytic_table())
    return 0
  targets = _names(args.targets, tuple(RECIPES), "targets", parser)
  formats = _names(args.formats, FORMATS, "formats", parser)
  os.makedirs(args.out, exist_ok=True)
  recipes = {t: RECIPES[t] for t in targets}
  for recipe in recipes.values():
    for fmt in formats:
      report, record, log = paths(args.out, recipe, fmt)
      if os.path.exists(report) and os.path.exists(record) and not args.recompile:
        continue  # compiled before; a format that failed is tried again (a refusal is one line, seconds)
      print(f"[low_precision] compiling {recipe.topology} {fmt} (log: {log}) ...", flush=True)
      run = compile_one(recipe, fmt, args.out)
      state = run["error"] or "done"  # compile_rl's own `error:` line
      print(f"[low_precision]   {state} ({run['wall_s']:.0f} s, peak RSS {run['peak_rss_gb']:.1f} GB)", flush=True)
  print(table(args.out, recipes, formats))
  return 0


if __name__ == "__main__":
  sys.exit(main())
