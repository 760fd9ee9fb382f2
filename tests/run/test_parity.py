"""The parity gate (parity.py): a sampler that computes another function stops the run before its first update.

The mutations are the field's silent weight-sync defects, same shapes, right bytes in the wrong place: the MLP's gate
and up kernels exchanged, two kv heads exchanged (keys and values together), and issue 61's near misses on the demo
model after its warm start (two query heads exchanged in one layer, the final norm's scale x1.05, one layer's attention
output x1.02, one token's embedding row x1.1), where a trained model's confident tokens dilute the mean. They are
injected where the embedded engine installs its weights (`embedded._on_rollout_mesh`, the sampler's copy of the
trainer's weights), so the trainer keeps the true ones. The references are independent of the gate: the figures'
arithmetic against NumPy, and the tolerances against the table in parity.py's docstring, whose measured log-probs
(tests/data/parity_demo_logps.npz) replay through the gate in the default tier. The honest run (the gate passes and
logs its figures at each launch's first step) is tests/test_train_e2e.py's GRPO run and its resume, which run the gate
by default; the demo-model runs (extended, ~100 s) sample and score the near misses end to end.
"""

from __future__ import annotations

import json
import pathlib
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import parity
from maxtext_rl_plugin.rollout import embedded
import _in_process as in_process
from _tiny import SMALL_VOCAB


def _argv(tmp_path, name, *overrides):
  out = tmp_path / "runs"
  return [
      "configs/cpu_tiny.yml",
      *SMALL_VOCAB,
      f"base_output_directory={out}",
      f"run_name={name}",
      f"metrics_file={out / name / 'metrics.jsonl'}",
      "num_batches=1",
      "num_test_batches=0",
      "eval_interval=0",
      "enable_checkpointing=false",
      # A near-one-hot random-init model: a high temperature samples distinct tokens (log-probs at that temperature).
      "decode_sampling_temperature=30",
      *overrides,
  ]


def _records(tmp_path, name):
  path = tmp_path / "runs" / name / "metrics.jsonl"
  if not path.exists():
    return []
  return [r for r in (json.loads(l) for l in path.read_text().splitlines() if l.strip()) if "reward/mean" in r]


def _swap(state, pick, fn):
  """`state` with `fn` applied to the Param leaves whose path `pick` selects."""

  def f(path, x):
    keys = [str(getattr(k, "key", k)) for k in path]
    return fn(keys, x) if pick(keys) else x

  return jax.tree_util.tree_map_with_path(f, state)


def _gate_up_swapped(model):
  """The MLP's wi_0 (gate) and wi_1 (up) kernels exchanged: same shapes, another function (silu(up) * gate)."""
  state = nnx.state(model, nnx.Param)
  mlp = state["base"]["decoder"]["layers"]["mlp"]
  gate, up = mlp["wi_0"]["kernel"].value, mlp["wi_1"]["kernel"].value
  mlp["wi_0"]["kernel"].value, mlp["wi_1"]["kernel"].value = up, gate
  return state


def _kv_heads_swapped(model):
  """kv heads 0 and 1 exchanged in the key and value kernels ([emb, layers, kv_heads, head_dim] when scanned)."""
  state = nnx.state(model, nnx.Param)
  attn = state["base"]["decoder"]["layers"]["self_attention"]
  for name in ("key", "value"):
    k = attn[name]["kernel"].value
    attn[name]["kernel"].value = jnp.flip(k, axis=-2) if k.shape[-2] == 2 else k
  return state


@pytest.fixture(name="mutate")
def mutate_fixture(monkeypatch):
  """Install a mutated copy of the trainer's weights as the sampler's (`mutation(model) -> Param state`)."""

  def use(mutation):
    original = embedded._on_rollout_mesh  # pylint: disable=protected-access  # the engine's one weight install

    def install(actor, mesh, cfg):
      model = original(actor, mesh, cfg)
      copy = nnx.clone(model)  # the sampler's own copy; the trainer keeps the true weights
      nnx.update(copy, mutation(copy))
      return copy

    monkeypatch.setattr(embedded, "_on_rollout_mesh", install)

  return use


