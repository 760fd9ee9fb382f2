"""Trainer -> sampler weight sync benchmark: `python -m maxtext_rl_plugin.bench reshard [--help]`.

A MaxText Qwen3-shaped model (308 MiB of float32 parameters by default; `--set base_num_decoder_layers=15` makes it
1 GiB) is built by MaxText on the trainer mesh (FSDP over the first half of the devices); the sampler layout is TP over
the other half, derived from the same logical axes. In one run it measures, each as the median of several repetitions:

* `reshard_s`: `sync.WeightSync.sync` as configured by default (on the device_put path: chunks of at most
  `move.DEFAULT_CHUNK_BYTES`), replacing the sampler's previous weights;
* `reshard_unchunked_s`: the whole tree in one chunk (the default before byte chunks);
* `reshard_chunked_s`: `--chunk-size` parameter arrays per chunk (MaxText's `rl.reshard_chunk_size`);
* `reshard_keep_old_s`: the default chunks with `reshard_donate=false` (old sampler copy kept until replaced);
* `reshard_fresh_src_s`: the default, from a new copy of the trainer's arrays each time, as after an optimizer step;
* `reshard_jax_gather_s`, `reshard_jax_gather_fresh_src_s`: the previous default, unchunked through JAX's own
  `device_put` (`host_buffers.HOST_ASSEMBLY = False`), which gathers each array into a new host array first; with the
  same source arrays again JAX serves that gather from the host copy it cached on the array, so only the fresh-source
  row shows what a training step pays;
* `memcpy_s`: a plain host `memcpy` of the same bytes into fresh buffers (NumPy `copy`: allocation and first-touch page
  faults included, as in any sync that creates new arrays); `memcpy_prefaulted_s`: the same into already-touched
  buffers (raw copy bandwidth), the reference of the `*_vs_memcpy_prefaulted` ratios;
* `checkpoint_reload_s`: the legacy path, Orbax save of the trainer params + restore into the sampler shardings;
* peak extra resident memory during a sync (Linux `VmHWM` after resetting it through `/proc/self/clear_refs`, minus
  the RSS before the sync), against the largest chunk's bytes;
* the checksum guard (`verify_s`), and `bitwise_equal` (sampler arrays vs the trainer's, read back).

On CPU the 8 devices are forced host devices (`--devices`); the same code runs on TPU/Pathways.
"""

# jax, and everything that imports it, is imported inside the functions: XLA reads the forced host device count
# (common.force_host_devices) once, when the backend starts, so main() must set it before any jax import.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from maxtext_rl_plugin.bench import common

DEFAULT_MODEL = [
    "base_emb_dim=1024",
    "base_mlp_dim=4096",
    "base_num_query_heads=8",
    "base_num_kv_heads=4",
    "head_dim=128",
    "base_num_decoder_layers=3",
    "vocab_size=32768",
]


def _parse(argv):
  """The command line (see --help)."""
  p = common.ArgumentParser(prog="python -m maxtext_rl_plugin.bench reshard", description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/cpu_tiny.yml", help="base yml (the model is scaled by --set)")
  p.add_argument("--set", nargs="*", default=[], metavar="K=V", help="extra config overrides (model size etc.)")
  p.add_argument(
      "--devices", type=common.positive_int, default=8, help="forced host devices on CPU (half trainer, half sampler)"
  )
  p.add_argument("--repeats", type=common.positive_int, default=5, help="timed repetitions per method (median reported)")
  p.add_argument(
      "--ckpt-repeats", type=common.non_negative_int, default=2, help="repetitions of the Orbax baseline (0: skip it)"
  )
  p.add_argument(
      "--chunk-size", type=common.positive_int, default=4, help="parameter arrays per chunk for the array-count variant"
  )
  p.add_argument("--no-two-phase", action="store_true", help="skip the two-phase (GPU/TPU default) variant")
  p.add_argument("--tmpdir", default=None, help="where the checkpoint baseline writes (default: system temp)")
  return p.parse_args(argv)


@dataclasses.dataclass
class Setup:
  """The trainer's params on the trainer mesh and the sampler's destination shardings."""

  src: Any
  dst: Any
  sampler_devices: list
  trainer_devices: list
  build_s: float

  @property
  def nbytes(self) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(self.src))


