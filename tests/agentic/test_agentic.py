"""Multi-turn episodes with tools (agentic/): the parser on malformed calls, the tools' error observations, an episode
trace against a hand-checked transcript, the loss mask against a NumPy computation over the policy's tokens alone, and
the embedded engine's multi-turn output against a from-scratch recompute of the whole transcript.
"""

from __future__ import annotations

import inspect
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.rl.agentic.tools import base_tool
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin.algorithms import loss as loss_lib
from maxtext_rl_plugin.agentic import episode
from maxtext_rl_plugin.agentic import parse
from maxtext_rl_plugin.agentic import tools
from maxtext_rl_plugin.rollout import embedded
from maxtext_rl_plugin.rollout import vllm as vllm_rollout
from test_rollout_embedded import scaled_tiny_engine

# ----------------------------------------------------------------------------------------------------------------------
# Parser and tools
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, want",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"a": 12, "b": 34, "op": "*"}}</tool_call>', None),
        ('so <tool_call>\n{"name": "calculator", "arguments": {"a": 1, "b": 2, "op": "+"}}\n</tool_call>\n', None),
        ('<tool_call>{"name": "calculator", "arguments": {"a": 1,</tool_call>', "not valid JSON"),
        ("<tool_call></tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "calculator"}</tool_call>', "needs 'name' and 'arguments'"),
        ('<tool_call>{"arguments": {}}</tool_call>', "needs 'name' and 'arguments'"),
        ("<tool_call>[1, 2]</tool_call>", "needs 'name' and 'arguments'"),
        ("<tool_call>7</tool_call>", "needs 'name' and 'arguments'"),
        ("12 * 34 = </tool_call>", "without <tool_call>"),
    ],
)
def test_parser_on_well_formed_and_malformed_calls(text, want, capsys):
  p = parse.CallParser("qwen")
  assert p.ends_with_call(text)
  call = p.call(text)
  if want is None:
    assert not call.error and call.name == "calculator" and isinstance(call.arguments, dict)
  else:
    assert want in call.error and not call.name
  assert capsys.readouterr().out == ""  # Tunix's parser prints a block it cannot decode: silenced


def test_parser_takes_the_last_opening_tag_and_knows_an_answer_from_a_call():
  p = parse.CallParser("qwen")
  text = '<tool_call>{bad <tool_call>{"name": "calculator", "arguments": {"a": 2, "b": 3, "op": "-"}}</tool_call>'
  assert p.call(text) == parse.Call("calculator", {"a": 2, "b": 3, "op": "-"})
  assert not p.ends_with_call("<answer>6</answer>") and not p.ends_with_call("<tool_call>{...}")
  assert p.observation("42") == "<tool_response>42</tool_response>\n"


class _Slow(base_tool.BaseTool):
  """Sleeps past any sane timeout."""

  def get_json_schema(self):
    return {}

  def apply(self, **kwargs):
    time.sleep(float(kwargs.get("seconds", 5)))
    return base_tool.ToolOutput(name=self.name, output="late")


class _Raises(base_tool.BaseTool):
  """Raises from apply."""

  def get_json_schema(self):
    return {}

  def apply(self, **kwargs):
    raise RuntimeError("boom")


def test_tool_errors_are_observations_not_exceptions(monkeypatch):
  monkeypatch.setitem(tools.TOOL_CLASSES, "slow", _Slow)
  monkeypatch.setitem(tools.TOOL_CLASSES, "raises", _Raises)
  box = tools.Toolbox(["calculator", "slow", "raises"], timeout_s=0.2)
  assert box.run("calculator", {"a": 123, "b": 456, "op": "*"}) == tools.Observation(str(123 * 456), False)
  cases = {
      ("nope", "{}"): "unknown tool 'nope'",
      ("calculator", "[1]"): "must be a JSON object",
      ("calculator", '{"a": 1, "b": 0, "op": "/"}'): "Division by zero",
      ("calculator", '{"a": "x", "b": 1, "op": "+"}'): "must be numbers",
      ("raises", "{}"): "RuntimeError: boom",
      ("slow", '{"seconds": 3}'): "timed out after 0.2s",
  }
  import json  # pylint: disable=import-outside-toplevel

  for (name, args), want in cases.items():
    t = time.perf_counter()
    obs = box.run(name, json.loads(args))
    assert obs.error and want in obs.text, (name, obs)
    assert time.perf_counter() - t < 2.5  # the timeout returns long before the tool does
  # the tool set goes on working after a timeout
  assert box.run("calculator", {"a": 2, "b": 3, "op": "+"}).text == "5"