@pytest.mark.parametrize("mutation", [_gate_up_swapped, _kv_heads_swapped], ids=["gate_up", "kv_heads"])
def test_a_wrong_same_shape_mapping_stops_the_run_before_its_first_update(tmp_path, mutate, mutation):
  """The sampler's weights hold the trainer's bytes in the wrong place: step 1 stops with one line naming the step,
  the figure and the tolerance, before any update (no step record, no checkpoint)."""
  mutate(mutation)
  p = in_process.train_rl(_argv(tmp_path, "bad"))
  assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-4000:]
  lines = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1, p.stderr[-3000:]
  line = lines[0]
  assert "step 1:" in line and "rl.parity_logp_tolerance_mean = 2e-05" in line and "float32/float32" in line
  figure = float(line.split("completion tokens")[0].split("= ")[-1].split(" over")[0])
  assert figure > 1e-2  # far past float32's ~1e-6: another function, not rounding
  assert "Traceback" not in p.stderr
  assert _records(tmp_path, "bad") == []  # stopped before the update: no step was recorded


def test_figures_tolerances_and_the_one_line():
  """Figures against NumPy by hand; tolerances by precision pairing and key; each figure's line."""
  s = np.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
  t = np.array([[-1.1, -2.0, -2.0], [-0.5, -0.7, 9.0]])
  mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
  figs = parity.figures(s, t, mask, routing_mismatch=0.25)
  assert figs["parity/logp_abs_diff_mean"] == pytest.approx((0.1 + 0 + 1.0 + 0 + 0.2) / 5)
  assert figs["parity/logp_abs_diff_max"] == pytest.approx(1.0) and figs["parity/tokens"] == 5
  assert figs["parity/routing_mismatch_fraction"] == 0.25

  f32 = config_lib.load_config(["configs/cpu_tiny.yml"])
  bf16 = config_lib.load_config(["configs/cpu_tiny.yml", "dtype=bfloat16"])
  assert parity.pairing(f32) == "float32/float32" and parity.pairing(bf16) == "bfloat16/bfloat16"
  assert parity.pairing(config_lib.load_config(["configs/cpu_tiny.yml", "weight_dtype=bfloat16"]), "vllm") == (
      "bfloat16/float32"
  )
  # The table in parity.py's docstring: float32 matmuls (the CPU, or an accelerator at matmul_precision=highest) get
  # the tight row; float32 multiplied at reduced precision (an accelerator's default) and bfloat16 the loose one.
  tight, loose = parity.Tolerance(2e-5, 1e-2, 0.01), parity.Tolerance(0.05, 1.5, 0.10)
  assert parity.tolerance(f32) == tight and parity.tolerance(f32, backend="cpu") == tight
  assert parity.tolerance(bf16) == loose and parity.tolerance(bf16, backend="tpu") == loose
  for backend in ("gpu", "tpu"):
    assert parity.pairing(f32, backend=backend) == "float32/float32 at reduced-precision matmuls"
    assert parity.tolerance(f32, backend=backend) == loose
  highest = config_lib.load_config(["configs/cpu_tiny.yml", "matmul_precision=highest"])
  assert parity.pairing(highest, backend="gpu") == "float32/float32" and parity.tolerance(highest, backend="tpu") == tight
  keyed = config_lib.load_config(["configs/cpu_tiny.yml", "rl.parity_logp_tolerance_mean=0.5"])
  assert parity.tolerance(keyed) == parity.Tolerance(0.5, 1e-2, 0.01)
  assert parity.due(f32, 1) and not parity.due(f32, 2)
  every = config_lib.load_config(["configs/cpu_tiny.yml", "rl.parity_check=every_n", "rl.parity_check_every=3"])
  assert [n for n in range(1, 8) if parity.due(every, n)] == [1, 3, 6]
  off = config_lib.load_config(["configs/cpu_tiny.yml", "rl.parity_check=off"])
  assert not parity.due(off, 1)

  tol = parity.Tolerance(1e-3, 0.1, 0.01)
  parity.check(3, {"parity/logp_abs_diff_mean": 1e-4, "parity/logp_abs_diff_max": 1e-2}, tol, "float32/float32")
  cases = [
      ({"parity/logp_abs_diff_mean": 0.3, "parity/logp_abs_diff_max": 2.0}, "rl.parity_logp_tolerance_mean"),
      (
          {"parity/logp_abs_diff_mean": 1e-4, "parity/logp_abs_diff_max": 1e-2, "parity/routing_mismatch_fraction": 0.2},
          "rl.parity_routing_tolerance",
      ),
      ({"parity/logp_abs_diff_mean": 1e-4, "parity/logp_abs_diff_max": 0.5}, "rl.parity_logp_tolerance_max"),
  ]
  for figs, key in cases:
    with pytest.raises(parity.ParityError, match=key) as e:
      parity.check(3, figs, tol, "float32/float32")
    assert "\n" not in str(e.value) and str(e.value).startswith("step 3:") and "Likeliest cause" in str(e.value)