def build(args) -> Setup:
  """MaxText builds the model on the trainer half (FSDP); the sampler layout is TP over the other half."""
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh

  from maxtext_rl_plugin.config import load as config_lib
  from maxtext_rl_plugin.run import models
  from maxtext_rl_plugin.resharding import trees

  half = jax.device_count() // 2
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
  rs = models.setup_devices(config_lib.parse(argv_cfg))
  model, tmesh = models.build_model(rs.trainer_config, rs.trainer_devices)
  src = nnx.state(model, nnx.Param)
  jax.block_until_ready(src)
  shape = {k: 1 for k in tmesh.axis_names}
  shape["tensor"] = len(rs.sampler_devices)
  smesh = Mesh(np.array(rs.sampler_devices).reshape([shape[k] for k in tmesh.axis_names]), tmesh.axis_names)
  dst = trees.logical_shardings(src, smesh, rs.trainer_config.logical_axis_rules)
  return Setup(src, dst, list(rs.sampler_devices), list(rs.trainer_devices), time.perf_counter() - t_build)


def _bits(x):
  import numpy as np

  return np.asarray(x).view(np.uint8)


class _Sampler:
  """The sampler's current weights, replaced by each sync (and freed chunk by chunk when the sync releases them)."""

  def __init__(self, ws, src, held):
    self.ws, self.base, self.src, self.held = ws, src, src, held

  def new_source(self) -> None:
    """New trainer arrays with the same values, as after an optimizer step (no host copy cached on them by JAX)."""
    import jax
    import jax.numpy as jnp

    self.src = jax.block_until_ready(jax.tree.map(jnp.copy, self.base))

  def sync(self):
    self.held = self.ws.sync(self.src, current=self.held)
    return self.held


def _measure_syncs(s: Setup, args) -> dict:
  """Each sync variant, replacing the sampler's previous weights every time; the last result of each is kept."""
  from maxtext_rl_plugin.resharding import host_buffers, move, sync

  variants = {  # name: (chunk_size, chunk_bytes, release_old, fresh source each time, host assembly)
      "reshard": (None, "auto", True, False, True),
      "reshard_unchunked": (None, None, True, False, True),
      "reshard_chunked": (args.chunk_size, None, True, False, True),
      "reshard_keep_old": (None, "auto", False, False, True),
      "reshard_fresh_src": (None, "auto", True, True, True),
      "reshard_jax_gather": (None, None, True, False, False),
      "reshard_jax_gather_fresh_src": (None, None, True, True, False),
  }
  out = {}
  for name, (chunk, chunk_bytes, release, fresh, assemble) in variants.items():
    host_buffers.HOST_ASSEMBLY = assemble
    ws = sync.WeightSync(None, s.dst, chunk_size=chunk, chunk_bytes=chunk_bytes, release_old=release, verify_policy="off")
    sampler = _Sampler(ws, s.src, move.reshard(s.src, s.dst, chunk_size=chunk, chunk_bytes=chunk_bytes))
    t = common.timed(sampler.sync, args.repeats, setup=sampler.new_source if fresh else None, peak=True)
    out[name] = {"seconds": t.seconds, "extra_mb": t.extra_mb, "held": t.result, **ws.last_stats}
    if name not in ("reshard", "reshard_chunked"):
      del out[name]["held"]  # keep RSS down (the 1 GiB run): two held copies are enough to compare
    del sampler
  host_buffers.HOST_ASSEMBLY = True
  return out


