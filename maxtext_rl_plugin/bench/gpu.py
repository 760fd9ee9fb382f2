"""Absolute figures on whatever JAX backend is present (issue 31): `python -m maxtext_rl_plugin.bench gpu --out DIR`.

Four parts, each in its own process (a part that fails or runs out of time leaves the others' figures, and each
part's peak device memory is its own), their results merged into DIR/gpu_bench.json and DIR/gpu_bench.md after
every part:

* `rollout`: the embedded engine's greedy decode at each batch size for a Qwen3-0.6B- and a Llama-3.1-8B-shaped
  model (random bf16 weights), `--prompt-len` random prompt tokens + `--new-tokens` new ones. Prefill = a 1-token
  generate; decode step = (full generate - prefill) / (new tokens - 1). Decode against the HBM roofline: the bytes a
  step must read (every weight the step multiplies by, the LM head included, + the KV cache over the real context)
  over the measured device-to-device copy bandwidth (bytes read + written); prefill against the measured bf16 matmul
  peak. Peer, where torch sees a GPU (or `--peers` on CPU): Hugging Face `generate` with a static cache (eager, and
  torch.compile'd with `--hf-compile`) on the same weights for the Qwen3 shape (greedy tokens compared) and on its
  own random weights of the same shape for the Llama shape (MaxText's LLaMA RoPE is interleaved, HF's is not: the
  copy would need MaxText's q/k permutation; speed does not depend on the weights).
* `step`: one GRPO step of the 0.6B-shaped model, 8 prompts x 8 generations: `bench step` (the plugin's loop and
  Tunix's on one build, colocated on one device: no sync phase), with the update's MFU against the bf16 peak.
* `sync`: the weight sync of the 0.6B- and 8B-shaped weights: `bench reshard` where there are >= 2 devices; on one
  device, `resharding.reshard` onto a second mesh of it against a jitted copy of the same bytes.
* `demo`: `configs/cpu_demo.yml`'s run (what scripts/demo.sh runs), wall time and its before/after table.

`--dry` runs every part with tiny shapes on CPU in about a minute (tests/bench/test_bench_gpu.py), so this cannot rot.

This module is the orchestration (one process per part, the budget, the merged record); the parts are in
`gpu_rollout.py` and `gpu_parts.py`, what they share in `gpu_common.py`, the report in `gpu_report.py`.
"""

# jax, and everything that imports it, is imported inside the functions: a part decides its XLA/JAX environment
# before the backend starts, and the orchestrator never starts one. torch is optional (the HF peer).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from maxtext_rl_plugin.bench import common
from maxtext_rl_plugin.bench import gpu_common
from maxtext_rl_plugin.bench import gpu_parts
from maxtext_rl_plugin.bench import gpu_report
from maxtext_rl_plugin.bench import gpu_rollout


def _parse(argv):
  """The command line (see --help)."""
  p = common.ArgumentParser(prog="python -m maxtext_rl_plugin.bench gpu", description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True, help="directory for gpu_bench.json and gpu_bench.md (created)")
  p.add_argument("--dry", action="store_true", help="every code path at tiny shapes (CPU, about a minute)")
  p.add_argument(
      "--parts", default=",".join(gpu_common.PARTS), help=f"comma-separated subset of {','.join(gpu_common.PARTS)}"
  )
  p.add_argument(
      "--models", default="qwen3-0.6b,llama3.1-8b", help=f"rollout/sync shapes, of {','.join(gpu_common.SHAPES)}"
  )
  p.add_argument("--batch-sizes", type=common.positive_ints, default="1,8,32,128", help="rollout batch sizes")
  p.add_argument(
      "--peer-batches", type=common.positive_ints, default="1,32", help="batch sizes at which the HF peer also runs"
  )
  p.add_argument("--prompt-len", type=common.positive_int, default=128)
  p.add_argument("--new-tokens", type=common.positive_int, default=256)
  p.add_argument("--repeats", type=common.positive_int, default=3, help="timed runs per measurement (median)")
  p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None, help="HF peer (default: if CUDA)")
  p.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=True, help="also torch.compile'd HF")
  p.add_argument(
      "--step-steps", type=common.positive_int, default=2, help="bench step: measured steps per side (after 1 warm-up)"
  )
  p.add_argument("--set", nargs="*", default=[], metavar="K=V", help="extra MaxText overrides for every part")
  p.add_argument(
      "--budget", type=common.positive_int, default=3600, help="seconds for all parts; a part still running is stopped"
  )
  p.add_argument("--peak-n", type=common.positive_int, default=8192, help="bf16 matmul size of the peak measurement")
  p.add_argument(
      "--copy-mib", type=common.positive_int, default=2048, help="MiB of the device-to-device copy measurement"
  )
  p.add_argument("--part", choices=gpu_common.PARTS, help=argparse.SUPPRESS)  # internal: run one part in this process
  args = p.parse_args(argv)
  args.step_set, args.demo_set = [], []
  if args.dry:
    for k, v in gpu_common.DRY.items():
      setattr(args, k, v)
  args.parts = [x for x in args.parts.split(",") if x]
  args.models = [x for x in args.models.split(",") if x]
  bad = [x for x in args.parts if x not in gpu_common.PARTS] + [x for x in args.models if x not in gpu_common.SHAPES]
  if bad:
    p.error(f"unknown part or model: {', '.join(bad)}")
  return args


