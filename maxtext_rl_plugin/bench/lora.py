"""Adapter-only vs full weight sync: `python -m maxtext_rl_plugin.bench lora [--help]`.

For each of two MaxText Qwen3-shaped model sizes, the actor is built by MaxText on the trainer half of the devices
(FSDP) with LoRA applied by MaxText's `apply_lora_to_model` (`lora.*` keys), and the sampler copy is laid out on the
other half (TP), as in a disaggregated run. Measured in one run, each as the median of several repetitions:

* `full`: `sync.WeightSync.sync` of every base parameter (what a full fine-tuning run moves per sync);
* `adapter`: the same sync of the `nnx.LoRAParam` state only (what `RLCluster.sync_weights` sends a LoRA actor's
  engine), plus `merge`: the embedded engine re-merging `W + alpha/rank * A @ B` into its decode weights, which it
  does once after each adapter sync (`lora.Merger`);
* the bytes each sync moves, and whether the sampler then holds the trainer's adapters bit for bit.

The final JSON line has the per-size numbers and the full / adapter ratios (bytes, sync time, sync + merge time).
"""

from __future__ import annotations

import sys

from maxtext_rl_plugin.bench import common

# JAX (and every plugin module that imports it) is imported inside functions, after `common.force_host_devices`
# has set XLA_FLAGS: XLA reads the host device count once, when the backend starts.
# pylint: disable=import-outside-toplevel

# Two sizes: ~40 MiB and ~300 MiB of float32 parameters (vocab 32768).
SIZES = {
    "small": [
        "base_emb_dim=256",
        "base_mlp_dim=1024",
        "base_num_query_heads=4",
        "base_num_kv_heads=2",
        "head_dim=64",
        "base_num_decoder_layers=2",
        "vocab_size=32768",
    ],
    "large": [
        "base_emb_dim=1024",
        "base_mlp_dim=4096",
        "base_num_query_heads=8",
        "base_num_kv_heads=4",
        "head_dim=128",
        "base_num_decoder_layers=4",
        "vocab_size=32768",
    ],
}


def _parse(argv):
  """The command line (see --help)."""
  p = common.ArgumentParser(prog="python -m maxtext_rl_plugin.bench lora", description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/cpu_tiny.yml", help="base yml (the model is sized by SIZES / --set)")
  p.add_argument("--set", nargs="*", default=[], metavar="K=V", help="extra config overrides (both sizes)")
  p.add_argument("--rank", type=common.positive_int, default=16, help="lora.lora_rank")
  p.add_argument("--alpha", type=common.positive_float, default=32.0, help="lora.lora_alpha")
  p.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES), help="model sizes to measure")
  p.add_argument(
      "--devices", type=common.positive_int, default=8, help="forced host devices on CPU (half trainer, half sampler)"
  )
  p.add_argument("--repeats", type=common.positive_int, default=5, help="timed repetitions per method (median reported)")
  return p.parse_args(argv)


