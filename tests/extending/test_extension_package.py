"""A third party's package (tests/extending/example_pkg) extends the plugin by entry points only, and is selected by name.

The package's metadata is what `pip install` would write: a `*.dist-info` with METADATA and an `entry_points.txt`
generated from its own pyproject.toml, in a directory put on `sys.path` with the package's code (no pip, no network, no
build: importlib.metadata finds a dist-info on any path entry, exactly as it finds an installed one). The default tier
checks the registry, the math the plugin drives (against NumPy) and the one-line refusal; the two-step `train_rl` with
all three selected by name is extended (the registry and the objective around a loss are the default tier's; the run
itself is test_train_e2e's, whose loss and estimator come through the same registry).
"""

import importlib
import json
import os
import pathlib
import subprocess
import sys
import time
import tomllib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_rl_plugin.algorithms import advantages
from maxtext_rl_plugin.algorithms import loss as loss_lib
from maxtext_rl_plugin.algorithms import tunix_wiring
from maxtext_rl_plugin.aot import anchor_tunix
from maxtext_rl_plugin.config import precheck as config_precheck
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rewards import loader as reward_loader

import _in_process as in_process
from _tiny import SMALL_VOCAB

PACKAGE = pathlib.Path(__file__).parent / "example_pkg"
REPO = pathlib.Path(__file__).resolve().parents[2]
LIBTPU = REPO / ".venv-aot-libtpu"


def write_dist_info(site: pathlib.Path, package: pathlib.Path = PACKAGE) -> pathlib.Path:
  """The `<name>-<version>.dist-info` an install of `package` writes (METADATA, entry_points.txt from its
  pyproject.toml's `[project.entry-points]`), under `site`."""
  project = tomllib.loads((package / "pyproject.toml").read_text(encoding="utf-8"))["project"]
  dist = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
  dist.mkdir(parents=True)
  (dist / "METADATA").write_text(
      f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n", encoding="utf-8"
  )
  groups = [
      f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items())
      for group, entries in project["entry-points"].items()
  ]
  (dist / "entry_points.txt").write_text("\n".join(groups), encoding="utf-8")
  return dist


@pytest.fixture(name="installed")
def installed_fixture(tmp_path, monkeypatch):
  """The example package importable and its entry points visible, for this test only."""
  write_dist_info(tmp_path / "site")
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  monkeypatch.syspath_prepend(str(PACKAGE))
  return importlib.import_module("maxtext_rl_example")  # importable only now that the path holds it


