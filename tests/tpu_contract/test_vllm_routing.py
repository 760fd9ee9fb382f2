"""Router replay on vLLM's MaxTextForCausalLM route: the experts vLLM-TPU reports for each token are the ones the
trainer routes the same tokens to, placed where the trainer replays them.

The engine is the real MaxTextForCausalLM built from the plugin's own `vllm.LLM` kwargs with `rl.router_replay=true`
(so the kwargs are what turns MaxText's `return_routed_experts` on), synced from a float32 MaxText actor, driven through
its paged KV cache with a chunked prefill (forward.engine_greedy). What the request would get back as
`CompletionOutput.routed_experts` is built by vLLM's and tpu-inference's own capture code (forward.vllm_routed_experts:
per-KV-slot storage, emit cursors, `take_output`). The plugin lays it out (rollout/vllm_routing.py); the trainer's
forward over the same tokens must record the same experts at every routed position, replaying it must be what the
trainer's MoE layers use, and an alignment off by one position or onto another request's row must show as mismatch.
"""

from __future__ import annotations

import numpy as np
import pytest

from flax import nnx
import jax.numpy as jnp

from maxtext_rl_plugin import moe
from maxtext_rl_plugin.rollout import vllm_routing

import forward
from test_forward_maxtext import adapter_pair

N_DECODE = 2
PROMPT_WIDTH, COMPLETION_WIDTH = 112, 8  # the trainer's layout: prompts left-padded, completions right-padded
SPLIT = forward.PAGE_SIZE + 2  # chunked prefill across a page boundary


@pytest.fixture(scope="module", name="pair")
def _pair(model_dir):
  pair = adapter_pair(model_dir, "qwen3")  # test_forward_maxtext.py's Qwen3-MoE pair: built with rl.router_replay=true
  pair.sync()  # whatever another test left in the engine, it now holds the actor's weights
  return pair


def _request(pair, prompt):
  """(completion tokens, the request's routing in the trainer's layout [P+T, layers, k])."""
  steps = []
  _, tokens = forward.engine_greedy(pair.engine, pair.mesh, prompt, N_DECODE, pad_to=16, prefill_split=SPLIT, steps=steps)
  routed = forward.vllm_routed_experts(steps, len(prompt), int(pair.cfg.num_experts))
  assert routed.shape == (len(prompt) + len(tokens) - 1, int(pair.cfg.num_decoder_layers), 2), routed.shape
  return tokens, routed


def _trainer(pair, prompts, completions, forced=None):
  """The trainer's forward (moe.forward_logps, the run's) over the rows: (log-probs [B, T], routing [B, P+T, L, k])."""
  used = {t for p in prompts for t in p} | {t for c in completions for t in c}
  pad = next(t for t in range(int(pair.cfg.vocab_size)) if t not in used)  # a pad id no real token equals
  left = np.full((len(prompts), PROMPT_WIDTH), pad, np.int32)
  right = np.full((len(prompts), COMPLETION_WIDTH), pad, np.int32)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    left[i, -len(p) :] = p
    right[i, : len(c)] = c
  logps, _, route, _ = moe.forward_logps(
      moe.recording_graphdef(pair.actor),
      nnx.state(pair.actor),
      jnp.asarray(left),
      jnp.asarray(right),
      pad,
      pad,
      forced=None if forced is None else jnp.asarray(forced),
  )
  mask = moe.routed_mask(left != pad, right != pad)
  return np.asarray(logps), np.asarray(route), mask


def test_the_plugins_kwargs_turn_capture_on_and_vllm_takes_them(pair):
  import vllm  # pylint: disable=import-outside-toplevel  # .venv-tpu only

  kwargs = pair.rollout.engine_kwargs
  assert pair.rollout.capture_routing and kwargs["enable_return_routed_experts"] is True
  assert kwargs["additional_config"]["maxtext_config"]["return_routed_experts"] is True
  assert vllm.EngineArgs(model="m", enable_return_routed_experts=True).enable_return_routed_experts  # vLLM's own field
  assert pair.engine.maxtext_config.return_routed_experts  # the adapter's MaxText config, as vLLM's loader built it


def test_vllm_reports_the_trainers_routing_and_replay_uses_it(pair):
  rng = np.random.default_rng(11)
  prompts = [[int(t) for t in rng.integers(0, 1024, n)] for n in (26, 21)]
  runs = [_request(pair, p) for p in prompts]
  completions = [t for t, _ in runs]
  layout = np.stack(
      [vllm_routing.request_layout(r, len(p), len(t), PROMPT_WIDTH, COMPLETION_WIDTH) for p, (t, r) in zip(prompts, runs)]
  )
  free_lp, trainer_route, mask = _trainer(pair, prompts, completions)
  assert mask.sum() == sum(len(p) + len(t) - 1 for p, t in zip(prompts, completions))
  # Every routed position: the engine's experts are the trainer's (float32 on both sides: the same top-k).
  assert moe.mismatch_fraction(layout, trainer_route, mask) == 0.0
  np.testing.assert_array_equal(np.sort(layout[mask], -1), np.sort(trainer_route[mask], -1))
  assert (layout[~mask] == moe.UNSET).all()

  # An alignment one position off, or a request's routing on the other row, does not pass for the trainer's.
  shifted = np.stack(
      [
          vllm_routing.request_layout(np.roll(r, 1, axis=0), len(p), len(t), PROMPT_WIDTH, COMPLETION_WIDTH)
          for p, (t, r) in zip(prompts, runs)
      ]
  )
  assert moe.mismatch_fraction(shifted, trainer_route, mask) > 0.2
  swapped = layout[::-1]
  both = mask & mask[::-1]
  assert moe.mismatch_fraction(swapped, trainer_route, both) > 0.2

  # Replay: the trainer's MoE layers route as told. vLLM's routing reproduces the free forward; another does not.
  # Compared on the completion tokens (the loss's): past them the last token's routing is UNSET by design (moe.py).
  real = np.arange(COMPLETION_WIDTH)[None] < np.asarray([len(c) for c in completions])[:, None]
  replay_lp, replay_route, _ = _trainer(pair, prompts, completions, forced=layout)
  np.testing.assert_array_equal(replay_route[mask], layout[mask])
  np.testing.assert_allclose(replay_lp[real], free_lp[real], atol=1e-5)
  wrong_lp, wrong_route, _ = _trainer(pair, prompts, completions, forced=shifted)
  np.testing.assert_array_equal(wrong_route[mask], shifted[mask])
  assert np.abs(wrong_lp[real] - free_lp[real]).max() > 1e-3
