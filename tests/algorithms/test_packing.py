"""max_seq_token_per_tpu (algorithms/packing.py): packed forwards give the padded layout's log-probs, loss and gradients.

The reference is the padded path the run takes without the key: Tunix's `compute_per_token_logps` on one row per
sequence, inside the registry's policy loss. Both run on the same real tiny MaxText model (and with LoRA adapters);
the batch has left-padded prompts and ragged completions, so rows really differ in length and several sequences
share a packed row. Every loss_agg_mode, GRPO and GSPO-token; micro-batches through the update's strided split.
"""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.rl import common as tunix_common
from tunix.rl.grpo import grpo_learner

from maxtext_rl_plugin.algorithms import packing
from maxtext_rl_plugin.aot import programs
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin import moe
from maxtext_rl_plugin.run import accumulation

from test_accumulation import LORA, SMALL, _actor

PAD = programs.PAD_ID
_packed_logps = nnx.jit(packing.packed_forward, static_argnames=("temperature", "with_entropy"))
ROW = 40  # two of the longest sequences (8 + 12 tokens) per row


def test_first_fit_decreasing_is_deterministic_and_never_overflows():
  lengths = np.array([7, 3, 9, 3, 5, 1, 10, 2])
  row, offset, n = packing.first_fit_decreasing(lengths, 10)
  # longest first, each into the first row with room: 10 | 9 1 | 7 3 | 5 3 2
  assert n == 4
  assert [int(r) for r in row] == [2, 2, 1, 3, 3, 1, 0, 3]
  for r in range(n):
    spans = sorted((int(offset[i]), int(offset[i] + lengths[i])) for i in np.flatnonzero(row == r))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= 10
  again = packing.first_fit_decreasing(lengths, 10)
  assert all(np.array_equal(a, b) for a, b in zip((row, offset), again[:2]))
  with pytest.raises(ValueError, match=r"^sequence 2 has 11 tokens, more than max_seq_token_per_tpu=10 "):
    packing.first_fit_decreasing(np.array([3, 4, 11]), 10)


def _batch(seed: int, rows: int = 8, p: int = 8, t: int = 12):
  """Left-padded prompts (1 to p tokens) and right-padded completions (0 to t tokens: an empty one too)."""
  rng = np.random.default_rng(seed)
  p_len, c_len = rng.integers(1, p + 1, rows), rng.integers(0, t + 1, rows)
  c_len[0] = 0
  prompt = np.where(np.arange(p)[None, :] >= (p - p_len)[:, None], rng.integers(2, 500, (rows, p)), PAD)
  completion = np.where(np.arange(t)[None, :] < c_len[:, None], rng.integers(2, 500, (rows, t)), PAD)
  return prompt.astype(np.int32), completion.astype(np.int32), rng


def test_pack_lays_out_each_sequence_with_its_own_segment_and_positions():
  prompt, completion, _ = _batch(0)
  pk = packing.pack(prompt, completion, PAD, ROW, rows_multiple=2)
  assert pk.tokens.shape[0] % 2 == 0 and pk.tokens.shape[0] < prompt.shape[0]  # several sequences share a row
  for i in range(prompt.shape[0]):
    seq = np.concatenate([prompt[i][prompt[i] != PAD], completion[i][completion[i] != PAD]])
    r, o = pk.row[i], pk.offset[i]
    assert np.array_equal(pk.tokens[r, o : o + seq.size], seq)
    assert np.array_equal(pk.positions[r, o : o + seq.size], np.arange(seq.size))
    assert len(set(pk.segments[r, o : o + seq.size].tolist())) == 1 and pk.segments[r, o] > 0
    n_completion = int((completion[i] != PAD).sum())
    assert pk.valid[i].sum() == n_completion
    cols = pk.src_col[i, :n_completion]
    # the column that scores completion token k reads the token just before it, in the same segment
    assert np.array_equal(pk.tokens[r, cols + 1], completion[i, :n_completion])
    assert np.all(pk.src_row[i, :n_completion] == r) and np.all(cols + 1 >= o + 1)
  # each row's segments are distinct sequences; the row's tail is padding (segment 0)
  for r in range(pk.tokens.shape[0]):
    used = (pk.row == r).sum()
    assert set(pk.segments[r].tolist()) - {0} == set(range(1, used + 1))


