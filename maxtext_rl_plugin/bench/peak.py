"""This machine's measured matmul peak (FLOP/s) and the FLOP counts the benchmarks compare with it.

The peak is a large jitted float32 matmul timed in the same process as the benchmark, so "fraction of
peak" is against what XLA achieves on these devices right now (shared cores included), not a datasheet.
"""

from __future__ import annotations

import time

from maxtext_rl_plugin.bench import common

# JAX (and every plugin module that imports it) is imported inside functions, after `common.force_host_devices`
# has set XLA_FLAGS: XLA reads the host device count once, when the backend starts.
# pylint: disable=import-outside-toplevel


def measure_peak_flops(n: int = 1024, repeats: int = 5, dtype: str = "float32") -> dict:
  """Best FLOP/s of an [n, n] @ [n, n] jitted matmul (2 n^3 FLOPs) over `repeats` timed runs.

  The matmul runs on the default device (sharded matmuls of several forced CPU devices share the same
  cores, so one device is the machine's peak on CPU; on an accelerator it is that chip's).
  """
  import jax

  ka, kb = jax.random.split(jax.random.PRNGKey(0))
  a = jax.random.normal(ka, (n, n), dtype)
  b = jax.random.normal(kb, (n, n), dtype)
  # Four chained matmuls per call so dispatch overhead is negligible next to the work.
  f = jax.jit(lambda a, b: ((a @ b) @ b @ b @ b).sum())
  f(a, b).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    s = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - s)
  flops = 4 * 2 * n**3
  return {
      "peak_flops": flops / best,
      "peak_matmul_n": n,
      "peak_dtype": dtype,
      "peak_seconds": best,
      "peak_device": jax.devices()[0].device_kind,
  }


def measure_backend_peak_flops() -> dict:
  """The peak a benchmark's phases are compared with: float32 at n=1024 on CPU (what the CPU tables have always
  used), the bf16 peak at n=8192 on an accelerator, where the models run in bf16 and a 1024 float32 matmul is a
  fraction of the chip (on an H200 it read 52 TFLOP/s, so phases showed "765% of peak")."""
  import jax

  if jax.default_backend() == "cpu":
    return measure_peak_flops()
  return measure_peak_flops(8192, dtype="bfloat16")


def param_counts(cfg) -> dict:
  """Per-token matmul parameters of a MaxText dense decoder (embedding lookup excluded, LM head included)."""
  emb, heads, kv, hd, mlp, layers = (
      int(cfg.emb_dim),
      int(cfg.num_query_heads),
      int(cfg.num_kv_heads),
      int(cfg.head_dim),
      int(cfg.mlp_dim),
      int(cfg.num_decoder_layers),
  )
  attn = emb * heads * hd * 2 + emb * kv * hd * 2  # q, o; k, v
  mlp_p = 3 * emb * mlp  # gated MLP (wi_0, wi_1, wo)
  head = emb * int(cfg.vocab_size)
  return {"decoder": layers * (attn + mlp_p), "head": head, "total": layers * (attn + mlp_p) + head}


def decode_flops(cfg, batch: int, prompt_len: int, new_tokens: int) -> float:
  """2 x per-token params x generated tokens + attention (QK^T and AV over the real context of each step)."""
  p = param_counts(cfg)["total"]
  layers, heads, hd = int(cfg.num_decoder_layers), int(cfg.num_query_heads), int(cfg.head_dim)
  # Step t attends over prompt_len + t positions: sum over t of 2 (QK, AV) x 2 FLOPs x heads x hd x context.
  ctx = new_tokens * prompt_len + new_tokens * (new_tokens - 1) / 2
  attn = 4 * layers * heads * hd * ctx
  return float(batch * (2 * p * new_tokens + attn))


def train_flops(cfg, tokens: int, seq_len: int, passes: float = 3.0) -> float:
  """`passes` x 2 x params x tokens + attention (passes=3: forward + backward = the usual 6 x params)."""
  p = param_counts(cfg)["total"]
  layers, heads, hd = int(cfg.num_decoder_layers), int(cfg.num_query_heads), int(cfg.head_dim)
  attn = 4 * layers * heads * hd * seq_len / 2  # causal: half the seq_len^2 scores per token, on average
  return float(passes * tokens * (2 * p + attn))


def main(argv=None) -> int:
  ap = common.ArgumentParser(prog="python -m maxtext_rl_plugin.bench peak", description=__doc__.splitlines()[0])
  ap.add_argument("--n", type=common.positive_int, default=1024, help="matmul size")
  ap.add_argument("--repeats", type=common.positive_int, default=5, help="timed runs (the best is reported)")
  args = ap.parse_args(argv)
  r = measure_peak_flops(args.n, args.repeats)
  print(common.finite_json({"benchmark": "peak", **r}))
  return 0
