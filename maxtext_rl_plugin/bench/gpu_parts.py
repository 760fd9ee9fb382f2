"""`bench gpu`'s step, sync and demo parts (each run in its own process by `bench/gpu.py`)."""

# jax, and everything that imports it, is imported inside the functions: a part decides its XLA/JAX environment
# before the backend starts, and the orchestrator never starts one. torch is optional (the HF peer).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

from maxtext_rl_plugin.bench import common
from maxtext_rl_plugin.bench import gpu_common


def step_part(args) -> dict:
  """`bench step` (colocated) on the 0.6B shape; the update's MFU against the bf16 peak; this process's peak memory."""
  from maxtext_rl_plugin.bench import step as bench_step

  ref = gpu_common.references(args)
  model = "tiny" if args.dry else "qwen3-0.6b"
  sets = args.step_set or [
      "batch_size=8",
      "rl.num_generations=8",
      "max_prefill_predict_length=128",
      "max_target_length=384",
  ]
  argv = [
      "--colocated",
      "--steps",
      str(args.step_steps if not args.dry else 1),
      "--warmup",
      "1" if not args.dry else "0",
      "--config",
      gpu_common.BASE_CONFIG,
      *gpu_common.SHAPES[model],
      *gpu_common.hardware_overrides(),
      "dtype=bfloat16",
      *sets,
      *args.set,
  ]
  r = gpu_common.run_main(bench_step, argv)
  upd = r["flops"]["plugin"]["update"]
  mfu = {side: float(f'{upd / r[f"{side}_s"]["update"] / ref["peak_flops"]:.4g}') for side in ("plugin", "tunix")}
  return {"references": ref, "bench_step": r, "update_mfu": mfu, **gpu_common.peak_memory()}


def _one_device_sync(args, name: str) -> dict:
  """One device: `resharding.reshard` of the weights onto a second mesh of it, against a jitted copy of the same
  bytes (what a sync that must copy costs at best); `aliases_source` says whether reshard copied at all."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh

  from maxtext_rl_plugin.config import load as config_lib
  from maxtext_rl_plugin.run import models
  from maxtext_rl_plugin.resharding import move, trees

  rs = models.setup_devices(config_lib.parse(gpu_common.config_argv(args, name, [*gpu_common.BF16])))
  model, mesh = models.build_model(rs.trainer_config, rs.trainer_devices)
  src = nnx.state(model, nnx.Param)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(src))
  smesh = Mesh(np.array(rs.sampler_devices).reshape(mesh.devices.shape), mesh.axis_names)
  dst = trees.logical_shardings(src, smesh, rs.trainer_config.logical_axis_rules)
  held = {"w": move.reshard(src, dst)}

  def sync():
    held["w"] = move.reshard(src, dst, release=held["w"])
    return held["w"]

  t_sync = common.timed(sync, args.repeats)
  keep = set().union(*(move.buffer_ids(x) for x in jax.tree.leaves(src)))
  aliases = any(move.buffer_ids(x) & keep for x in jax.tree.leaves(t_sync.result))
  copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
  jax.block_until_ready(copy(src))
  t_copy = common.timed(lambda: jax.block_until_ready(copy(src)), args.repeats)
  equal = all(
      np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(src), jax.tree.leaves(t_sync.result))
  )
  return {
      "model": name,
      "bytes": int(nbytes),
      "method": "one device: reshard onto a second mesh of it",
      "reshard_s": round(t_sync.seconds, 5),
      "reshard_bytes_per_s": round(nbytes / t_sync.seconds),
      "aliases_source": bool(aliases),
      "copy_s": round(t_copy.seconds, 5),
      "copy_bytes_per_s": round(nbytes / t_copy.seconds),
      "bitwise_equal": bool(equal),
  }


def sync_part(args) -> dict:
  """Each `--models` shape's weights: `bench reshard` across two device halves, or one device's copy (see above)."""
  import jax

  from maxtext_rl_plugin.bench import reshard as bench_reshard

  out = {"references": gpu_common.copy_bandwidth(args.copy_mib), "models": []}
  for name in args.models:
    if jax.device_count() >= 2:
      sets = [*gpu_common.SHAPES[name], *gpu_common.BF16, *gpu_common.hardware_overrides(), *args.set]
      r = gpu_common.run_main(bench_reshard, ["--config", gpu_common.BASE_CONFIG, "--ckpt-repeats", "0", "--set", *sets])
      out["models"].append({"model": name, "method": "bench reshard (trainer half -> sampler half)", **r})
    else:
      out["models"].append(_one_device_sync(args, name))
    gpu_common.save_partial({"device": gpu_common.device_info(), **out, "partial": True})
  return out


def demo_part(args) -> dict:
  """configs/cpu_demo.yml's run as scripts/demo.sh starts it (without its venv step), wall time and summary table."""
  import jax

  with tempfile.TemporaryDirectory(prefix="bench_gpu_demo_") as tmp:
    cmd = [
        sys.executable,
        "-m",
        "maxtext_rl_plugin.train_rl",
        "configs/cpu_demo.yml",
        f"base_output_directory={tmp}",
        *(["hardware=gpu"] if jax.default_backend() == "gpu" else []),
        *args.demo_set,
        *args.set,
    ]
    t0 = time.perf_counter()
    left = float(os.environ.get("BENCH_GPU_DEADLINE", time.time() + args.budget)) - time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=max(left, 1))
    wall = time.perf_counter() - t0
  print(p.stdout[-4000:], p.stderr[-4000:], sep="\n", flush=True)
  m = re.search(r"^metric .*?held-out examples\)", p.stdout, re.M | re.S)
  table = m.group(0).rstrip() if m else None
  out = {"returncode": p.returncode, "wall_s": round(wall, 1), "summary_table": table, "command": " ".join(cmd[1:])}
  if p.returncode:
    out["error"] = f"the demo run exited {p.returncode}: {(p.stderr.strip().splitlines() or ['?'])[-1][:500]}"
  return out