def test_a_steps_update_batches_are_packed_once_per_mini_batch_with_host_figures():
  """rl.num_iterations=2 walks the same two mini-batches twice (updates.update_batches): each is packed and placed
  once, reused by the second iteration, and the fill figures are counted from the host's packed rows."""
  minis = []
  for seed in (4, 5):
    prompt, completion, _ = _batch(seed)
    minis.append(grpo_learner.TrainExample(prompt, prompt != PAD, completion, completion != PAD, None, None, None))
  batches = [*minis, *(dataclasses.replace(m) for m in minis)]  # the second iteration's slices: equal, not the same
  placed = []

  def put(x):
    placed.append(x.shape)
    return np.asarray(x)

  packed, fill = packing.pack_update_batches(batches, PAD, ROW, steps=2, put=put, iterations=2)
  assert len(placed) == 2 * 6 and packed[2] is packed[0] and packed[3] is packed[1]  # 6 packed fields, 2 batches
  alone = [packing.pack_example(m, PAD, ROW, steps=2) for m in minis]
  for got, want in zip(packed, alone):
    assert np.array_equal(got.packed_tokens, want.packed_tokens) and np.array_equal(got.src_col, want.src_col)
  segments = [a.packed_segments for a in alone]
  real = sum(int((s > 0).sum()) for s in segments)
  tokens = sum(int(((m.prompt_ids != PAD).sum() + (m.completion_ids != PAD).sum())) for m in minis)
  assert real == tokens  # every sequence token sits in one packed slot
  assert fill == {
      "packing/rows": sum(s.shape[0] for s in segments) / 2,
      "packing/fill": real / sum(s.size for s in segments),
      "packing/padded_fill": real / (2 * 8 * (8 + 12)),
  }
  with pytest.raises(ValueError, match="do not split into 2 iterations"):
    packing.pack_update_batches(batches[:3], PAD, ROW, steps=2, put=put, iterations=2)


def _model(lora: bool, *args: str):
  rs = models.setup_devices(config_lib.parse([*SMALL, *(LORA if lora else []), *args]))
  model, mesh = _actor(rs.trainer_config, rs.trainer_devices, lora)
  return rs.trainer_config, model, mesh


def test_packed_log_probs_equal_the_padded_forward(models_by_lora):
  _, model, mesh = models_by_lora[False]
  prompt, completion, _ = _batch(1)
  graphdef, state = nnx.split(model)
  with jax.set_mesh(mesh):
    padded = tunix_common.compute_per_token_logps(
        graphdef, state, jnp.asarray(prompt), jnp.asarray(completion), PAD, programs.EOS_ID, temperature=0.7
    )
    pk = packing.pack(prompt, completion, PAD, ROW)
    got, _, _ = _packed_logps(
        model,
        *(jnp.asarray(x) for x in (pk.tokens, pk.positions, pk.segments, pk.src_row, pk.src_col, pk.valid)),
        temperature=0.7,
    )
  mask = completion != PAD
  np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(padded)[mask], rtol=2e-5, atol=2e-5)
  assert np.all(np.asarray(got)[~mask] == 0.0)
  # not vacuous: the same indices on rows packed without segment ids read other sequences' context
  cross, _, _ = _packed_logps(
      model,
      *(jnp.asarray(x) for x in (pk.tokens, pk.positions, np.ones_like(pk.segments), pk.src_row, pk.src_col, pk.valid)),
      temperature=0.7,
  )
  assert np.max(np.abs(np.asarray(cross)[mask] - np.asarray(padded)[mask])) > 1e-2


