"""Trainer -> sampler weight sync benchmark: `python -m maxtext_rl_plugin.bench reshard [--help]`.

A MaxText Qwen3-shaped model (>= 256 MiB of float32 parameters by default) is built by MaxText on the
trainer mesh (FSDP over the first half of the devices); the sampler layout is TP over the other half,
derived from the same logical axes. In one run it measures, each as the median of several repetitions:

* `reshard_s`: `resharding.WeightSync.sync` (unchunked), replacing the sampler's previous weights;
* `reshard_chunked_s`: the same with `--chunk-size` parameter arrays per chunk;
* `reshard_keep_old_s`: unchunked with `reshard_donate=false` (old sampler copy kept until replaced);
* `memcpy_s`: a plain host `memcpy` of the same bytes into fresh buffers (NumPy `copy`: allocation and
  first-touch page faults included, as in any sync that creates new arrays); `memcpy_prefaulted_s`: the
  same into already-touched buffers (raw copy bandwidth);
* `checkpoint_reload_s`: the legacy path, Orbax save of the trainer params + restore into the sampler
  shardings;
* peak extra resident memory during a sync (Linux `VmHWM` after resetting it through
  `/proc/self/clear_refs`, minus the RSS before the sync), against the largest chunk's bytes;
* the checksum guard (`verify_s`), and `bitwise_equal` (sampler arrays vs the trainer's, read back).

On CPU the 8 devices are forced host devices (`--devices`); the same code runs on TPU/Pathways.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from maxtext_rl_plugin.bench import common
import tempfile
import time

DEFAULT_MODEL = [
    "base_emb_dim=1024",
    "base_mlp_dim=4096",
    "base_num_query_heads=8",
    "base_num_kv_heads=4",
    "head_dim=128",
    "base_num_decoder_layers=3",
    "vocab_size=32768",
]


def _status_kb(field: str) -> int:
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  return 0


def _reset_peak() -> bool:
  """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
  try:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _measure(fn, repeats: int) -> tuple[float, float | None, object]:
  """(median seconds, max extra peak RSS in MiB over the runs or None, last result)."""
  times, extras, result = [], [], None
  for _ in range(repeats):
    can_peak = _reset_peak()
    rss0 = _status_kb("VmRSS")
    t0 = time.perf_counter()
    result = fn()
    times.append(time.perf_counter() - t0)
    if can_peak:
      extras.append((_status_kb("VmHWM") - rss0) / 1024)
  return statistics.median(times), (max(extras) if extras else None), result


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m maxtext_rl_plugin.bench reshard", description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/cpu_tiny.yml", help="base yml (the model is scaled by --set)")
  p.add_argument("--set", nargs="*", default=[], metavar="K=V", help="extra config overrides (model size etc.)")
  p.add_argument("--devices", type=int, default=8, help="forced host devices on CPU (half trainer, half sampler)")
  p.add_argument("--repeats", type=int, default=5, help="timed repetitions per method (median reported)")
  p.add_argument("--ckpt-repeats", type=int, default=2, help="repetitions of the Orbax save+restore baseline")
  p.add_argument("--chunk-size", type=int, default=4, help="parameter arrays per chunk for the chunked sync")
  p.add_argument("--tmpdir", default=None, help="where the checkpoint baseline writes (default: system temp)")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  common.force_host_devices(args.devices)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from absl import logging  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel

  from maxtext_rl_plugin import models, resharding  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.errors import exit_on_user_error  # pylint: disable=import-outside-toplevel

  logging.set_verbosity(logging.WARNING)
  n_dev = jax.device_count()
  if n_dev < 2 or n_dev % 2:
    print(f"error: needs an even number >= 2 of devices, found {n_dev}", file=sys.stderr)
    return 2
  half = n_dev // 2
  argv_cfg = [
      args.config,
      *DEFAULT_MODEL,
      "use_pathways=true",
      f"chips_per_vm={half}",
      f"ici_fsdp_parallelism={half}",
      "enable_checkpointing=false",
      *args.set,
  ]
  t_build = time.perf_counter()
  with exit_on_user_error():
    rs = models.setup_devices(argv_cfg)
    model, tmesh = models.build_model(rs.trainer_config, rs.trainer_devices)
  src = nnx.state(model, nnx.Param)
  jax.block_until_ready(src)
  build_s = time.perf_counter() - t_build
  shape = {k: 1 for k in tmesh.axis_names}
  shape["tensor"] = len(rs.sampler_devices)
  smesh = Mesh(np.array(rs.sampler_devices).reshape([shape[k] for k in tmesh.axis_names]), tmesh.axis_names)
  dst = resharding.logical_shardings(src, smesh, rs.trainer_config.logical_axis_rules)
  leaves = jax.tree.leaves(src)
  nbytes = sum(x.nbytes for x in leaves)

  # --- plugin sync (unchunked and chunked), replacing the sampler's previous weights each time ---
  results = {}
  for name, chunk, release in (
      ("reshard", None, True),
      ("reshard_chunked", args.chunk_size, True),
      ("reshard_keep_old", None, False),
  ):
    ws = resharding.WeightSync(None, dst, chunk_size=chunk, release_old=release, verify_policy="off")
    state = {"held": resharding.reshard(src, dst, chunk_size=chunk)}  # warm-up: first sync, no old copy to free

    def one_sync(ws=ws, state=state):
      state["held"] = ws.sync(src, current=state["held"])
      return state["held"]

    seconds, extra_mb, held = _measure(one_sync, args.repeats)
    results[name] = dict(
        seconds=seconds,
        extra_mb=extra_mb,
        max_chunk_bytes=ws.last_stats["max_chunk_bytes"],
        chunks=ws.last_stats["chunks"],
        held=held,
    )
  held = results["reshard_chunked"]["held"]
  t_verify = time.perf_counter()
  resharding.verify(src, held, dst_shardings=dst)
  verify_first_s = time.perf_counter() - t_verify  # includes compiling the two checksum programs
  verify_s, _, _ = _measure(lambda: resharding.verify(src, held, dst_shardings=dst), max(2, args.repeats // 2))
  # Two-phase device_put (re-partition on the trainer devices, then shard-for-shard copy): the default on
  # GPU/TPU without Pathways; measured here for reference (XLA:CPU collectives make it slower on CPU).
  staged = {"held": resharding.reshard(src, dst, two_phase=True)}

  def two_phase_sync():
    staged["held"] = resharding.reshard(src, dst, release=staged["held"], two_phase=True)
    return staged["held"]

  two_phase_s, _, two_phase_held = _measure(two_phase_sync, max(2, args.repeats // 2))
  resharding.verify(src, two_phase_held, dst_shardings=dst)
  del staged, two_phase_held
  host_src = [np.asarray(x) for x in leaves]
  bitwise = all(
      np.array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8)) and b.sharding.device_set == set(rs.sampler_devices)
      for a, b in zip(host_src, jax.tree.leaves(held))
  ) and all(
      np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
      for a, b in zip(jax.tree.leaves(results["reshard"]["held"]), jax.tree.leaves(held))
  )
  for k in ("reshard", "reshard_keep_old"):
    del results[k]["held"]

  # --- host memcpy of the same bytes: into fresh buffers (what any sync into new arrays pays: allocation
  # and first-touch page faults) and into already-faulted buffers (the raw copy bandwidth) ---
  def memcpy_fresh():
    return [a.copy() for a in host_src]

  memcpy_s, _, _ = _measure(memcpy_fresh, args.repeats)
  host_dst = [np.empty_like(a) for a in host_src]

  def memcpy_prefaulted():
    for a, b in zip(host_src, host_dst):
      np.copyto(b, a)

  memcpy_prefaulted()
  memcpy_prefaulted_s, _, _ = _measure(memcpy_prefaulted, args.repeats)
  del host_dst

  # --- legacy: Orbax save + restore into the sampler shardings ---
  flat_src = {f"p{i:04d}": x for i, x in enumerate(leaves)}
  flat_dst = jax.tree.leaves(dst, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for (k, x), s in zip(flat_src.items(), flat_dst)}
  ckptr = ocp.StandardCheckpointer()
  base = tempfile.mkdtemp(prefix="reshard_bench_", dir=args.tmpdir)
  counter = [0]

  def save_restore():
    counter[0] += 1
    path = os.path.join(base, f"step{counter[0]}")
    ckptr.save(path, flat_src)
    ckptr.wait_until_finished()
    return ckptr.restore(path, target)

  try:
    ckpt_s, _, restored = _measure(save_restore, args.ckpt_repeats)
    ckpt_equal = all(
        np.array_equal(np.asarray(restored[k]).view(np.uint8), a.view(np.uint8)) for k, a in zip(flat_src, host_src)
    )
  finally:
    import shutil  # pylint: disable=import-outside-toplevel

    shutil.rmtree(base, ignore_errors=True)
  del restored

  r, rc, rk = results["reshard"], results["reshard_chunked"], results["reshard_keep_old"]
  out = {
      "bytes": nbytes,
      "arrays": len(leaves),
      "devices": f"{len(rs.trainer_devices)}+{len(rs.sampler_devices)}",
      "path": resharding.backend_path(),
      "reshard_s": round(r["seconds"], 4),
      "reshard_chunked_s": round(rc["seconds"], 4),
      "chunk_size": args.chunk_size,
      "chunks": rc["chunks"],
      "memcpy_s": round(memcpy_s, 4),
      "memcpy_prefaulted_s": round(memcpy_prefaulted_s, 4),
      "checkpoint_reload_s": round(ckpt_s, 4),
      "reshard_two_phase_s": round(two_phase_s, 4),
      "verify_s": round(verify_s, 4),
      "verify_first_s": round(verify_first_s, 4),
      "reshard_vs_memcpy": round(r["seconds"] / memcpy_s, 2),
      "reshard_vs_memcpy_prefaulted": round(r["seconds"] / memcpy_prefaulted_s, 2),
      "checkpoint_vs_reshard": round(ckpt_s / r["seconds"], 1),
      "bitwise_equal": bool(bitwise and ckpt_equal),
      "max_chunk_mb": round(rc["max_chunk_bytes"] / 2**20, 1),
      "reshard_peak_extra_mb": None if r["extra_mb"] is None else round(r["extra_mb"], 1),
      "reshard_chunked_peak_extra_mb": None if rc["extra_mb"] is None else round(rc["extra_mb"], 1),
      "reshard_keep_old_s": round(rk["seconds"], 4),
      "reshard_keep_old_peak_extra_mb": None if rk["extra_mb"] is None else round(rk["extra_mb"], 1),
      "peak_rss_mb": round(_status_kb("VmHWM") / 1024, 1),
      "repeats": args.repeats,
      "build_s": round(build_s, 1),
  }
  print(
      f"weight sync, {nbytes / 2**20:.0f} MiB in {len(leaves)} arrays, trainer FSDP x{len(rs.trainer_devices)} "
      f"-> sampler TP x{len(rs.sampler_devices)}, path {out['path']}"
  )
  rows = [
      ("reshard (unchunked)", out["reshard_s"], out["reshard_peak_extra_mb"]),
      (f"reshard (chunk {args.chunk_size} arrays)", out["reshard_chunked_s"], out["reshard_chunked_peak_extra_mb"]),
      ("reshard (reshard_donate=false)", out["reshard_keep_old_s"], out["reshard_keep_old_peak_extra_mb"]),
      ("reshard (two-phase, GPU/TPU default)", out["reshard_two_phase_s"], None),
      ("host memcpy (fresh buffers)", out["memcpy_s"], None),
      ("host memcpy (pre-faulted buffers)", out["memcpy_prefaulted_s"], None),
      ("orbax save + restore", out["checkpoint_reload_s"], None),
      ("checksum guard (compiled)", out["verify_s"], None),
      ("checksum guard (first, compiles)", out["verify_first_s"], None),
  ]
  print(f"{'method':38s} {'median s':>10s} {'peak extra MiB':>15s}")
  for name, s, mb in rows:
    print(f"{name:38s} {s:10.4f} {'' if mb is None else f'{mb:15.1f}'}")
  print(f"largest chunk {out['max_chunk_mb']} MiB; bitwise equal: {out['bitwise_equal']}")
  print(json.dumps(out), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