# The demo's recorded log-probs: parity.py's measurement (the README's demo model after its 300-step SFT warm start,
# one step of 8 x 8 samples at temperature 1, the sampler's copy mutated), for each case the seed of five that is
# hardest for the gate (honest: the largest figures; a mutation: the smallest). Masked completion tokens only.
DEMO_LOGPS = pathlib.Path(__file__).resolve().parents[1] / "data" / "parity_demo_logps.npz"
NEAR_MISSES = {  # case -> what the default gate must say (parity.py's table)
    "float32/honest": False,
    "float32/heads01_L2": True,  # query heads 0 and 1 exchanged in layer 2 (of 0-3)
    "float32/norm_x1.05": True,  # the final norm's scale x1.05
    "float32/out_L1_x1.02": True,  # layer 1's attention output kernel x1.02 (the old defaults missed it on 5 of 5 seeds)
    "float32/row_x1.1": True,  # the '1' token's embedding row x1.1 (tied: its logit too)
    "bfloat16/honest": False,
    "bfloat16/heads01_L2": True,
}


def test_the_demos_measured_near_misses_stop_at_the_default_tolerances_and_honest_samplers_pass():
  """Issue 61: at the old float32 defaults (1e-3 mean, 0.1 max) the attention output x1.02 passed on every seed and the
  norm x1.05 on some. Replayed through the gate at the defaults of the demo's own config, every float32 mutation stops
  and the honest sampler passes; in bfloat16 the head swap stops and the honest sampler passes. Figures against NumPy."""
  z = np.load(DEMO_LOGPS)
  tol = {
      "float32": parity.tolerance(config_lib.load_config(["configs/cpu_demo.yml"]), backend="cpu"),
      "bfloat16": parity.tolerance(config_lib.load_config(["configs/cpu_demo.yml", "dtype=bfloat16"]), backend="cpu"),
  }
  for case, stops in NEAR_MISSES.items():
    s, t = z[f"{case}/sampler"], z[f"{case}/trainer"]
    d = np.abs(s.astype(np.float64) - t.astype(np.float64))
    assert d.size > 900  # ~1,000 completion tokens, as the gate saw them
    figs = parity.figures(s[None], t[None], np.ones((1, s.size), bool))
    assert figs["parity/logp_abs_diff_mean"] == pytest.approx(d.mean(), rel=1e-9, abs=1e-15)
    assert figs["parity/logp_abs_diff_max"] == pytest.approx(d.max(), rel=1e-9, abs=1e-15)
    limit = tol[case.split("/", maxsplit=1)[0]]
    which = parity.exceeded(figs, limit)
    assert (which is not None) == stops, (case, figs, which)
    if not stops:  # honest: inside by a margin, not by luck (>= 7x on the mean, >= 6x on the max)
      assert d.mean() * 7 < limit.mean and d.max() * 6 < limit.max, (case, figs)


# A third of the demo's warm start (loss ~0.3): honest float32 4.6e-7, bfloat16 7.8e-3 mean (docs/moe.md); the float32
# near misses stop by >= 500x on the mean, the bfloat16 head swap by 2x on the max.
_DEMO_WARM_STEPS = 100


class _GatePassed(Exception):
  """Raised after the gate passed: what follows it (the update) is not these tests' business; the e2e runs train
  past it."""


def _demo_argv(root, name, *overrides):
  return [
      "configs/cpu_demo.yml",  # its temperature 1, 8 prompts x 8 samples
      f"base_output_directory={root}",
      f"run_name={name}",
      f"sft_warmup_steps={_DEMO_WARM_STEPS}",
      "num_batches=1",
      "num_test_batches=0",
      "eval_interval=0",
      *overrides,
  ]


