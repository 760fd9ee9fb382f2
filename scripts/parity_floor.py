"""The parity gate's floor and its near misses on the CPU demo model (run/parity.py, docs/moe.md "Tolerances").

  python scripts/parity_floor.py --out /tmp/parity_floor --warm 300 --seeds 0 1 2 3 4
  python scripts/parity_floor.py --out /tmp/parity_floor --export tests/data/parity_demo_logps.npz

Trains the demo's SFT warm start once (`--warm` steps, in `<out>/runs/warm`), then for each seed, dtype and mutation runs
`train_rl configs/cpu_demo.yml` in this process up to the parity gate of step 1 (one step of 8 x 8 samples at the
demo's temperature 1), with the mutation installed in the sampler's copy of the weights only (where the embedded
engine installs them, as tests/run/test_parity.py does) and the SFT checkpoint copied into the run. The gate's inputs
(the sampler's and the trainer's log-probs of the sampled tokens, the completion mask) go to `<out>/logps/*.npz`
and the gate itself is skipped, so every case reaches the same point; a finished case is not run again. Then it
prints |d| mean and max (lowest-highest over the seeds) per case as Markdown. `--export` writes, per case of
tests/run/test_parity.py's replay test, the seed that is hardest for the gate (honest: the largest figures; a mutation:
the smallest) as the masked log-probs that test reads.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import _in_process as in_process  # pylint: disable=wrong-import-position  # the tests' in-process train_rl
from maxtext_rl_plugin.resharding import quantize as qz  # pylint: disable=wrong-import-position
from maxtext_rl_plugin.rollout import embedded  # pylint: disable=wrong-import-position
from maxtext_rl_plugin.run import parity  # pylint: disable=wrong-import-position

ONE = 20  # the demo tokenizer's id of "1" (configs/tokenizers/arith-bpe-512)


def _layers(state):
  return state["base"]["decoder"]["layers"]


def _heads_swapped(layer):
  def f(state):  # query kernel [emb, layers, heads, head_dim]
    q = _layers(state)["self_attention"]["query"]["kernel"]
    q.value = q.value.at[:, layer, jnp.array([0, 1])].set(q.value[:, layer, jnp.array([1, 0])])

  return f


def _norm_scaled(state):
  norm = state["base"]["decoder"]["decoder_norm"]["scale"]
  norm.value = norm.value * 1.05


def _out_scaled(state):  # attention output kernel [heads, layers, head_dim, emb]
  out = _layers(state)["self_attention"]["out"]["kernel"]
  out.value = out.value.at[:, 1].multiply(1.02)


def _row_scaled(state):  # tied embedding: the token's input row and its output logit
  emb = state["base"]["token_embedder"]["embedding"]
  emb.value = emb.value.at[ONE].multiply(1.1)


def _quantized(name, corrupt=None):
  """The sampler reads quantized weights (rollout_quantization=name): each planned kernel is quantized and read back
  in the compute dtype, which is what the embedded engine's dequantize-on-read computes with. `corrupt` damages the
  scales first: 'fnuz' reads e4m3 scales as e4m3fnuz's (bound 240 instead of 448: every weight x1.87 -- a sync that
  mixes the two float8 variants); 'rev_out_L1' gives layer 1's attention output kernel its scales in reversed channel
  order (a scale layout mix-up in one tensor)."""

  def f(state):
    pure = nnx.to_pure_dict(state)
    form, axes_of = qz.fmt(name), qz.plan(pure, scan_axis=1)

    def one(path, x):
      key = jax.tree_util.keystr(path)
      axes = axes_of.get(key)
      if axes is None:
        return x
      qw = qz.quantize(x, form, axes)
      if corrupt == "fnuz":
        qw = qz.Quantized(qw.q, qw.scale * (448.0 / 240.0))
      if corrupt == "rev_out_L1" and "['out']['kernel']" in key:  # scale [1, layers, 1, emb]
        scale = jnp.asarray(qw.scale)
        qw = qz.Quantized(qw.q, scale.at[:, 1].set(scale[:, 1, :, ::-1]))
      return qz.dequantize(qw, x.dtype)

    new = jax.tree_util.tree_map_with_path(one, pure)
    nnx.replace_by_pure_dict(state, new)

  return f


MUTATIONS = {
    "honest": None,
    "heads01_L0": _heads_swapped(0),
    "heads01_L1": _heads_swapped(1),
    "heads01_L2": _heads_swapped(2),
    "heads01_L3": _heads_swapped(3),
    "norm_x1.05": _norm_scaled,
    "out_L1_x1.02": _out_scaled,
    "row_x1.1": _row_scaled,
    "int8": _quantized("int8"),
    "fp8": _quantized("fp8"),
    "fp8_fnuz": _quantized("fp8", "fnuz"),
    "fp8_rev_out_L1": _quantized("fp8", "rev_out_L1"),
    "int8_rev_out_L1": _quantized("int8", "rev_out_L1"),
}
EXPORT = {
    "float32": ["honest", "heads01_L2", "norm_x1.05", "out_L1_x1.02", "row_x1.1"],
    "bfloat16": ["honest", "heads01_L2"],
}
# `--export ... --export-set quantized`: tests/run/test_parity.py's quantized-sampler cases (one file per warm-start
# stage).
EXPORT_QUANTIZED = {
    "float32": ["int8", "fp8", "fp8_fnuz", "fp8_rev_out_L1", "int8_rev_out_L1"],
    "bfloat16": ["int8", "fp8"],
}


class _Gate(Exception):
  """Raised at the gate with its inputs: nothing after it is measured."""


CONFIG = ["configs/cpu_demo.yml"]  # --config: e.g. configs/cpu_demo_moe.yml (the MoE demo: routing mismatch too)


def _argv(out, name, warm, *overrides):
  return [
      *CONFIG,
      f"base_output_directory={out}/runs",
      f"run_name={name}",
      f"sft_warmup_steps={warm}",
      "num_batches=1",
      "num_test_batches=0",
      "eval_interval=0",
      *overrides,
  ]


def _measure(out, name, warm, mutation, overrides) -> dict:
  """One run to its gate: the gate's inputs (sampler and trainer log-probs, mask)."""
  real_install, real_figures = embedded._on_rollout_mesh, parity.figures  # pylint: disable=protected-access

  def install(actor, mesh, cfg):
    model = real_install(actor, mesh, cfg)
    if mutation is None:
      return model
    copy = nnx.clone(model)  # the sampler's own copy; the trainer keeps the true weights
    state = nnx.state(copy, nnx.Param)
    mutation(state)
    nnx.update(copy, state)
    return copy

  def figures(sampler, trainer, mask, routing_mismatch=None):
    z = {"sampler": np.asarray(sampler), "trainer": np.asarray(trainer), "mask": np.asarray(mask, bool)}
    if routing_mismatch is not None:
      z["routing_mismatch"] = np.float64(routing_mismatch)
    raise _Gate(z)

  embedded._on_rollout_mesh, parity.figures = install, figures  # pylint: disable=protected-access
  try:
    p = in_process.train_rl(_argv(out, name, warm, *overrides))
  except _Gate as gate:
    return gate.args[0]
  finally:
    embedded._on_rollout_mesh, parity.figures = real_install, real_figures  # pylint: disable=protected-access
  raise SystemExit(f"{name}: the run ended before its parity gate (rc {p.returncode}):\n{p.stderr[-3000:]}")