def _one_size(name: str, args) -> dict:
  """Build one model size with LoRA, then time its full and adapter-only syncs and the engine's re-merge."""
  import jax
  import numpy as np
  from flax import nnx
  from flax.core.spmd import logical_axis_rules
  from jax.sharding import Mesh

  from maxtext_rl_plugin.config import load as config_lib
  from maxtext_rl_plugin import lora
  from maxtext_rl_plugin.run import models as run_models
  from maxtext_rl_plugin.resharding import move
  from maxtext_rl_plugin.resharding import sync as sync_lib

  half = jax.device_count() // 2
  argv = [
      args.config,
      *SIZES[name],
      "use_pathways=true",
      f"chips_per_vm={half}",
      f"ici_fsdp_parallelism={half}",
      "enable_checkpointing=false",
      "lora.enable_lora=true",
      f"lora.lora_rank={args.rank}",
      f"lora.lora_alpha={args.alpha}",
      *args.set,
  ]
  rs = run_models.setup_devices(config_lib.parse(argv))
  cfg = rs.trainer_config
  base, tmesh = run_models.build_model(cfg, rs.trainer_devices)
  actor, _ = run_models.apply_lora(cfg, base, tmesh)
  # Non-zero adapters (B starts at zero), on the adapters' own shardings, as after some training.
  st = nnx.state(actor, nnx.LoRAParam)
  keys = iter(jax.random.split(jax.random.PRNGKey(0), len(jax.tree.leaves(st))))
  nnx.update(
      actor,
      jax.tree.map(lambda x: jax.device_put(jax.random.normal(next(keys), x.shape, x.dtype) * 0.01, x.sharding), st),
  )
  shape = {k: 1 for k in tmesh.axis_names}
  shape["tensor"] = len(rs.sampler_devices)
  smesh = Mesh(np.array(rs.sampler_devices).reshape([shape[k] for k in tmesh.axis_names]), tmesh.axis_names)
  with logical_axis_rules(cfg.logical_axis_rules):
    sampler = move.model_on_mesh(actor, smesh, cfg.logical_axis_rules)
  base_only = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
  full_src, lora_src = nnx.state(actor, base_only), nnx.state(actor, nnx.LoRAParam)
  jax.block_until_ready((full_src, lora_src))
  out = {"params_mib": round(sum(x.nbytes for x in jax.tree.leaves(full_src)) / 2**20, 1)}
  for kind, src, filt in (("full", full_src, base_only), ("adapter", lora_src, nnx.LoRAParam)):
    ws = sync_lib.WeightSync(sync_lib.SyncSettings.from_config(cfg), sampler, verify_policy="off")

    def sync(ws=ws, src=src, filt=filt):
      held = ws.sync(src, current=nnx.state(sampler, filt), apply=lambda new: (nnx.update(sampler, new), new)[1])
      jax.block_until_ready(held)
      return held

    sync()  # warm-up (first sync compiles nothing, but faults in the destination buffers)
    t = common.timed(sync, args.repeats)
    held = t.result
    out[f"{kind}_sync_s"] = round(t.seconds, 4)
    out[f"{kind}_bytes"] = int(ws.last_bytes)
    out[f"{kind}_arrays"] = len(jax.tree.leaves(held))
  merger = lora.Merger(lora.LoraSettings.from_config(cfg).scale, int(cfg.param_scan_axis))

  def merge():
    merger.forget()  # forces the re-merge that an adapter sync triggers
    m = merger.merged(sampler.base)
    jax.block_until_ready(m)
    return m

  merge()  # compiles
  out["merge_s"] = round(common.timed(merge, args.repeats).seconds, 4)
  out["adapter_bitwise_equal"] = all(
      np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
      for a, b in zip(jax.tree.leaves(lora_src), jax.tree.leaves(nnx.state(sampler, nnx.LoRAParam)))
  )
  out["bytes_ratio"] = round(out["full_bytes"] / out["adapter_bytes"], 1)
  out["sync_time_ratio"] = round(out["full_sync_s"] / out["adapter_sync_s"], 1)
  out["sync_plus_merge_ratio"] = round(out["full_sync_s"] / (out["adapter_sync_s"] + out["merge_s"]), 2)
  return out


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  n_dev = common.start_split_bench(args.devices)
  if n_dev is None:
    return 2
  from maxtext_rl_plugin.resharding import backend
  from maxtext_rl_plugin.errors import exit_on_user_error

  results = {}
  with exit_on_user_error():
    for name in args.sizes:
      results[name] = _one_size(name, args)
  print(
      f"LoRA rank {args.rank} alpha {args.alpha}: trainer FSDP x{n_dev // 2} -> sampler TP x{n_dev // 2}, "
      f"path {backend.backend_path()}, median of {args.repeats}"
  )
  print(
      f"{'size':6s} {'params MiB':>10s} {'full MiB':>9s} {'adapter MiB':>11s} {'full s':>8s} {'adapter s':>9s} "
      f"{'merge s':>8s} {'bytes x':>8s} {'sync x':>7s} {'sync+merge x':>12s}"
  )
  for name, r in results.items():
    print(
        f"{name:6s} {r['params_mib']:10.1f} {r['full_bytes'] / 2**20:9.1f} {r['adapter_bytes'] / 2**20:11.2f} "
        f"{r['full_sync_s']:8.4f} {r['adapter_sync_s']:9.4f} {r['merge_s']:8.4f} {r['bytes_ratio']:8.1f} "
        f"{r['sync_time_ratio']:7.1f} {r['sync_plus_merge_ratio']:12.2f}"
    )
  print(
      common.finite_json(
          {
              "rank": args.rank,
              "alpha": args.alpha,
              "repeats": args.repeats,
              "path": backend.backend_path(),
              "sizes": results,
          }
      ),
      flush=True,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
