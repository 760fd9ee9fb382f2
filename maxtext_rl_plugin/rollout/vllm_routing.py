"""The experts vLLM-TPU routed each token to, laid out like the trainer's input (router replay on the vLLM route).

Capture is vLLM's and tpu-inference's: `enable_return_routed_experts` turns on vLLM's auxiliary-output connector, and
tpu-inference 0.32.0's runner (`runner/routed_experts.py`) keeps each step's routing per physical KV-cache slot, so a
prefix-cache hit or a chunked prefill still yields every position's experts. The model must report them: MaxText's
decoder inside vLLM (`MaxTextForCausalLM`) returns `expert_indices` when its config has `return_routed_experts` (its
fused-MoE path records `selected_experts`, the top-k of the router logits, layers in path order: the order moe.py's
`routing` uses). tpu-inference's native JAX classes report none, so only that route captures.

What comes back per request is `CompletionOutput.routed_experts`, [positions, layers, k] for sequence positions
0 .. prompt + completion - 2 (vLLM's `take_output` stops at `num_tokens - 1`: the last sampled token is never fed
back). `request_layout` checks that count, so an off-by-one in either library is an error here rather than a silently
shifted replay, and places the rows as moe.py lays routing out: [P + T, layers, k], prompt right-aligned, completion
left-aligned, UNSET (-1) elsewhere, including the completion's last token.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np

from maxtext_rl_plugin import moe


def capture_kwargs(engine_kwargs: dict) -> dict:
  """The adapter route's `vllm.LLM` kwargs with routing capture on: vLLM's `enable_return_routed_experts` and the
  adapter's `maxtext_config.return_routed_experts` (MaxText's key, with its meaning: record, return `expert_indices`)."""
  out = dict(engine_kwargs)
  out["enable_return_routed_experts"] = True
  additional = copy.deepcopy(dict(out.get("additional_config") or {}))
  maxtext_config = dict(additional.get("maxtext_config") or {})
  maxtext_config["return_routed_experts"] = True
  additional["maxtext_config"] = maxtext_config
  out["additional_config"] = additional
  return out


def request_layout(
    routed_experts: Any, prompt_len: int, completion_len: int, prompt_width: int, completion_width: int
) -> np.ndarray:
  """One request's `routed_experts` as [prompt_width + completion_width, layers, k] int32 (module docstring)."""
  if routed_experts is None:
    raise RuntimeError(
        "vLLM returned no routed experts for a request; routing capture needs vLLM's enable_return_routed_experts "
        "and MaxText's return_routed_experts in the adapter's maxtext_config"
    )
  rows = np.asarray(routed_experts)
  want = prompt_len + completion_len - 1
  if rows.ndim != 3 or rows.shape[0] != want:
    raise RuntimeError(
        f"vLLM returned routing of shape {rows.shape} for a request of {prompt_len} prompt + {completion_len} "
        f"completion tokens; expected [{want}, layers, k] (positions 0 .. prompt + completion - 2)"
    )
  rows = rows.astype(np.int32)
  completion = np.full((completion_len, *rows.shape[1:]), moe.UNSET, np.int32)
  completion[: completion_len - 1] = rows[prompt_len:]
  return moe.pad_layout(rows[None, :prompt_len], completion[None], prompt_width, completion_width)[0]


def batch_layout(
    outputs: Sequence[Any], prompt_lens: Sequence[int], prompt_width: int, completion_width: int
) -> np.ndarray:
  """[rows, P + T, layers, k] of vLLM `RequestOutput`s (first completion each), in the order of `prompt_lens`."""
  rows = []
  for out, p in zip(outputs, prompt_lens, strict=True):
    comp = out.outputs[0]
    n = len(comp.token_ids)
    rows.append(request_layout(getattr(comp, "routed_experts", None), p, n, prompt_width, completion_width))
  return np.stack(rows)