def _measure_two_phase(s: Setup, args) -> float | None:
  """Re-partition on the trainer devices, then shard-for-shard copy: the default on GPU/TPU without Pathways; here
  for reference (XLA:CPU collectives make it slower on CPU)."""
  if args.no_two_phase:
    return None
  from maxtext_rl_plugin.resharding import move, verify

  staged = {"held": move.reshard(s.src, s.dst, two_phase=True)}

  def two_phase_sync():
    staged["held"] = move.reshard(s.src, s.dst, release=staged["held"], two_phase=True)
    return staged["held"]

  t = common.timed(two_phase_sync, max(2, args.repeats // 2))
  verify.verify(s.src, t.result, dst_shardings=s.dst)
  return t.seconds


def _measure_memcpy(host_src: list, repeats: int) -> tuple[float, float]:
  """Host memcpy of the same bytes into fresh buffers and into already-faulted ones (seconds, seconds)."""
  import numpy as np

  fresh = common.timed(lambda: [a.copy() for a in host_src], repeats).seconds
  host_dst = [np.empty_like(a) for a in host_src]

  def prefaulted():
    for a, b in zip(host_src, host_dst):
      np.copyto(b, a)

  prefaulted()
  return fresh, common.timed(prefaulted, repeats).seconds


def _measure_checkpoint(s: Setup, host_src: list, args) -> tuple[float | None, bool]:
  """Orbax save + restore into the sampler shardings (seconds, bit-exact); (None, True) when skipped."""
  if args.ckpt_repeats <= 0:
    return None, True
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  leaves = jax.tree.leaves(s.src)
  flat_src = {f"p{i:04d}": x for i, x in enumerate(leaves)}
  flat_dst = jax.tree.leaves(s.dst, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=d) for (k, x), d in zip(flat_src.items(), flat_dst)}
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
    t = common.timed(save_restore, args.ckpt_repeats)
    equal = all(np.array_equal(_bits(t.result[k]), a.view(np.uint8)) for k, a in zip(flat_src, host_src))
  finally:
    shutil.rmtree(base, ignore_errors=True)
  return t.seconds, equal


def measure(s: Setup, args) -> dict:
  """Every method on the same bytes, in one process; bit-exactness of what the sampler ends up holding."""
  import jax
  import numpy as np

  from maxtext_rl_plugin.resharding import verify

  syncs = _measure_syncs(s, args)
  held = syncs["reshard_chunked"].pop("held")
  default_held = syncs["reshard"].pop("held")
  t_verify = time.perf_counter()
  verify.verify(s.src, held, dst_shardings=s.dst)
  verify_first_s = time.perf_counter() - t_verify  # includes compiling the two checksum programs
  verify_s = common.timed(lambda: verify.verify(s.src, held, dst_shardings=s.dst), max(2, args.repeats // 2))
  host_src = [np.asarray(x) for x in jax.tree.leaves(s.src)]
  bitwise = all(
      np.array_equal(a.view(np.uint8), _bits(b)) and b.sharding.device_set == set(s.sampler_devices)
      for a, b in zip(host_src, jax.tree.leaves(held))
  ) and all(np.array_equal(a.view(np.uint8), _bits(b)) for a, b in zip(host_src, jax.tree.leaves(default_held)))
  del held, default_held
  two_phase_s = _measure_two_phase(s, args)
  memcpy_s, memcpy_prefaulted_s = _measure_memcpy(host_src, args.repeats)
  ckpt_s, ckpt_equal = _measure_checkpoint(s, host_src, args)
  return {
      "syncs": syncs,
      "verify_s": verify_s.seconds,
      "verify_first_s": verify_first_s,
      "two_phase_s": two_phase_s,
      "memcpy_s": memcpy_s,
      "memcpy_prefaulted_s": memcpy_prefaulted_s,
      "checkpoint_s": ckpt_s,
      "bitwise_equal": bool(bitwise and ckpt_equal),
  }


def _r(x, nd=4):
  return None if x is None else round(x, nd)


def report(s: Setup, m: dict, args) -> dict:
  """Print the table; return the final JSON record (seconds, ratios to the pre-faulted memcpy, bytes/s)."""
  import jax

  from maxtext_rl_plugin.resharding import backend, move

  nbytes, syncs, pre = s.nbytes, m["syncs"], m["memcpy_prefaulted_s"]
  out = {
      "bytes": nbytes,
      "arrays": len(jax.tree.leaves(s.src)),
      "devices": f"{len(s.trainer_devices)}+{len(s.sampler_devices)}",
      "path": backend.backend_path(),
      "default_chunk_bytes": move.DEFAULT_CHUNK_BYTES,
      "chunk_size": args.chunk_size,
      "memcpy_s": _r(m["memcpy_s"]),
      "memcpy_prefaulted_s": _r(pre),
      "checkpoint_reload_s": _r(m["checkpoint_s"]),
      "reshard_two_phase_s": _r(m["two_phase_s"]),
      "verify_s": _r(m["verify_s"]),
      "verify_first_s": _r(m["verify_first_s"]),
      "bitwise_equal": m["bitwise_equal"],
  }
  for name, r in syncs.items():
    out[f"{name}_s"] = _r(r["seconds"])
    out[f"{name}_vs_memcpy_prefaulted"] = round(r["seconds"] / pre, 2)
    out[f"{name}_chunks"] = r["chunks"]
    out[f"{name}_max_chunk_mb"] = round(r["max_chunk_bytes"] / 2**20, 1)
    out[f"{name}_peak_extra_mb"] = _r(r["extra_mb"], 1)
  out["reshard_vs_memcpy"] = round(syncs["reshard"]["seconds"] / m["memcpy_s"], 2)
  out["reshard_bytes_per_s"] = round(nbytes / syncs["reshard"]["seconds"])
  out["reshard_fresh_src_bytes_per_s"] = round(nbytes / syncs["reshard_fresh_src"]["seconds"])
  out["memcpy_prefaulted_bytes_per_s"] = round(nbytes / pre)
  if m["checkpoint_s"] is not None:
    out["checkpoint_vs_reshard"] = round(m["checkpoint_s"] / syncs["reshard"]["seconds"], 1)
  out.update(peak_rss_mb=round(common.status_kb("VmHWM") / 1024, 1), repeats=args.repeats, build_s=round(s.build_s, 1))
  print(
      f"weight sync, {nbytes / 2**20:.0f} MiB in {out['arrays']} arrays, trainer FSDP x{len(s.trainer_devices)} "
      f"-> sampler TP x{len(s.sampler_devices)}, path {out['path']}, load {os.getloadavg()[0]:.1f}"
  )
  print(f"{'method':30s} {'median s':>9s} {'x memcpy':>9s} {'chunks':>7s} {'peak extra MiB':>15s}")
  for name, r in syncs.items():
    mb = "" if r["extra_mb"] is None else f"{r['extra_mb']:15.1f}"
    print(f"{name:30s} {r['seconds']:9.4f} {r['seconds'] / pre:9.2f} {r['chunks']:7d} {mb}")
  for name, sec in (
      ("two-phase (GPU/TPU default)", m["two_phase_s"]),
      ("host memcpy (fresh buffers)", m["memcpy_s"]),
      ("host memcpy (pre-faulted)", pre),
      ("orbax save + restore", m["checkpoint_s"]),
      ("checksum guard (compiled)", m["verify_s"]),
  ):
    if sec is not None:
      print(f"{name:30s} {sec:9.4f} {sec / pre:9.2f}")
  print(f"bitwise equal: {out['bitwise_equal']}; default path {out['reshard_bytes_per_s'] / 1e9:.2f} GB/s")
  return out


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  if common.start_split_bench(args.devices) is None:
    return 2
  from maxtext_rl_plugin.errors import exit_on_user_error

  with exit_on_user_error():
    setup = build(args)
  print(common.finite_json(report(setup, measure(setup, args), args)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
