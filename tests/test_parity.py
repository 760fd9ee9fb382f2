"""The parity gate (parity.py): a sampler that computes another function stops the run before its first update.

The mutations are the field's silent weight-sync defects, same shapes, right bytes in the wrong place: the MLP's gate
and up kernels exchanged, two kv heads exchanged (keys and values together). They are injected where the embedded
engine installs its weights (`embedded._on_rollout_mesh`, the sampler's copy of the trainer's weights), so the trainer
keeps the true ones. The references are independent of the gate: the figures' arithmetic against NumPy, and the
tolerances against the table in parity.py's docstring. The honest run (the gate passes and logs its figures at each
launch's first step, ~1e-6 nats in float32 as docs/moe.md measures) is tests/test_train_e2e.py's GRPO run and its
resume, which run the gate by default.
"""

from __future__ import annotations

import json

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
  assert "step 1:" in line and "rl.parity_logp_tolerance_mean = 0.001" in line and "float32/float32" in line
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
  assert parity.tolerance(f32) == parity.Tolerance(1e-3, 0.1, 0.01)
  assert parity.tolerance(bf16) == parity.Tolerance(0.05, 2.0, 0.10)
  keyed = config_lib.load_config(["configs/cpu_tiny.yml", "rl.parity_logp_tolerance_mean=0.5"])
  assert parity.tolerance(keyed) == parity.Tolerance(0.5, 0.1, 0.01)
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
