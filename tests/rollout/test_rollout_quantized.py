"""A quantized embedded sampler (`rollout_quantization`): it samples with the weights read back from their int8/FP8
form, quantizes once per weight version, and its sync's guard covers the quantized bytes and the scales.

The reference is independent of the engine: a no-cache forward of the tiny model (its decoder x3, as
test_rollout_embedded.py) whose kernels were quantized and read back in NumPy (resharding/quantize.py's formulas,
ml_dtypes' e4m3fn), scoring the tokens the engine sampled. Tolerance 2e-4 nats (float32 cached vs. full attention,
as test_rollout_embedded.py); the same tokens scored by the float weights are off by far more (asserted), so a sampler
that skipped its quantization fails.

Extended tier (~80 s on 2 loaded cores: an engine build and its compiles); the default tier checks the format against
NumPy and Qwix (tests/resharding/test_quantize.py), the gate's quantized defaults (tests/run/test_parity_quantized.py) and
the refusals (tests/rollout/test_precision.py).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from _tiny import SMALL_VOCAB
from test_rollout_embedded import scaled_engine
from maxtext_rl_plugin.resharding import quantize as qz
from maxtext_rl_plugin.resharding import sync as sync_lib
from maxtext_rl_plugin.resharding import trees

pytestmark = pytest.mark.extended

WIDTH = 64
NEW = 12


def _np_fake_quantize(w, name, axes):
  w = np.asarray(w, np.float32)
  bound = 127.5 if name == "int8" else 448.0
  absmax = np.max(np.abs(w), axis=tuple(axes), keepdims=True)
  scale = np.where(absmax > 0, absmax / np.float32(bound), 1.0).astype(np.float32)
  y = w / scale
  q = np.clip(np.round(y), -128, 127) if name == "int8" else np.clip(y, -bound, bound).astype(ml_dtypes.float8_e4m3fn)
  return q.astype(np.float32) * scale


@pytest.fixture(name="setup", scope="module")
def setup_fixture():
  """The tiny model (decoder x3) with an FP8 embedded sampler, and a jitted no-cache scorer of token rows."""
  _, model, tok, _, engine, gdef = scaled_engine(["configs/cpu_tiny.yml", *SMALL_VOCAB, "rollout_quantization=fp8"])

  @jax.jit
  def scores(state, toks, lens):
    m = nnx.merge(gdef, state)
    pos = jnp.broadcast_to(jnp.arange(WIDTH)[None], toks.shape)
    logits, _ = m(toks, pos, None, None, decoder_segment_ids=(pos < lens[:, None]).astype(jnp.int32))
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, toks[:, 1:, None], axis=-1)[..., 0]

  return {"engine": engine, "tok": tok, "model": model, "scores": scores}


def _reference_state(model, name):
  """The model's params with every planned kernel quantized and read back in NumPy (plan: which kernels, which axes)."""
  state = nnx.state(model)
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  axes_of = qz.plan(pure["base"], scan_axis=1)
  assert len(axes_of) == 7  # q, k, v, out, wi_0, wi_1, wo: the embedding and norms stay float

  def one(path, x):
    key = jax.tree_util.keystr(path[1:])
    return jnp.asarray(_np_fake_quantize(x, name, axes_of[key])) if key in axes_of else x

  new = jax.tree_util.tree_map_with_path(one, pure)
  out = jax.tree.map(lambda x: x, state)
  nnx.replace_by_pure_dict(out, new)
  return out