def run(args) -> None:
  """The warm start (once), then every (seed, dtype, mutation) case not yet on disk."""
  warm_dir = os.path.join(args.out, "runs", "warm", "checkpoints", "sft")
  if not os.path.isdir(os.path.join(warm_dir, str(args.warm))):
    _measure(args.out, "warm", args.warm, None, ["rl.parity_check=first"])
  os.makedirs(os.path.join(args.out, "logps"), exist_ok=True)
  for seed in args.seeds:
    for dtype in args.dtypes:
      for name in args.mutations:
        path = os.path.join(args.out, "logps", f"{dtype}_s{seed}_{name}.npz")
        if os.path.exists(path):
          continue
        run_name = f"{dtype}_s{seed}_{name}".replace(".", "_")
        shutil.rmtree(os.path.join(args.out, "runs", run_name), ignore_errors=True)
        shutil.copytree(warm_dir, os.path.join(args.out, "runs", run_name, "checkpoints", "sft"))
        overrides = [f"dtype={dtype}", f"rollout_seed={seed}", f"data_shuffle_seed={seed}"]
        np.savez(path, **_measure(args.out, run_name, args.warm, MUTATIONS[name], overrides))
        shutil.rmtree(os.path.join(args.out, "runs", run_name), ignore_errors=True)
        print(f"{path}: {_figs(np.load(path))}", flush=True)


