"""Embedded KV-cache rollout engine vs. independent no-cache references on the tiny MaxText model.

References never touch the engine's code path: full forwards of each unpadded row (right-padded to a
fixed width, explicit segment ids, train-mode model through TunixMaxTextAdapter, no cache). Greedy:
one forward per generated token. Log-probs / top-k ranks: one causal forward of prompt + completion
(position i sees only tokens <= i). Log-prob tolerance: 2e-4 nats absolute (float32; cached vs. full
attention differ only in summation order).
The tiny model's decoder weights are scaled x3 so greedy continuations depend on the context; at init
scale a random model just repeats one token, which would hide cache/position bugs.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin import registry
from maxtext_rl_plugin.rollout import bucketing
from maxtext_rl_plugin.rollout import embedded
from maxtext_rl_plugin.rollout import sampling
from maxtext_rl_plugin.rollout import stops
from maxtext_rl_plugin.run import engine as run_engine

REF_WIDTH = 96
NEW = 16


def scaled_engine(argv):
  """A tiny CPU model from `argv` (config file + overrides) with its decoder weights x3 (so greedy output depends on
  the context), its tokenizer and mesh, its embedded engine, and its graph definition for a no-cache reference
  forward: `(rs, model, tok, mesh, engine, gdef)`. Shared by the embedded, quantized and MoE engine tests."""
  rs = models.setup_devices(config_lib.parse(list(argv)))
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(rs.trainer_config))
  model, mesh = models.build_model(rs.sampler_config, rs.sampler_devices, pad_id=tok.pad_token_id)

  def scale(path, x):
    return x * 3.0 if "decoder" in [getattr(k, "key", None) for k in path] and x.ndim >= 2 else x

  nnx.update(model, jax.tree_util.tree_map_with_path(scale, nnx.state(model, nnx.Param)))
  engine = embedded.EmbeddedRollout(
      rollout_actor=model, tokenizer=tok, mesh=mesh, **run_engine.embedded_arguments(rs.sampler_config, mesh)
  )
  gdef, _ = nnx.split(model)
  return rs, model, tok, mesh, engine, gdef


def scaled_tiny_engine():
  """`scaled_engine` of configs/cpu_tiny.yml without its run setup: `(model, tok, mesh, engine, gdef)`. Also used by
  test_agentic."""
  return scaled_engine(["configs/cpu_tiny.yml"])[1:]


@pytest.fixture(name="setup", scope="module")
def setup_fixture():
  """The tiny CPU model, its engine, and a second copy of the model as the no-cache reference."""
  model, tok, _, engine, gdef = scaled_tiny_engine()

  def forward(state, toks, lens):
    m = nnx.merge(gdef, state)
    pos = jnp.broadcast_to(jnp.arange(REF_WIDTH)[None], toks.shape)
    seg = (pos < lens[:, None]).astype(jnp.int32)
    logits, _ = m(toks, pos, None, None, decoder_segment_ids=seg)
    return logits.astype(jnp.float32)

  @jax.jit
  def ref_next(state, toks, lens):
    """Greedy next token of each right-padded row (logits at its last real position)."""
    logits = forward(state, toks, lens)
    return jnp.argmax(jnp.take_along_axis(logits, (lens - 1)[:, None, None], axis=1)[:, 0], -1)

  @jax.jit
  def ref_scores(state, toks, lens, temperature):
    """Per position i: log_softmax(logits_i / T)[toks[i+1]] and the rank of toks[i+1] among the logits."""
    logits = forward(state, toks, lens)[:, :-1]
    nxt = toks[:, 1:, None]
    lp = jax.nn.log_softmax(logits / temperature, axis=-1)
    chosen = jnp.take_along_axis(logits, nxt, axis=-1)
    return jnp.take_along_axis(lp, nxt, axis=-1)[..., 0], jnp.sum(logits > chosen, axis=-1)

  def ref(toks, lens, temperature=None):
    args = (nnx.state(model), jnp.asarray(toks), jnp.asarray(lens))
    if temperature is None:
      return np.asarray(ref_next(*args))
    return tuple(np.asarray(x) for x in ref_scores(*args, jnp.float32(temperature)))

  return {"engine": engine, "tok": tok, "model": model, "ref": ref}


def _prompts(tok):
  return [
      tok.encode(
          "Tom has 3 apples and buys 4 more. How many apples does he have now? Think step by step, then "
          "answer with the final number only. Tom also has a sister, Ann, who has twice as many."
      ),
      tok.encode("Hi"),
      tok.encode("What is 12 * 7?"),
  ]


def _greedy_reference(ref, pad, prompts, steps):
  """Greedy tokens by full recomputation of every prefix (no KV cache): the independent reference."""
  toks = np.full((len(prompts), REF_WIDTH), pad, np.int32)
  lens = np.array([len(p) for p in prompts], np.int32)
  for i, p in enumerate(prompts):
    toks[i, : len(p)] = p
  out = np.zeros((len(prompts), steps), np.int32)
  for s in range(steps):
    nxt = ref(toks, lens)
    out[:, s] = nxt
    toks[np.arange(len(prompts)), lens] = nxt
    lens = lens + 1
  return out


@pytest.fixture(name="greedy", scope="module")
def greedy_fixture(setup):
  eng, tok = setup["engine"], setup["tok"]
  prompts = _prompts(tok)
  assert len(prompts[0]) > 32 > len(prompts[2]) > len(prompts[1])  # mixes prefill buckets 32 and 64
  res = eng.generate_tokens(prompts, greedy=True, max_new_tokens=NEW)
  return prompts, res


def test_greedy_matches_no_cache_recompute(setup, greedy):
  prompts, res = greedy
  want = _greedy_reference(setup["ref"], setup["tok"].pad_token_id, prompts, NEW)
  stop = setup["engine"]._stop_ids  # pylint: disable=protected-access
  for i in range(len(prompts)):
    n = int(res.lengths[i])
    np.testing.assert_array_equal(res.tokens[i, :n], want[i, :n], err_msg=f"row {i}")
    if n < NEW:  # stopped: the last kept token is a stop token, the rest is pad
      assert res.tokens[i, n - 1] in stop and (res.tokens[i, n:] == setup["tok"].pad_token_id).all()
  assert len({tuple(r) for r in want.tolist()}) == len(prompts) and len(set(want[0].tolist())) > 4  # non-trivial


def test_greedy_logps_match_recomputed(setup, greedy):
  prompts, res = greedy
  pad = setup["tok"].pad_token_id
  toks = np.full((len(prompts), REF_WIDTH), pad, np.int32)
  lens = np.zeros(len(prompts), np.int32)
  for i, p in enumerate(prompts):
    row = list(p) + res.tokens[i, : res.lengths[i]].tolist()
    toks[i, : len(row)] = row
    lens[i] = len(row)
  nxt, _ = setup["ref"](toks, lens, 1.0)
  for i, p in enumerate(prompts):
    n = int(res.lengths[i])
    np.testing.assert_allclose(res.logps[i, :n], nxt[i, len(p) - 1 : len(p) - 1 + n], atol=2e-4, rtol=0)
    assert (res.logps[i, n:] == 0).all()


def test_same_bucket_does_not_recompile(setup, greedy):
  eng, tok = setup["engine"], setup["tok"]
  prompts, first = greedy
  before = eng.compile_count
  # 4 prompts instead of 3 (same batch bucket 4), different lengths within the same 64 prompt bucket.
  res = eng.generate_tokens(
      [prompts[1], prompts[0], tok.encode("Another question?"), prompts[2]], greedy=True, max_new_tokens=NEW
  )
  assert eng.compile_count == before
  np.testing.assert_array_equal(res.tokens[1], first.tokens[0])  # batch composition does not change a row
  np.testing.assert_array_equal(res.tokens[0], first.tokens[1])


def test_stop_token_and_stop_string_end_rows(setup, greedy):
  eng, tok = setup["engine"], setup["tok"]
  prompts, first = greedy
  before = eng.compile_count
  row = first.tokens[0, :NEW]
  k = next(j for j in range(3, NEW) if row[j] not in row[:j])  # first occurrence at step k >= 3
  res = eng.generate_tokens(prompts, greedy=True, max_new_tokens=NEW, extra_stop_ids=[int(row[k])])
  assert eng.compile_count == before  # stop ids are a padded runtime array
  assert res.lengths[0] == k + 1 and res.finish_reason[0] == "stop_token"
  # So a sampled pad id ends a row the same way (the trainer reads a row up to its first pad: stops.pad_stops); a pad
  # that is EOS is a stop already.
  assert tok.pad_token_id != tok.eos_token_id and tok.pad_token_id in eng._stop_ids  # pylint: disable=protected-access
  assert not stops.pad_stops(7, 7) and stops.pad_stops(0, 1) == [0]
  np.testing.assert_array_equal(res.tokens[0, : k + 1], row[: k + 1])
  assert (res.tokens[0, k + 1 :] == tok.pad_token_id).all() and (res.logps[0, k + 1 :] == 0).all()
  np.testing.assert_allclose(res.logps[0, : k + 1], first.logps[0, : k + 1], atol=1e-6)

  # Stop strings, one per row: the text of a token (re-tokenising to itself) from each row's greedy output.
  # Host cut: first prefix whose decoded text contains any string (linear scan). The decode loop stops a
  # row when it emits one of those tokens, so it runs until the last row's first such token.
  rows = first.tokens.tolist()
  picks = []
  for r in rows:
    j = next(
        j
        for j in range(4, NEW)
        if tok.encode(tok.decode([r[j]])) == [r[j]] and r[j] not in r[:j] and tok.decode([r[j]]).strip()
    )
    picks.append(r[j])
  strings = [tok.decode([t]) for t in picks]
  res = eng.generate_tokens(prompts, greedy=True, max_new_tokens=NEW, stop_strings=strings)
  assert eng.compile_count == before
  for i, r in enumerate(rows):
    expected = next(j for j in range(1, NEW + 1) if any(x in tok.decode(r[:j]) for x in strings))
    assert res.lengths[i] == expected and res.finish_reason[i] == "stop_string", (i, res.lengths[i], expected)
    np.testing.assert_array_equal(res.tokens[i, :expected], r[:expected])
    assert (res.tokens[i, expected:] == tok.pad_token_id).all() and (res.logps[i, expected:] == 0).all()
  device_stop = max(next(j for j in range(NEW) if r[j] in picks) + 1 for r in rows)
  assert eng.last_decode_steps == device_stop < NEW
  assert res.mask.sum(1).tolist() == res.lengths.tolist()


def test_tunix_generate_sampling_groups_and_logps(setup):
  """Tunix entry point: G repeated prompts are sampled from one prefill; log-probs equal the learner's
  recomputation at the rollout temperature; every token lies inside the top-k of the reference logits.
  Log-prob tolerance 2e-4 nats (float32, cached vs. full attention summation order)."""

  eng, tok, model = setup["engine"], setup["tok"], setup["model"]
  texts = ["Tom has 3 apples and buys 4 more.", "What is 12 * 7?"]
  G, T, K = 3, NEW, 20
  rc = base_rollout.RolloutConfig(
      max_tokens_to_generate=T, temperature=0.7, top_k=K, top_p=0.95, seed=3, max_prompt_length=32
  )
  out = eng.generate([t for t in texts for _ in range(G)], rc)
  assert len(out.tokens) == len(out.text) == len(out.logprobs) == G * len(texts)
  assert out.left_padded_prompt_tokens.shape == (G * len(texts), 32)
  groups = [{tuple(out.tokens[g * G + j].tolist()) for j in range(G)} for g in range(len(texts))]
  assert all(len(s) > 1 for s in groups)  # samples in a group differ

  pad = tok.pad_token_id
  toks = np.full((G * len(texts), REF_WIDTH), pad, np.int32)
  lens = np.zeros(G * len(texts), np.int32)
  plens = []
  for i, c in enumerate(out.tokens):
    p = tok.encode(texts[i // G])
    assert (out.left_padded_prompt_tokens[i, -len(p) :] == p).all() and (
        out.left_padded_prompt_tokens[i, : -len(p)] == pad
    ).all()
    row = list(p) + c.tolist()
    toks[i, : len(row)] = row
    lens[i] = len(row)
    plens.append(len(p))
  nxt, rank = setup["ref"](toks, lens, 0.7)
  for i, c in enumerate(out.tokens):
    span = slice(plens[i] - 1, plens[i] - 1 + len(c))  # causal: position i's logits see only the prefix
    np.testing.assert_allclose(out.logprobs[i], nxt[i, span], atol=2e-4, rtol=0)
    assert (rank[i, span] < K).all(), (i, rank[i, span])

  # get_per_token_logps (Tunix old log-probs) on the same rows agrees with the reference too.
  comp = np.full((len(lens), T), pad, np.int32)
  for i, c in enumerate(out.tokens):
    comp[i, : len(c)] = c
  got = np.asarray(eng.get_per_token_logps(jnp.asarray(out.left_padded_prompt_tokens), jnp.asarray(comp)))
  for i, c in enumerate(out.tokens):
    np.testing.assert_allclose(got[i, : len(c)], out.logprobs[i], atol=2e-4, rtol=0)
  assert eng.model() is model and eng.pad_id() == pad and eng.eos_id() == tok.eos_token_id


def test_num_generations_greedy_broadcast_equals_single(setup, greedy):
  """Broadcasting one prefill over G rows gives each row exactly the single-prompt continuation."""
  eng = setup["engine"]
  prompts, first = greedy
  res = eng.generate_tokens(prompts[1:], num_generations=2, greedy=True, max_new_tokens=NEW)
  for j in range(2):
    for g in range(2):
      np.testing.assert_array_equal(res.tokens[2 * j + g], first.tokens[j + 1])
  assert res.prompt_lengths.tolist() == [len(prompts[1])] * 2 + [len(prompts[2])] * 2


def test_update_params_changes_output_without_recompiling(setup, greedy):
  eng, model = setup["engine"], setup["model"]
  prompts, first = greedy
  before = eng.compile_count
  old = nnx.state(model, nnx.Param)
  eng.update_params(jax.tree.map(lambda x: x * 1.3, old))
  try:
    res = eng.generate_tokens(prompts, greedy=True, max_new_tokens=NEW)
    want = _greedy_reference(setup["ref"], setup["tok"].pad_token_id, prompts, NEW)
    assert not np.array_equal(res.tokens, first.tokens)
    for i in range(len(prompts)):
      np.testing.assert_array_equal(res.tokens[i, : res.lengths[i]], want[i, : res.lengths[i]])
  finally:
    eng.update_params(old)
  assert eng.compile_count == before


@pytest.mark.parametrize(
    "spec_kw",
    [
        {"temperature": 0.5},
        {"temperature": 1.0, "top_k": 3},
        {"temperature": 2.0, "top_p": 0.6},
        {"temperature": 0.8, "top_k": 4, "top_p": 0.7},
    ],
)
def test_sampler_distribution_matches_numpy(spec_kw):
  """Empirical token frequencies of `sampling.sample` vs the NumPy-derived truncated distribution."""
  logits = np.array([[2.0, 1.5, 1.0, 0.3, -0.5, -1.0, 0.9]], np.float32)
  params = sampling.SamplingParams.create(spec_kw.get("temperature"), spec_kw.get("top_k"), spec_kw.get("top_p"))
  spec = params.spec(logits.shape[1])
  n = 20000
  fn = jax.jit(
      lambda k: sampling.sample(
          jnp.repeat(jnp.asarray(logits), n, 0), k, spec, jnp.float32(params.temperature), jnp.float32(params.top_p)
      )
  )
  toks, lps = fn(jax.random.PRNGKey(0))
  toks, lps = np.asarray(toks), np.asarray(lps)
  z = logits[0].astype(np.float64) / params.temperature
  full = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
  order = np.argsort(-z)
  keep = np.zeros_like(full, bool)
  cand = order[: params.top_k] if params.top_k else order
  cum = 0.0
  for t in cand:  # nucleus over the (top-k) candidates, renormalised among them
    keep[t] = True
    cum += full[t] / full[cand].sum()
    if cum >= params.top_p:
      break
  want = np.where(keep, full, 0)
  want /= want.sum()
  freq = np.bincount(toks, minlength=len(full)) / n
  np.testing.assert_allclose(freq, want, atol=0.015)
  np.testing.assert_allclose(lps, np.log(full)[toks], atol=1e-5)  # untruncated log-softmax(logits / T)


def test_sampling_params_normalise_off_values():
  assert sampling.SamplingParams.create(0.0, None, None).greedy
  p = sampling.SamplingParams.create(0.9, -1, -1.0)
  assert (p.top_k, p.top_p, p.greedy) == (0, 1.0, False)
  assert p.spec(100) == sampling.SamplingSpec(greedy=False, top_k=0, use_top_p=False)
  assert dataclasses.replace(p, greedy=True).spec(100) == sampling.SamplingSpec(greedy=True)


def test_chunked_argmax_and_logsumexp_match_numpy():
  rng = np.random.default_rng(0)
  for v in (1000, 1001, 151936):
    x = rng.normal(size=(5, v)).astype(np.float32)
    x[1] = np.round(x[1])  # many ties: first maximum wins, like np.argmax
    x[2, [7, v - 1]] = 100.0
    np.testing.assert_array_equal(np.asarray(sampling.argmax(jnp.asarray(x))), np.argmax(x, -1))
    want = np.log(np.exp(x.astype(np.float64) - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    np.testing.assert_allclose(np.asarray(sampling.logsumexp(jnp.asarray(x))), want, rtol=1e-5)


@pytest.mark.multidevice
def test_data_parallel_mesh_greedy_matches_recompute(setup):
  """On 8 host devices the batch is sharded over the rollout mesh's data axes; output is unchanged."""
  eng, tok = setup["engine"], setup["tok"]
  if eng.sampler.dp < 2:
    pytest.skip(f"rollout mesh has no data-parallel axis here ({dict(eng.sampler.mesh.shape)})")
  prompts = _prompts(tok)
  res = eng.generate_tokens(prompts, greedy=True, max_new_tokens=8)
  want = _greedy_reference(setup["ref"], tok.pad_token_id, prompts, 8)
  for i in range(len(prompts)):
    np.testing.assert_array_equal(res.tokens[i, : res.lengths[i]], want[i, : res.lengths[i]])
  # The AR cache (layers=2, T=8, kv_heads=2, batch, head_dim=16) is sharded over the batch, not replicated.

  ((sig, compiled),) = [(k, v) for k, v in eng.sampler.compiled.items() if k[0].new_tokens == 8]
  rows = sig[0].prompts * sig[0].generations
  per_device = {int(b) for b in re.findall(r"f32\[2,8,2,(\d+),16\]", compiled.as_text())}
  assert per_device == {rows // eng.sampler.dp}, (per_device, rows, eng.sampler.dp)


def test_registry_bucketing_and_grouping_helpers():

  assert registry.load("rollout_engines", "embedded").load_engine() is embedded.EmbeddedRollout
  assert issubclass(embedded.EmbeddedRollout, base_rollout.BaseRollout)
  assert embedded.EmbeddedRollout.spec is registry.load("rollout_engines", "embedded")
  assert [bucketing.next_bucket(n, [32, 64, 128]) for n in (1, 32, 33, 128, 129, 300)] == [32, 32, 64, 128, 256, 384]
  a, b = [1, 2], [3]
  assert bucketing.consecutive_groups([a, a, b, b]) == ([a, b], 2)
  assert bucketing.consecutive_groups([a, b, a, b]) == ([a, b, a, b], 1)
  assert bucketing.consecutive_groups([a, a, a]) == ([a], 3)
  assert bucketing.consecutive_groups([a, a, b]) == ([a, a, b], 1)