def _example(model, prompt, completion, rng, loss_mask=None) -> grpo_learner.TrainExample:
  """A batch whose old and reference log-probs are the model's own plus noise (ratios near 1, as in a run);
  `loss_mask` ANDed into the completion mask as run/experience.score does for a multi-turn episode's environment
  tokens."""
  rows, _ = completion.shape
  mask = completion != PAD if loss_mask is None else (completion != PAD) & loss_mask
  graphdef, state = nnx.split(model)
  own = np.asarray(
      tunix_common.compute_per_token_logps(
          graphdef, state, jnp.asarray(prompt), jnp.asarray(completion), PAD, programs.EOS_ID
      )
  )
  return grpo_learner.TrainExample(
      prompt_ids=jnp.asarray(prompt),
      prompt_mask=jnp.asarray(prompt != PAD, jnp.int32),
      completion_ids=jnp.asarray(completion),
      completion_mask=jnp.asarray(mask, jnp.int32),
      advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
      ref_per_token_logps=jnp.asarray(own + rng.normal(0, 0.05, own.shape), jnp.float32),
      old_per_token_logps=jnp.asarray(own + rng.normal(0, 0.2, own.shape), jnp.float32),  # some ratios clipped
  )


@pytest.fixture(name="models_by_lora", scope="module")
def models_fixture():
  return {lora: _model(lora) for lora in (False, True)}


# Each aggregation mode once, GRPO and GSPO-token, full fine-tuning and LoRA. The loss is the same function of the
# [B, T] log-probs in both layouts, so equal log-probs with equal gradients cover every combination.
@pytest.mark.parametrize(
    "algo_args, lora",
    [
        (["rl.loss_agg_mode=token-mean", "rl.grpo_beta=0.04"], False),
        (["rl.loss_algo=gspo-token", "rl.loss_agg_mode=sequence-mean-token-mean", "rl.grpo_epsilon=3e-4"], False),
        (["rl.loss_agg_mode=sequence-mean", "rl.grpo_beta=0.04"], True),
        # A multi-turn batch (rl.use_agentic_rollout): each completion a_1 e_1 a_2 with its environment tokens e_1
        # in the context but out of the loss mask.
        (
            [
                "rl.loss_agg_mode=token-mean",
                "rl.grpo_beta=0.04",
                "rl.use_agentic_rollout=true",
                "rl.agentic_tools=['calculator']",
            ],
            False,
        ),
    ],
    ids=["grpo-token-mean-kl", "gspo-token-seq-mean-token-mean", "lora-grpo-seq-mean-kl", "multi-turn-tool-mask"],
)
def test_packed_loss_and_gradients_equal_the_padded_ones(models_by_lora, algo_args, lora):
  _, model, mesh = models_by_lora[lora]
  config = config_lib.load_config([*SMALL, *(LORA if lora else []), *algo_args])
  loss_fn, algo = programs.loss_fn_of(config)
  prompt, completion, rng = _batch(2)
  loss_mask = None
  if config.rl.use_agentic_rollout:
    loss_mask = np.ones(completion.shape, bool)
    loss_mask[:, 3:6] = False  # environment tokens: the tool's answer between two assistant turns
    assert ((completion[:, 3:6] != PAD) & ~loss_mask[:, 3:6]).sum() >= 6  # real tokens, out of the loss
  wrt = nnx.LoRAParam if lora else nnx.Param

  @nnx.jit
  def value_and_grad(m, ex):
    return nnx.value_and_grad(lambda m: loss_fn(m, ex, algo), argnums=nnx.DiffState(0, wrt), has_aux=True)(m)

  with jax.set_mesh(mesh):
    example = _example(model, prompt, completion, rng, loss_mask)
    packed = packing.pack_example(example, PAD, ROW, steps=1, put=jnp.asarray)
    (want_loss, want_aux), want = value_and_grad(model, example)
    (got_loss, got_aux), got = value_and_grad(model, packed)
  want = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(want)}
  got = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(got)}
  assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-4, abs=1e-7)  # GSPO: ~2e-5 (exp of a mean)
  assert float(got_aux["entropy"]) == pytest.approx(float(want_aux["entropy"]), rel=1e-5)
  assert want and set(got) == set(want)
  live = [k for k, g in want.items() if np.linalg.norm(g) > 1e-6]
  assert len(live) >= len(want) / 2, live  # not vacuous (LoRA's A starts with zero gradient: its B is zero)
  for k, g in want.items():
    scale = np.linalg.norm(g)
    # float32 round-off: the embedding's gradient sums thousands of terms in another order (measured ~2e-5)
    assert np.linalg.norm(got[k] - g) <= 1e-4 * scale, (k, np.linalg.norm(got[k] - g), scale)