def _d(z) -> np.ndarray:
  return np.abs(z["sampler"].astype(np.float64) - z["trainer"].astype(np.float64))[z["mask"]]


def _figs(z) -> str:
  d = _d(z)
  routing = f", routing mismatch {float(z['routing_mismatch']):.3g}" if "routing_mismatch" in z else ""
  return f"{d.size} tokens, mean {d.mean():.2g}, max {d.max():.3g}{routing}"


def _cases(out):
  cases: dict = {}
  for path in sorted(glob.glob(os.path.join(out, "logps", "*.npz"))):
    dtype, seed, name = re.match(r"(\w+?)_s(\d+)_(.+)\.npz$", os.path.basename(path)).groups()
    cases.setdefault((dtype, name), []).append((int(seed), path))
  return cases


def table(args) -> None:
  """|d| mean and max per case, lowest-highest over the seeds, as Markdown."""
  print(
      "| dtype | sampler | seeds | \\|d\\| mean | \\|d\\| max | routing mismatch |\n"
      "| --- | --- | ---: | ---: | ---: | ---: |"
  )
  for (dtype, name), runs in sorted(_cases(args.out).items()):
    zs = [np.load(p) for _, p in runs]
    d = [_d(z) for z in zs]
    means, maxes = [x.mean() for x in d], [x.max() for x in d]
    routing = [float(z["routing_mismatch"]) for z in zs if "routing_mismatch" in z]
    shown = f"{min(routing):.3g} - {max(routing):.3g}" if routing else "-"
    print(
        f"| {dtype} | {name} | {len(d)} | {min(means):.2g} - {max(means):.2g} | {min(maxes):.3g} - {max(maxes):.3g} "
        f"| {shown} |"
    )


def export(args) -> None:
  """The replay test's cases, each at its hardest seed, as masked float32 log-probs."""
  out = {}
  cases = _cases(args.out)
  for dtype, names in (EXPORT_QUANTIZED if args.export_set == "quantized" else EXPORT).items():
    for name in names:
      if (dtype, name) not in cases:
        continue
      runs = [np.load(p) for _, p in cases[(dtype, name)]]
      honest = name in ("honest", "int8", "fp8")
      score = [(_d(z).mean() + 1e-3 * _d(z).max()) * (-1 if honest else 1) for z in runs]
      z = runs[int(np.argmin(score))]
      out[f"{dtype}/{name}/sampler"] = z["sampler"][z["mask"]].astype(np.float32)
      out[f"{dtype}/{name}/trainer"] = z["trainer"][z["mask"]].astype(np.float32)
      print(f"{dtype}/{name}: {_figs(z)}")
  np.savez_compressed(args.export, **out)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python scripts/parity_floor.py")
  ap.add_argument("--out", required=True)
  ap.add_argument("--warm", type=int, default=300, help="SFT warm-start steps (the demo's 300)")
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
  ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  ap.add_argument("--mutations", nargs="+", default=list(MUTATIONS), choices=list(MUTATIONS))
  ap.add_argument("--export", help="write the replay test's log-probs here instead of running")
  ap.add_argument("--export-set", default="demo", choices=["demo", "quantized"], help="which cases --export writes")
  ap.add_argument("--config", default=CONFIG[0], help="the demo config (configs/cpu_demo_moe.yml: the MoE demo)")
  args = ap.parse_args(argv)
  CONFIG[0] = args.config
  os.chdir(ROOT)
  if args.export:
    export(args)
    return 0
  run(args)
  table(args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
