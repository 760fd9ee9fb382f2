"""rollout/vllm_routing.py: vLLM's per-request `routed_experts` placed as the trainer lays routing out (moe.py).

The layout is checked against a hand-built expectation, position by position; an off-by-one count in either direction
and a missing capture are errors, not a shifted replay. tests/tpu_contract/test_vllm_routing.py runs the same
functions on what tpu-inference's runner and vLLM's connector really produce.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from maxtext_rl_plugin import moe
from maxtext_rl_plugin.rollout import vllm_routing

LAYERS, K = 3, 2


def _rows(n: int, seed: int = 0) -> np.ndarray:
  """[n, LAYERS, K] distinct per position: position i's experts encode i, so a shift shows."""
  rng = np.random.default_rng(seed)
  return (np.arange(n)[:, None, None] * 7 + rng.integers(0, 5, (n, LAYERS, K))).astype(np.uint8)


def test_request_layout_places_prompt_right_and_completion_left_with_the_last_token_unset():
  p, c, pw, cw = 3, 4, 5, 6
  rows = _rows(p + c - 1)
  got = vllm_routing.request_layout(rows, p, c, pw, cw)
  assert got.shape == (pw + cw, LAYERS, K) and got.dtype == np.int32
  want = np.full((pw + cw, LAYERS, K), moe.UNSET, np.int32)
  for i in range(p):  # prompt position i sits at column pw - p + i (prompts are left-padded)
    want[pw - p + i] = rows[i]
  for j in range(c - 1):  # completion token j (fed back as input) sits at column pw + j
    want[pw + j] = rows[p + j]
  np.testing.assert_array_equal(got, want)
  assert (got[pw + c - 1] == moe.UNSET).all()  # the last sampled token was never fed: no routing


@pytest.mark.parametrize("delta", [-1, 1])
def test_an_off_by_one_count_is_an_error(delta):
  with pytest.raises(RuntimeError, match=r"expected \[6, layers, k\]"):
    vllm_routing.request_layout(_rows(6 + delta), 3, 4, 5, 6)


def test_no_capture_is_an_error_naming_the_keys():
  with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
    vllm_routing.request_layout(None, 3, 4, 5, 6)


def test_batch_layout_keeps_request_order():
  outs, lens, rows = [], [2, 4], []
  for i, (p, c) in enumerate(zip(lens, [3, 2])):
    r = _rows(p + c - 1, seed=i)
    rows.append(r)
    outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=list(range(c)), routed_experts=r)]))
  got = vllm_routing.batch_layout(outs, lens, 4, 3)
  assert got.shape == (2, 7, LAYERS, K)
  np.testing.assert_array_equal(got[0, 2:4], rows[0][:2])  # row 0: prompt of 2 right-aligned
  np.testing.assert_array_equal(got[0, 4:6], rows[0][2:])
  np.testing.assert_array_equal(got[1, 0:4], rows[1][:4])  # row 1: a full-width prompt
  np.testing.assert_array_equal(got[1, 4:5], rows[1][4:])


def test_capture_kwargs_turns_on_both_sides_without_touching_the_input():
  kwargs = {"tensor_parallel_size": 2, "additional_config": {"maxtext_config": {"model_name": "qwen3-30b-a3b"}}}
  out = vllm_routing.capture_kwargs(kwargs)
  assert out["enable_return_routed_experts"] is True
  assert out["additional_config"]["maxtext_config"] == {"model_name": "qwen3-30b-a3b", "return_routed_experts": True}
  assert "enable_return_routed_experts" not in kwargs and "return_routed_experts" not in str(kwargs)