# ----------------------------------------------------------------------------------------------------------------------
# The turn loop: a hand-checked transcript
# ----------------------------------------------------------------------------------------------------------------------


class _CharTokenizer:
  """One token per character (id = code point + 10), so a transcript can be checked by hand; "\x01" (id 11) is EOS, a
  special token that decoding skips."""

  def encode(self, text, add_special_tokens=True):
    del add_special_tokens
    return [ord(c) + 10 for c in text]

  def decode(self, ids, skip_special_tokens=True):
    return "".join(chr(i - 10) for i in ids if not (skip_special_tokens and i <= 11))


def _scripted_policy(tok, script):
  """A policy that answers turn t of row r with script[r][t] (text, finish); log-prob of every token = -(turn+1)."""
  calls = []

  def turn_fn(contexts, gens, max_new, turn):
    calls.append((len(contexts), gens, max_new, turn, [tok.decode(c) for c in contexts]))
    rows = [r for r in range(len(script)) if len(script[r]) > turn]
    out = []
    for r in rows:
      text, finish = script[r][turn]
      ids = np.asarray(tok.encode(text)[:max_new], np.int32)
      out.append((ids, np.full(len(ids), -(turn + 1.0), np.float32), finish))
    return out

  return turn_fn, calls


def test_episode_trace_matches_a_hand_checked_transcript():
  tok = _CharTokenizer()
  call = '<tool_call>{"name": "calculator", "arguments": {"a": 37, "b": 48, "op": "*"}}</tool_call>'
  bad = "<tool_call>{oops}</tool_call>"
  script = [
      # row 0: a call, the answer read from the tool
      [(call, "stop_string"), ("<answer>1776</answer>\x01", "eos")],
      # row 1: answers at once
      [("<answer>1700</answer>\x01", "eos")],
      # row 2: bad JSON, then an unknown tool, then max_turns=3 ends it at the third call
      [
          (bad, "stop_string"),
          ('<tool_call>{"name": "abacus", "arguments": {}}</tool_call>', "stop_string"),
          (call, "stop_string"),
      ],
      # row 3: runs out of the per-turn budget (the scripted text is cut to max_new)
      [("x" * 500, "length")],
  ]
  turn_fn, calls = _scripted_policy(tok, script)
  prompt = tok.encode("Q: 37*48?")
  limits = episode.Limits(max_turns=3, turn_tokens=200, total_tokens=400)
  eps = episode.run_episodes(
      turn_fn, tok, [prompt, prompt], 2, limits, tools.Toolbox(["calculator"], 1.0), parse.CallParser("qwen"), [11]
  )
  # The engine saw: turn 0 the 2 prompts x G=2; turn 1 rows 0 and 2's transcripts; turn 2 row 2's.
  assert [(n, g, t) for n, g, _, t, _ in calls] == [(2, 2, 0), (2, 1, 1), (1, 1, 2)]
  obs = "<tool_response>1776</tool_response>\n"
  assert calls[1][4][0] == "Q: 37*48?" + call + obs
  e0 = eps[0]
  assert e0.transcript == [("assistant", call), ("tool", obs), ("assistant", "<answer>1776</answer>")]
  assert e0.text == call + "<answer>1776</answer>"  # rewards see the assistant only
  assert e0.tokens == tok.encode(call + obs + "<answer>1776</answer>\x01")
  assert e0.loss_mask == [1] * len(call) + [0] * len(obs) + [1] * 22
  assert e0.logps == [-1.0] * len(call) + [0.0] * len(obs) + [-2.0] * 22
  assert (e0.turns, e0.tool_calls, e0.tool_errors, e0.finish) == (2, 1, 0, "answer")
  e1 = eps[1]
  assert (e1.turns, e1.tool_calls, e1.finish, sum(e1.loss_mask), len(e1.tokens)) == (1, 0, "answer", 22, 22)
  e2 = eps[2]
  assert [r for r, _ in e2.transcript] == ["assistant", "tool", "assistant", "tool", "assistant"]
  assert e2.transcript[1][1] == "<tool_response>Error: the tool call is not valid JSON</tool_response>\n"
  assert e2.transcript[3][1].startswith("<tool_response>Error: unknown tool 'abacus'")
  assert (e2.turns, e2.tool_calls, e2.tool_errors, e2.finish) == (3, 3, 2, "max_turns")
  e3 = eps[3]
  assert (e3.turns, e3.finish, len(e3.tokens)) == (1, "length", 200)
  m = episode.metrics(eps)
  masked = len(obs) + len(e2.transcript[1][1]) + len(e2.transcript[3][1])
  assert m["agentic/masked_tokens"] == masked
  assert m["agentic/turns_mean"] == (2 + 1 + 3 + 1) / 4 and m["agentic/tool_call_rate"] == 0.5
  assert m["agentic/tool_errors"] == 2 and m["agentic/tool_calls_mean"] == 1.0
  assert m["agentic/max_turns_fraction"] == 0.25


