"""What the parts of `bench gpu` share: the model shapes, the dry-run sizes, device references and records."""

# jax, and everything that imports it, is imported inside the functions: a part decides its XLA/JAX environment
# before the backend starts, and the orchestrator never starts one. torch is optional (the HF peer).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import contextlib
import io
import json
import os
import time

from maxtext_rl_plugin.bench import common

# The parts of `bench gpu`, in the order they run (each in its own process).
PARTS = ("rollout", "step", "sync", "demo")
BASE_CONFIG = "configs/cpu_tiny.yml"


# MaxText's own model configs are selected by model_name; cpu_tiny.yml's override_model_config lets these restore
# the full shapes over its tiny ones.
SHAPES = {
    "qwen3-0.6b": [
        "model_name=qwen3-0.6b",
        "base_emb_dim=1024",
        "base_num_query_heads=16",
        "base_num_kv_heads=8",
        "base_mlp_dim=3072",
        "base_num_decoder_layers=28",
        "head_dim=128",
        "vocab_size=151936",
    ],
    "llama3.1-8b": [
        "model_name=llama3.1-8b",
        "base_emb_dim=4096",
        "base_num_query_heads=32",
        "base_num_kv_heads=8",
        "base_mlp_dim=14336",
        "base_num_decoder_layers=32",
        "head_dim=128",
        "vocab_size=128256",
    ],
    # --dry: cpu_tiny.yml's 2-layer Qwen3 shape with the CPU demo's 528-token vocabulary (a 152k-row head would be
    # most of a dry run's time).
    "tiny": [
        "tokenizer_path=tokenizers/arith-bpe-512",
        "vocab_size=528",
        "use_chat_template=false",
        "data_template_path=cpu_demo_template.json",
    ],
}


BF16 = ["weight_dtype=bfloat16", "dtype=bfloat16"]


DRY = {
    "models": "tiny",
    "batch_sizes": [1, 2],
    "peer_batches": [2],
    "prompt_len": 8,
    "new_tokens": 4,
    "repeats": 1,
    "step_set": ["batch_size=2", "rl.num_generations=2", "max_target_length=136"],
    "demo_set": [
        "sft_warmup_steps=0",
        # cpu_demo.yml configures its warm start; with it off, its keys go back to rl.yml's defaults (dependent_keys).
        "sft_batch_size=16",
        "sft_learning_rate=1.0e-3",
        "num_batches=1",
        "batch_size=2",
        "rl.num_generations=2",
        "num_test_batches=1",
        "eval_batch_size=8",
        "synthetic_num_eval=8",
        "enable_checkpointing=false",
        "write_plot=false",
    ],
    "peak_n": 128,
    "copy_mib": 4,
}


def device_info() -> dict:
  """The backend, device kind and count, JAX's version."""
  import jax

  d = jax.devices()[0]
  return {
      "backend": jax.default_backend(),
      "device": d.device_kind,
      "devices": jax.device_count(),
      "jax": jax.__version__,
  }


def hardware_overrides() -> list[str]:
  """MaxText's `hardware` key for the backend present (cpu_tiny.yml says cpu)."""
  import jax

  return ["hardware=gpu"] if jax.default_backend() == "gpu" else []


def copy_bandwidth(mib: int, repeats: int = 5) -> dict:
  """Device-to-device copy bandwidth: a jitted elementwise op over `mib` MiB of bf16 (read + write bytes / best
  time), the HBM figure the decode roofline divides by."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((mib * 2**19,), jnp.bfloat16)
  f = jax.jit(lambda x: x + 1)
  f(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return {"copy_bytes_per_s": 2 * x.nbytes / best, "copy_mib": mib}


def peak_memory() -> dict:
  """Peak device memory of this process (None where the backend keeps no statistics, as on CPU) and peak RSS."""
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return {"peak_device_bytes": peak, "peak_rss_mib": round(common.status_kb("VmHWM") / 1024, 1)}


def references(args) -> dict:
  """bf16 matmul peak and copy bandwidth, measured in this process."""
  from maxtext_rl_plugin.bench import peak as bench_peak

  ref = bench_peak.measure_peak_flops(args.peak_n, dtype="bfloat16")
  return {"peak_flops": ref["peak_flops"], "peak_dtype": "bfloat16", **copy_bandwidth(args.copy_mib)}


def run_main(module, argv: list[str]) -> dict:
  """A bench module's `main(argv)` in this process: its last stdout line (the JSON record); its output is echoed."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    rc = module.main(argv)
  text = buf.getvalue()
  print(text, end="", flush=True)
  if rc:
    raise RuntimeError(f"{module.__name__} exited {rc}")
  return json.loads(text.strip().splitlines()[-1])


def save_partial(rec: dict) -> None:
  """Write a part's record so far (a part stopped by the budget still reports what it measured)."""
  path = os.environ.get("BENCH_GPU_PART_JSON")
  if path:
    with open(path, "w", encoding="utf-8") as f:
      f.write(common.finite_json(rec))


def config_argv(args, model: str, extra: list[str]) -> list[str]:
  return [BASE_CONFIG, *SHAPES[model], *hardware_overrides(), *extra, *args.set]


def sig(x: float, digits: int = 3) -> float:
  """`x` to `digits` significant figures: a fraction of a roofline spans decades (3e-5 on a loaded CPU, 0.6 on an
  H100), and rounding to fixed decimals would turn the small ones into a false 0."""
  return float(f"{x:.{digits}g}")