def test_micro_batches_get_their_own_sequences_and_rows(models_by_lora):
  """pack_example's layout survives the update's strided split: micro-batch i's packed log-probs are its rows'."""
  _, model, mesh = models_by_lora[False]
  prompt, completion, rng = _batch(3, rows=8)
  steps = 2
  graphdef, state = nnx.split(model)
  with jax.set_mesh(mesh):
    packed = packing.pack_example(_example(model, prompt, completion, rng), PAD, ROW, steps=steps, put=jnp.asarray)
    split = accumulation.split_micro_batches(packed, steps)
    for i in range(steps):
      micro = jax.tree.map(lambda x, i=i: x[i], split)
      assert np.array_equal(np.asarray(micro.completion_ids), completion[i::steps])
      got, _, _ = _packed_logps(
          model,
          micro.packed_tokens,
          micro.packed_positions,
          micro.packed_segments,
          micro.src_row,
          micro.src_col,
          micro.src_valid,
      )
      want = tunix_common.compute_per_token_logps(
          graphdef, state, micro.prompt_ids, micro.completion_ids, PAD, programs.EOS_ID
      )
      mask = completion[i::steps] != PAD
      np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], rtol=2e-5, atol=2e-5)


def test_a_packed_run_trains_as_the_padded_run(tmp_path):
  """train_rl end to end with max_seq_token_per_tpu: the reference (grpo_beta > 0), old-policy (rl.num_iterations=2)
  and update forwards (2 micro-batches) on packed rows; step 1 samples the same completions, so its figures equal the
  padded run's to float32 round-off; the step's packing figures show rows were shared."""
  from test_trainer_updates import _train  # pylint: disable=import-outside-toplevel

  common = ("rl.grpo_beta=0.04", "rl.num_iterations=2", "train_micro_batch_size=1", "num_batches=1")
  _, padded = _train(tmp_path, "padded", *common)
  _, packed = _train(tmp_path, "packed", *common, "max_seq_token_per_tpu=320")
  (want,), (got,) = padded, packed
  assert got["reward/mean"] == want["reward/mean"] and got["completion/length_mean"] == want["completion/length_mean"]
  for key in ("loss", "grad_norm", "train/pg_loss", "entropy", "ratio_mean"):
    assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
  assert got["kl"] == pytest.approx(want["kl"], rel=1e-3) and want["kl"] > 1e-6  # the reference forward, packed
  # an update: 2 micro-batches of 2 sequences (<= 160 tokens each), each micro-batch's pair in one 320-token row
  assert got["packing/rows"] == 2 and "packing/rows" not in want
  assert got["packing/fill"] >= got["packing/padded_fill"] > 0


MOE_FAMILIES = {  # Mixtral: MaxText's own forced_routed_experts; Qwen3-MoE: the plugin forces it (moe.set_replay)
    "mixtral": [],
    "qwen3-moe": ["model_name=qwen3-30b-a3b"],
}


def _moe_argv(family: str, *extra: str) -> list[str]:
  return ["configs/cpu_tiny_moe.yml", *SMALL[1:], "base_moe_mlp_dim=32", *MOE_FAMILIES[family], *extra]


def _random_routing(prompt, completion, layers: int, experts: int, k: int, rng) -> np.ndarray:
  """[B, P + T, layers, k] distinct experts per (token, layer), UNSET where nothing is routed (pads, the last
  completion token), as the engines lay routing out (moe.py): a routing other than the model's own."""
  b, width = prompt.shape[0], prompt.shape[1] + completion.shape[1]
  route = np.argsort(rng.random((b, width, layers, experts)), axis=-1)[..., :k].astype(np.int32)
  routed = moe.routed_mask(prompt != PAD, completion != PAD)
  return np.where(routed[:, :, None, None], route, moe.UNSET)