def _gate_run(root, name, *overrides):
  """One demo-model run to its parity gate: (returncode, the gate's figures, tolerance and pairing, stderr)."""
  seen = []
  real = parity.check

  def check(step, figs, tol, pair):
    seen.append((figs, tol, pair))
    real(step, figs, tol, pair)
    raise _GatePassed

  with pytest.MonkeyPatch.context() as m:
    m.setattr(parity, "check", check)
    try:
      p = in_process.train_rl(_demo_argv(root, name, *overrides))
      code, err = p.returncode, p.stderr
    except _GatePassed:
      code, err = 0, ""
  assert len(seen) == 1, err[-3000:]
  return code, seen[0], err


@pytest.fixture(name="demo", scope="module")
def demo_fixture(tmp_path_factory):
  """The demo model's warm start, trained once by the honest float32 run (whose gate must pass): its checkpoint
  directory, which each later run copies (run/warm_start.warm_start restores it), and that run's gate."""
  root = tmp_path_factory.mktemp("demo")
  code, gate, err = _gate_run(root, "honest_float32")
  assert code == 0, err[-3000:]
  return root, root / "honest_float32" / "checkpoints" / "sft", gate


def _query_heads_swapped(layer):
  def mutation(model):
    """Query heads 0 and 1 exchanged in one layer ([emb, layers, heads, head_dim] when scanned)."""
    state = nnx.state(model, nnx.Param)
    q = state["base"]["decoder"]["layers"]["self_attention"]["query"]["kernel"]
    q.value = q.value.at[:, layer, jnp.array([0, 1])].set(q.value[:, layer, jnp.array([1, 0])])
    return state

  mutation.__name__ = f"query_heads_swapped_layer{layer}"
  return mutation


def _final_norm_scaled(model):
  """The final norm's scale x1.05: every token's logits 5% sharper."""
  state = nnx.state(model, nnx.Param)
  norm = state["base"]["decoder"]["decoder_norm"]["scale"]
  norm.value = norm.value * 1.05
  return state


@pytest.mark.extended  # ~100 s: a 100-step warm start and five runs to the gate; the default tier replays the
# measured log-probs of the same cases (test_the_demos_measured_near_misses_...)
@pytest.mark.parametrize(
    "dtype,mutation",
    [
        ("float32", None),
        ("float32", _query_heads_swapped(2)),
        ("float32", _final_norm_scaled),
        ("bfloat16", None),
        ("bfloat16", _query_heads_swapped(2)),
    ],
    ids=["float32-honest", "float32-heads", "float32-norm", "bfloat16-honest", "bfloat16-heads"],
)
def test_near_misses_on_the_warm_started_demo_model_stop_at_step_1_and_honest_samplers_pass(
    demo, mutate, dtype, mutation
):
  """Issue 61 end to end: the demo model after its warm start, at its temperature 1, its first step's ~1,000 tokens.
  In float32 one layer's query heads exchanged and the final norm x1.05 stop the run with one line, at the default
  tolerances; in bfloat16 the head swap does; the honest sampler passes both."""
  root, sft_dir, honest = demo
  code, err = 0, ""
  name = f"{dtype}_{getattr(mutation, '__name__', 'honest').lstrip('_')}"
  if dtype == "float32" and mutation is None:
    figs, tol, pair = honest
  else:
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(sft_dir, run / "checkpoints" / "sft")
    if mutation is not None:
      mutate(mutation)
    code, (figs, tol, pair), err = _gate_run(root, name, f"dtype={dtype}")
  print(name, pair, figs)
  assert pair == f"{dtype}/{dtype}" and figs["parity/tokens"] > 500
  assert tol == parity.PAIRING_TOLERANCES[pair]  # the defaults, no key set
  if mutation is None:
    assert parity.exceeded(figs, tol) is None
    return
  assert code == 2 and parity.exceeded(figs, tol) is not None, figs
  lines = [l for l in err.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and "step 1:" in lines[0] and f"sampler/trainer {pair}" in lines[0], err[-3000:]
