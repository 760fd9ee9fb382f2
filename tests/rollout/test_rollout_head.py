"""The engine's CPU tied head (rollout/head.py) against MaxText's own `apply_output_head` on the real tiny model."""

from flax import nnx
from flax.core.spmd import logical_axis_rules
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.rollout import head


def _model(overrides):
  rs = models.setup_devices(config_lib.parse(["configs/cpu_tiny.yml", *overrides]))
  model, mesh = models.build_model(rs.sampler_config, rs.sampler_devices, pad_id=0)
  return rs.sampler_config, model.base, mesh


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # the demo's Qwen3 shape: plain tied head
        ["final_logits_soft_cap=30.0", "normalize_embedding_logits=true", "logits_dot_in_fp32=true"],
    ],
)
def test_tied_head_equals_maxtext_output_head(overrides):
  cfg, base, mesh = _model(overrides)
  assert head.applies(cfg.logits_via_embedding, mesh)
  hidden = jax.random.normal(jax.random.PRNGKey(0), (3, 2, int(cfg.emb_dim)), jnp.float32) * 2.0
  table = head.TableCache().table(nnx.state(base, nnx.Param))
  with mesh, logical_axis_rules(cfg.logical_axis_rules):
    want = base.logits_from_hidden_states_for_vocab_tiling(hidden, deterministic=True, model_mode="autoregressive")
    got = head.TiedHead.from_config(cfg)(base, hidden, table)
  assert got.shape == want.shape and got.dtype == want.dtype
  # Same bf16-rounded table, float32 sums in another order: rounding-level differences only.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * float(jnp.abs(want).max()))
  assert (np.asarray(got).argmax(-1) == np.asarray(want).argmax(-1)).all()
  # The float32 table itself would not be MaxText's function: its logits differ far beyond rounding.
  exact = jnp.dot(base.decoder.decoder_norm(hidden), nnx.state(base, nnx.Param)["token_embedder"]["embedding"][...].T)
  if not overrides:
    assert float(jnp.abs(exact - want).max()) > 100 * float(jnp.abs(got - want).max())


def test_table_is_prepared_once_per_embedding_array():
  cfg, base, _ = _model([])
  del cfg
  cache = head.TableCache()
  state = nnx.state(base, nnx.Param)
  first = cache.table(state)
  assert cache.table(nnx.state(base, nnx.Param)) is first  # same weights: no new table
  emb = base.token_embedder.embedding
  emb[...] = emb[...] * 2.0  # what an optimizer update does: a new array in the same Variable
  second = cache.table(nnx.state(base, nnx.Param))
  assert second is not first
  np.testing.assert_array_equal(np.asarray(second), np.asarray(first) * 2.0)  # x2 is exact in bf16


def test_not_used_off_cpu_or_untied():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  assert not head.applies(False, mesh)