def _score(setup, state, prompts, res):
  """Log-probs of each row's sampled tokens under `state`, by a full forward of prompt + completion."""
  toks = np.full((len(res.lengths), WIDTH), setup["tok"].pad_token_id, np.int32)
  lens = np.zeros(len(res.lengths), np.int32)
  g = len(res.lengths) // len(prompts)
  for i, n in enumerate(res.lengths):
    row = list(prompts[i // g]) + res.tokens[i, :n].tolist()
    toks[i, : len(row)] = row
    lens[i] = len(row)
  lp = np.asarray(setup["scores"](state, jnp.asarray(toks), jnp.asarray(lens)))
  out = np.zeros_like(res.logps)
  for i, n in enumerate(res.lengths):
    start = len(prompts[i // g]) - 1
    out[i, :n] = lp[i, start : start + n]
  return out


def test_fp8_sampler_samples_with_the_weights_read_back_from_fp8(setup):
  eng, tok = setup["engine"], setup["tok"]
  prompts = [tok.encode("3 boxes with 4 in each. How many?"), tok.encode("What is 7 + 5?")]
  res = eng.generate_tokens(prompts, num_generations=3, max_new_tokens=NEW, rng=jax.random.PRNGKey(1))
  mask = res.mask
  quantized = _score(setup, _reference_state(setup["model"], "fp8"), prompts, res)
  floats = _score(setup, nnx.state(setup["model"]), prompts, res)
  d_q = np.abs(res.logps - quantized)[mask]
  d_f = np.abs(res.logps - floats)[mask]
  assert d_q.size > 20 and d_q.max() < 2e-4, d_q.max()
  assert d_f.mean() > 20 * max(d_q.mean(), 1e-6), (d_f.mean(), d_q.mean())  # the quantization is visible


def test_quantized_once_per_weight_version(setup):
  eng, tok, model = setup["engine"], setup["tok"], setup["model"]
  sw = eng._quantized  # pylint: disable=protected-access
  before = sw.num_quantized
  for _ in range(2):
    eng.generate_tokens([tok.encode("Hi")], max_new_tokens=2)
  assert sw.num_quantized == max(before, 1)
  nnx.update(model, jax.tree.map(lambda x: x + 0.0, nnx.state(model, nnx.Param)))  # a new weight version
  eng.generate_tokens([tok.encode("Hi")], max_new_tokens=2)
  assert sw.num_quantized == max(before, 1) + 1


def test_the_sync_guard_covers_quantized_bytes_and_scales(setup):
  """A quantized sync's guard: what the sampler holds (int8/fp8 bytes and float32 scales) is compared with the
  trainer's quantization of its own weights; a changed scale or a changed code is named."""
  sw = setup["engine"]._quantized  # pylint: disable=protected-access
  src = sw.quantize(nnx.state(setup["model"], nnx.Param))
  held = sw.quantize(nnx.state(setup["model"], nnx.Param))
  ws = sync_lib.WeightSync(None, verify_policy="every_n", verify_every=1, chunk_size=None, release_old=False)
  ws.sync(src, current=held, apply=lambda new: new)  # honest: passes

  def damaged(where):
    def apply(new):
      pure = nnx.to_pure_dict(new)
      wo = pure["base"]["decoder"]["layers"]["mlp"]["wo"]["kernel"]
      if where == "scale":
        wo.scale = wo.scale.at[0, 0, 0].multiply(1.01)
      else:
        wo.q = wo.q.at[0, 0, 0].set(jnp.asarray(-wo.q[0, 0, 0], wo.q.dtype) + jnp.asarray(1.0, wo.q.dtype))
      out = jax.tree.map(lambda x: x, new)
      nnx.replace_by_pure_dict(out, pure)
      return out

    return apply

  for where in ("scale", "q"):
    with pytest.raises(trees.WeightSyncError, match=rf"\['wo'\]\['kernel'\].*{where}"):
      ws.sync(src, current=held, apply=damaged(where))


@pytest.mark.parametrize("q", ["fp8", "int8"])
def test_two_step_train_rl_with_a_quantized_sampler(tmp_path, q):
  """Two GRPO steps on CPU with the embedded engine sampling int8/FP8 weights: the run trains both steps and step 1's
  parity gate passes at the quantized pairing's defaults."""
  import json  # pylint: disable=import-outside-toplevel
  import _in_process as in_process  # pylint: disable=import-outside-toplevel

  metrics = tmp_path / "m.jsonl"
  argv = ["configs/cpu_tiny.yml", *SMALL_VOCAB, f"base_output_directory={tmp_path}", "run_name=q", "num_batches=2"]
  argv += ["num_test_batches=0", "eval_interval=0", f"rollout_quantization={q}", f"metrics_file={metrics}"]
  p = in_process.train_rl(argv)
  assert p.returncode == 0, p.stderr[-3000:]
  recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
  steps = [r for r in recs if "reward/mean" in r]
  assert [r["step"] for r in steps] == [1, 2]
  gate = [r for r in recs if "parity/logp_abs_diff_mean" in r]
  # (cpu_tiny's random-init model reads 0.0 here; the demo model's step 1 reads 2.2e-3 with fp8, docs/low_precision.md)
  assert gate and gate[0]["parity/logp_abs_diff_mean"] < (0.01 if q == "int8" else 0.07)