def test_total_budget_cuts_a_turn_and_refuses_a_tool_answer_that_does_not_fit():
  tok = _CharTokenizer()
  call = '<tool_call>{"name": "calculator", "arguments": {"a": 2, "b": 2, "op": "+"}}</tool_call>'
  script = [[(call, "stop_string"), ("y" * 50, "eos")], [(call, "stop_string")]]
  turn_fn, _ = _scripted_policy(tok, script)
  obs = len("<tool_response>4</tool_response>\n")
  total = len(call) + obs + 10  # row 0: room for 10 tokens after the tool's answer
  limits = episode.Limits(max_turns=4, turn_tokens=total, total_tokens=total)
  eps = episode.run_episodes(
      turn_fn, tok, [tok.encode("Q"), tok.encode("R")], 1, limits, tools.Toolbox(["calculator"], 1.0), parse.CallParser()
  )
  assert len(eps[0].tokens) == total and eps[0].finish == "length" and eps[0].tokens[-10:] == tok.encode("y" * 10)
  limits = episode.Limits(max_turns=4, turn_tokens=len(call) + obs, total_tokens=len(call) + obs)
  eps = episode.run_episodes(
      turn_fn, tok, [tok.encode("Q"), tok.encode("R")], 1, limits, tools.Toolbox(["calculator"], 1.0), parse.CallParser()
  )
  assert eps[1].finish == "length" and eps[1].loss_mask == [1] * len(call)  # no room to read the answer: ended


# ----------------------------------------------------------------------------------------------------------------------
# The loss mask: policy tokens alone
# ----------------------------------------------------------------------------------------------------------------------


def _np_grpo_token_mean(lp, old, ref, adv, eps, beta):
  """GRPO (clip, k3 KL, token-mean) over a list of per-row 1-D arrays of the policy's tokens: (loss, grad per row)."""
  n = sum(len(x) for x in lp)
  loss, grads = 0.0, []
  for i, row in enumerate(lp):
    g = np.zeros(len(row))
    for t, x in enumerate(row):
      r = np.exp(x - old[i][t])
      unclipped, clipped = r * adv[i], np.clip(r, 1 - eps, 1 + eps) * adv[i]
      d = ref[i][t] - x
      kl, dkl = np.exp(d) - d - 1.0, 1.0 - np.exp(d)
      loss += (-min(unclipped, clipped) + beta * kl) / n
      g[t] = (-(0.0 if clipped < unclipped else adv[i] * r) + beta * dkl) / n
    grads.append(g)
  return loss, grads