# Qwen3-MoE in the default tier (the plugin's own forcing, the path MaxText does not have); Mixtral's forcing is
# MaxText's forced_routed_experts argument: extended.
@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.extended) if f == "mixtral" else f for f in sorted(MOE_FAMILIES)]
)
def test_packed_moe_replay_gives_the_padded_replayed_loss_and_gradients(family):
  """rl.router_replay on packed rows: the batch's routing packed with its tokens (each token's experts at its packed
  slot) gives the padded replayed forward's loss and gradients; the routing is not the model's own, so replay is not
  the identity (the free forward's loss differs). With load_balance_loss_weight > 0 the packed update keeps MaxText's
  load-balancing term (checked on Mixtral, extended tier)."""
  config = config_lib.load_config(_moe_argv(family, "rl.router_replay=true", "rl.grpo_beta=0.04"))
  rs = models.setup_devices(config_lib.parse(_moe_argv(family)))
  model, mesh = _actor(rs.trainer_config, rs.trainer_devices, False)
  loss_fn, algo = programs.loss_fn_of(config)
  prompt, completion, rng = _batch(4)
  routing = _random_routing(prompt, completion, int(config.num_decoder_layers), int(config.num_experts), 2, rng)

  @nnx.jit
  def value_and_grad(m, ex):
    return nnx.value_and_grad(lambda m: loss_fn(m, ex, algo), has_aux=True)(m)

  with jax.set_mesh(mesh):
    plain = _example(model, prompt, completion, rng)
    fields = {f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)}
    example = moe.RoutedTrainExample(**fields, routed_experts=jnp.asarray(routing))
    packed = packing.pack_example(example, PAD, ROW, steps=1, put=jnp.asarray)
    (want_loss, _), want = value_and_grad(model, example)
    (got_loss, _), got = value_and_grad(model, packed)
    (free_loss, _), _ = value_and_grad(model, plain)
  assert packed.routed_experts is None and packed.packed_routing.shape[:2] == packed.packed_tokens.shape
  pk = packing.pack(prompt, completion, PAD, ROW, routing=routing)  # each sequence's experts sit at its tokens' slots
  p_len, c_len = packing.sequence_lengths(prompt, completion, PAD)
  for i in range(prompt.shape[0]):
    r, o, n = int(pk.row[i]), int(pk.offset[i]), int(p_len[i] + c_len[i])
    cols = np.concatenate([np.flatnonzero(prompt[i] != PAD), prompt.shape[1] + np.arange(int(c_len[i]))])
    np.testing.assert_array_equal(pk.routing[r, o : o + n], routing[i, cols])
  assert (pk.routing[pk.segments == 0] == moe.UNSET).all()
  assert abs(float(free_loss) - float(want_loss)) > 1e-3 * abs(float(want_loss))  # replay matters here
  assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-4, abs=1e-7)
  want = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(want)}
  got = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(got)}
  assert want and set(got) == set(want)
  for k, g in want.items():
    assert np.linalg.norm(got[k] - g) <= 1e-4 * max(np.linalg.norm(g), 1e-6), (k, np.linalg.norm(got[k] - g))

  if family != "mixtral":  # the load-balancing check builds a second model: once, in the extended tier
    return
  lb_config = config_lib.load_config(_moe_argv(family, "rl.router_replay=true", "load_balance_loss_weight=0.01"))
  lb_loss_fn, lb_algo = programs.loss_fn_of(lb_config)
  lb_rs = models.setup_devices(config_lib.parse(_moe_argv(family, "load_balance_loss_weight=0.01")))
  lb_model, _ = _actor(lb_rs.trainer_config, lb_rs.trainer_devices, False)
  with jax.set_mesh(mesh):
    _, aux = nnx.jit(lambda m, ex: lb_loss_fn(m, ex, lb_algo))(lb_model, packed)
  assert float(aux["moe_lb_loss"]) > 0.0