def _run_part(argv: list[str], part: str, deadline: float) -> dict:
  """One part in a fresh process (own device memory, own failure) until `deadline`; its JSON record (what it saved
  so far, if stopped), or the error."""
  with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
    path = f.name
  env = dict(os.environ, BENCH_GPU_PART_JSON=path, BENCH_GPU_DEADLINE=str(deadline))
  cmd = [sys.executable, "-m", "maxtext_rl_plugin.bench", "gpu", *argv, "--part", part]
  t0 = time.perf_counter()
  try:
    rc = subprocess.run(cmd, env=env, check=False, timeout=max(deadline - time.time(), 1)).returncode
  except subprocess.TimeoutExpired:
    rc = "timeout"
  wall = round(time.perf_counter() - t0, 1)
  try:
    with open(path, encoding="utf-8") as f:
      rec = json.load(f)
    if rc == "timeout":
      rec["error"] = "stopped at the --budget deadline; the figures here are what it had measured"
  except (OSError, ValueError):
    rec = {"error": f"part exited {rc} without a result (its output is above)"}
  finally:
    os.unlink(path)
  return {"wall_s": wall, **rec}


def _part_main(args) -> int:
  """Inside a part's process: run it, write its record to $BENCH_GPU_PART_JSON."""
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  fn = {
      "rollout": gpu_rollout.rollout_part,
      "step": gpu_parts.step_part,
      "sync": gpu_parts.sync_part,
      "demo": gpu_parts.demo_part,
  }[args.part]
  try:
    rec = {"device": gpu_common.device_info(), **fn(args)}
  except Exception as e:  # pylint: disable=broad-exception-caught  # the record names it; the other parts run on
    import traceback

    traceback.print_exc()
    rec = {"error": f"{type(e).__name__}: {e}"[:2000]}
  with open(os.environ["BENCH_GPU_PART_JSON"], "w", encoding="utf-8") as f:
    f.write(common.finite_json(rec))
  return 0


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _parse(argv)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  # One process at a time holds the device, and the HF peer shares it with JAX: allocate on demand.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.dry:
    os.environ["JAX_PLATFORMS"] = "cpu"
  if args.part:
    return _part_main(args)
  os.makedirs(args.out, exist_ok=True)
  res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": argv}
  deadline = time.time() + args.budget
  for part in args.parts:
    print(f"== bench gpu: {part}", flush=True)
    res[part] = _run_part(argv, part, deadline)
    res["device"] = res.get("device") or res[part].get("device")
    gpu_report.write(args.out, res)
  print(gpu_report.markdown(res))
  print(common.finite_json({"benchmark": "gpu", **{k: v for k, v in res.items() if k != "argv"}}))
  return 0 if all("error" not in res[p] for p in args.parts) else 1


if __name__ == "__main__":
  sys.exit(main())