def test_loss_and_gradient_see_the_policys_tokens_alone():
  rng = np.random.default_rng(0)
  # Three episodes: assistant / tool / assistant ..., then padding; 1 = the policy's token.
  masks = [
      [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1],
      [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
      [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0],
  ]
  mask = np.asarray(masks, np.float64)
  b, t = mask.shape
  lp = -rng.uniform(0.05, 3.0, (b, t))
  old = lp + rng.normal(0, 0.2, (b, t))
  ref = lp + rng.normal(0, 0.3, (b, t))
  adv = rng.normal(0, 1, b)
  kw = {"loss_algo": "grpo", "epsilon": 0.2, "beta": 0.05, "kl_estimator": "k3", "loss_agg_mode": "token-mean"}

  def jax_loss(lp_, old_, ref_, adv_):
    def f(x):
      return loss_lib.policy_loss(x, *[jnp.asarray(a, jnp.float32) for a in (old_, ref_, adv_, mask)], **kw)[0]

    v, g = jax.value_and_grad(f)(jnp.asarray(lp_, jnp.float32))
    return float(v), np.asarray(g, np.float64)

  loss, grad = jax_loss(lp, old, ref, adv)
  keep = [np.flatnonzero(m) for m in mask]
  want, want_grads = _np_grpo_token_mean(
      [lp[i, k] for i, k in enumerate(keep)],
      [old[i, k] for i, k in enumerate(keep)],
      [ref[i, k] for i, k in enumerate(keep)],
      adv,
      0.2,
      0.05,
  )
  np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-6)
  for i, k in enumerate(keep):
    np.testing.assert_allclose(grad[i, k], want_grads[i], rtol=2e-4, atol=1e-6)
  assert np.all(grad[mask == 0] == 0.0)

  # The environment's tokens can hold anything (log-probs, old/ref log-probs, per-token advantages): nothing moves.
  env = mask == 0
  lp2, old2, ref2 = lp.copy(), old.copy(), ref.copy()
  lp2[env], old2[env], ref2[env] = 5.0, -40.0, 9.0
  loss2, grad2 = jax_loss(lp2, old2, ref2, adv)
  assert loss2 == loss and np.array_equal(grad2, grad)
  adv_bt = np.repeat(adv[:, None], t, axis=1)
  adv_bt2 = adv_bt.copy()
  adv_bt2[env] = 1e4
  assert jax_loss(lp, old, ref, adv_bt2)[0] == pytest.approx(jax_loss(lp, old, ref, adv_bt)[0], abs=0) == loss


# ----------------------------------------------------------------------------------------------------------------------
# The embedded engine: multi-turn output == a from-scratch recompute of the whole transcript
# ----------------------------------------------------------------------------------------------------------------------

REF_WIDTH = 128


@pytest.fixture(name="tiny", scope="module")
def tiny_fixture():
  """The tiny CPU model (decoder weights x3 so greedy output depends on the context) and its embedded engine."""
  model, tok, _, engine, gdef = scaled_tiny_engine()

  @jax.jit
  def scores(state, toks, lens):
    """Per position i of right-padded rows: log_softmax(logits_i)[toks[i+1]] and that token's rank (0 = argmax)."""
    m = nnx.merge(gdef, state)
    pos = jnp.broadcast_to(jnp.arange(REF_WIDTH)[None], toks.shape)
    logits, _ = m(toks, pos, None, None, decoder_segment_ids=(pos < lens[:, None]).astype(jnp.int32))
    logits = logits.astype(jnp.float32)[:, :-1]
    nxt = toks[:, 1:, None]
    chosen = jnp.take_along_axis(logits, nxt, axis=-1)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), nxt, axis=-1)[..., 0]
    return lp, jnp.sum(logits > chosen, axis=-1)

  return {"engine": engine, "tok": tok, "state": nnx.state(model), "scores": scores}