def test_a_third_party_loss_estimator_and_reward_are_found_by_name(installed):
  assert "cispo" in loss_lib.names() and {"grpo", "gspo-token"} <= set(loss_lib.names())
  assert "group_median" in advantages.names() and {"grpo", "rloo", "drgrpo"} <= set(advantages.names())

  # The loss, driven by the plugin's objective (token-mean, no KL), against its NumPy definition.
  rng = np.random.default_rng(0)
  b, t = 4, 6
  mask = (np.arange(t)[None, :] < np.array([6, 3, 0, 2])[:, None]).astype(np.float64)
  lp = -rng.uniform(0.1, 2.0, (b, t))
  old = lp + rng.normal(0.0, 0.3, (b, t))
  adv = rng.normal(0.0, 1.0, b)
  eps_hi = 0.28
  w = np.minimum(np.exp(lp - old), 1.0 + eps_hi)
  want = -(w * adv[:, None] * lp * mask).sum() / mask.sum()
  want_grad = -(w * adv[:, None] * mask) / mask.sum()

  f32 = [jnp.asarray(a, jnp.float32) for a in (lp, old, adv, mask)]
  (value, aux), grad = jax.value_and_grad(
      lambda x: loss_lib.policy_loss(
          x, f32[1], None, f32[2], f32[3], loss_algo="cispo", epsilon_high=eps_hi, loss_agg_mode="token-mean"
      ),
      has_aux=True,
  )(f32[0])
  np.testing.assert_allclose(float(value), want, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(float(aux["cispo_weight_mean"]), w[mask > 0].mean(), rtol=1e-5)
  assert {"pg_loss", "kl", "ppo_kl", "cispo_weight_mean", "cispo_clip_fraction"} <= set(aux)
  # What a run logs for it: the objective's metrics and the two it declares (no clip_fraction: no pg_clipfrac).
  logged = tunix_wiring.rl_metrics_to_log(tunix_wiring.PluginGrpoConfig(num_generations=2, loss_algo="cispo"))
  assert {"cispo_weight_mean", "cispo_clip_fraction", "pg_loss", "kl"} <= set(logged) and "pg_clipfrac" not in logged

  # The estimator, through the plugin's scaling (its own first: none), against the median of each group.
  rewards = np.array([0.0, 1.0, 5.0, 1.0, 2.0, 2.0, 3.0, 9.0])
  settings = advantages.AdvantageSettings.resolve("group_median", None, "sequence-mean-token-mean")
  assert settings.norm == "none"
  want_adv = np.concatenate([g - np.median(g) for g in rewards.reshape(-1, 4)])
  np.testing.assert_array_equal(settings(rewards, 4), want_adv)

  # The reward function, resolved by name as `reward_functions=short_answer` resolves it.
  ((name, fn, where),) = reward_loader.resolve(["short_answer"])
  assert name == "short_answer" and "entry point maxtext_rl_example:short_answer" in where
  assert fn([], ["x" * 8, "x" * 32]) == [1.0, 0.5]


def test_an_unknown_name_is_one_line_listing_the_registered_ones(installed):
  for key, name, listed in (
      ("rl.loss_algo", "cispoo", "cispo, grpo, gspo-token"),
      ("rl.advantage_estimator", "median", "drgrpo, group_median, grpo, rloo"),
  ):
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
      config_precheck.precheck(["configs/cpu_tiny.yml", f"{key}={name}"])
    took = time.perf_counter() - start
    line = str(e.value)
    assert line.startswith(f"invalid value for '{key}'='{name}': expected one of {listed} (the registered ")
    assert "\n" not in line and took < 5.0, (line, took)
  # The names the first pass accepts reach the typed config (the schema's loss_algo is a plain string there).
  config_precheck.precheck(["configs/cpu_tiny.yml", "loss_algo=cispo", "rl.advantage_estimator=group_median"])


def test_the_tunix_anchor_refuses_a_loss_tunix_does_not_have_in_one_line():
  """aot/anchor_tunix compiles Tunix's own loss beside the plugin's: a registered loss of another package has no Tunix
  twin, which is one line (Tunix's GRPOConfig raised a ValueError traceback)."""
  cfg = types.SimpleNamespace(rl=types.SimpleNamespace(loss_algo="cispo", kl_estimator="k3"))
  with pytest.raises(ConfigError, match="rl.loss_algo='cispo': the anchor compiles Tunix's own loss") as e:
    anchor_tunix.tunix_algo_config(cfg)
  assert "\n" not in str(e.value)


@pytest.mark.extended  # the default tier: the two tests above (registry, objective, refusal); test_train_e2e's runs
@pytest.mark.slow
def test_train_rl_trains_two_steps_with_the_packages_loss_estimator_and_reward(installed, tmp_path):
  out = tmp_path / "runs"
  calls = installed.CALLS["group_median"]
  argv = [
      "configs/cpu_tiny.yml",
      *SMALL_VOCAB,
      f"base_output_directory={out}",
      "run_name=ext",
      f"metrics_file={out / 'ext' / 'metrics.jsonl'}",
      "num_batches=2",
      "num_test_batches=0",
      "eval_interval=0",
      "loss_algo=cispo",
      "rl.advantage_estimator=group_median",
      "reward_functions=short_answer",
      "decode_sampling_temperature=30",  # distinct completions from the random-init model, so rewards vary
      "rl.parity_check=first",  # the parity gate, unchanged, on a run whose loss is the package's
  ]
  p = in_process.train_rl(argv)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
  recs = [json.loads(l) for l in (out / "ext" / "metrics.jsonl").read_text().splitlines() if l.strip()]
  steps = [r for r in recs if "reward/mean" in r]
  assert [r["step"] for r in steps] == [1, 2]
  for r in steps:  # the loss's declared metrics, the reward by its name, a finite loss
    assert "train/cispo_weight_mean" in r and "train/cispo_clip_fraction" in r, sorted(r)
    assert "reward/short_answer/mean" in r and np.isfinite(r["loss"])
    assert "train/seq_ratio_mean" not in r and "clip_fraction" not in r  # no built-in loss's metrics
  assert installed.CALLS["group_median"] > calls  # the advantages came from the package's estimator
  assert "RL steps of cispo" in p.stdout
  assert "parity/logp_abs_diff_mean" in steps[0]


@pytest.mark.extended  # the default tier: tests/aot's compile of the built-in loss, the same registry path
@pytest.mark.skipif(not (LIBTPU / "libtpu").is_dir(), reason="libtpu not installed in .venv-aot-libtpu (scripts/venv.sh)")
def test_compile_rl_compiles_the_packages_loss_for_a_tpu_topology(tmp_path):
  """compile_topology with loss_algo=cispo: the AOT path builds the learner's loss through the registry (no aot/
  change)."""
  site = tmp_path / "site"
  write_dist_info(site)
  path = os.pathsep.join([str(LIBTPU), str(site), str(PACKAGE), os.environ.get("PYTHONPATH", "")])
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
  env.pop("XLA_FLAGS", None)
  argv = ["configs/cpu_tiny.yml", *SMALL_VOCAB, f"base_output_directory={tmp_path}", "run_name=t"]
  argv += ["compile_topology=v5p-8", "compile_topology_num_slices=1", "loss_algo=cispo"]
  res = subprocess.run(
      [sys.executable, "-m", "maxtext_rl_plugin.compile_rl", *argv],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
      check=False,
  )
  assert res.returncode == 0, res.stderr[-3000:]
  rep = json.loads((tmp_path / "t.aot-v5p-8.json").read_text())
  assert rep["programs"][0]["name"] == "actor_update" and rep["programs"][0]["fits"]
  assert "loss cispo" in res.stdout