def test_embedded_multi_turn_equals_from_scratch_recompute(tiny):
  eng, tok = tiny["engine"], tiny["tok"]
  prompts = [tok.encode("What is 37 * 48? Use the calculator."), tok.encode("Hi there")]
  rc = base_rollout.RolloutConfig(temperature=0.0, max_tokens_to_generate=40, max_prompt_length=32, eos_tokens=None)
  # A random model never writes Qwen's closing tag; make the "closing tag" a piece of its own greedy output so that
  # its turns end in (malformed) calls and the episodes go on for several turns with tool answers in between.
  first = eng.generate_tokens(prompts[:1], greedy=True, max_new_tokens=8)
  tag = tok.decode(first.tokens[0, 3:5].tolist(), skip_special_tokens=True)
  assert tag.strip(), "the tiny model's greedy text has no printable piece to stop on"
  parser = parse.CallParser("qwen")
  parser.end = tag

  def turn_fn(contexts, gens, max_new, turn):
    return eng.generate_turn(
        contexts,
        num_generations=gens,
        max_new_tokens=max_new,
        rollout_config=rc,
        rng=jax.random.PRNGKey(turn),
        stop_strings=[tag],
    )

  limits = episode.Limits(max_turns=3, turn_tokens=16, total_tokens=64)
  eps = episode.run_episodes(
      turn_fn, tok, prompts, 2, limits, tools.Toolbox(["calculator"], 1.0), parser, [tok.pad_token_id]
  )
  # really multi-turn: an assistant turn after a tool answer
  assert any([r for r, _ in e.transcript][:3] == ["assistant", "tool", "assistant"] for e in eps), [
      e.transcript for e in eps
  ]
  assert eps[0].tokens == eps[1].tokens  # greedy: both samples of a prompt agree
  toks = np.full((len(eps), REF_WIDTH), tok.pad_token_id, np.int32)
  lens = np.zeros(len(eps), np.int32)
  for i, e in enumerate(eps):
    row = e.prompt + e.tokens
    toks[i, : len(row)], lens[i] = row, len(row)
  lp, rank = (np.asarray(x) for x in tiny["scores"](tiny["state"], jnp.asarray(toks), jnp.asarray(lens)))
  for i, e in enumerate(eps):
    p = len(e.prompt)
    policy = np.flatnonzero(np.asarray(e.loss_mask)) + p - 1  # position that predicts each policy token
    assert np.all(rank[i, policy] == 0), f"row {i}: a policy token is not the recompute's argmax"
    np.testing.assert_allclose(np.asarray(e.logps)[np.asarray(e.loss_mask) == 1], lp[i, policy], atol=2e-4)
    env = [t for t, m in zip(e.tokens, e.loss_mask) if not m]
    want_env = "".join(text for role, text in e.transcript if role == "tool")
    assert env == tok.encode(want_env, add_special_tokens=False) and all(
        x == 0.0 for x, m in zip(e.logps, e.loss_mask) if not m
    )


# ----------------------------------------------------------------------------------------------------------------------
# The products task and its warm start
# ----------------------------------------------------------------------------------------------------------------------


def test_products_task_demonstrations_call_the_calculator_the_configured_fraction_of_the_time():
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.config import load as config_lib  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.data import load  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.data import prompts  # pylint: disable=import-outside-toplevel

  cfg = config_lib.load_config(["configs/cpu_demo_tools.yml"])
  tok = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
  assert len(tok) <= cfg.vocab_size
  train, evaluation = load.load_splits(load.DataSettings.from_config(cfg), tok)
  parser, box = parse.CallParser(cfg.rl.agentic_tool_parser), tools.Toolbox(list(cfg.rl.agentic_tools), 1.0)
  examples = train.batch(0, 400)
  calls = 0
  for ex in examples:
    a, b = (int(x) for x in ex.question.removeprefix("What is ").removesuffix("?").split(" * "))
    assert 10 <= a <= 99 and 10 <= b <= 99 and ex.answer == str(a * b)
    target = prompts.format_target(ex, prompts.PromptSettings.from_config(cfg))
    assert tok.decode(tok.encode(target)) == target and target.endswith(f"<answer>{a * b}</answer>")
    if "<tool_call>" in target:
      calls += 1
      turn = target[: target.index(parser.end) + len(parser.end)]
      call = parser.call(turn)
      assert box.run(call.name, call.arguments) == tools.Observation(str(a * b), False)
      assert len(tok.encode(turn)) <= 12  # the markup is whole tokens (demo_tokenizer.TOOL_TOKENS)
      assert parser.observation(str(a * b)) in target  # the SFT text after the call is what the environment appends
  assert 0.05 < calls / len(examples) < 0.15  # synthetic_tool_rate = 0.1
  assert not any(
      "<tool_call>" in prompts.format_target(evaluation[i], prompts.PromptSettings.from_config(cfg)) for i in range(50)
  )  # eval: gold only


def test_both_engines_answer_episodes_one_call_signature_for_signature():
  """episode.py calls `generate_turn` the same way on either engine: the parameters (names, kinds, defaults) match."""
  emb = inspect.signature(embedded.EmbeddedRollout.generate_turn)
  vll = inspect.signature(vllm_rollout.VllmRollout.generate_turn)
  assert (
      list(emb.parameters)
      == list(vll.parameters)
      == [
          "self",
          "contexts",
          "num_generations",
          "max_new_tokens",
          "rollout_config",
          "rng",
          "stop_strings",
      ]
  )
  for name, p in emb.parameters.items():
    assert (p.kind, p.default) == (vll.parameters[name].kind, vll.parameters[name].default), name
