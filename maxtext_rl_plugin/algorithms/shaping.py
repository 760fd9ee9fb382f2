r"""Length shaping: completion lengths, truncation by the length limit, DAPO's overlong penalty.

Overlong completions, in tokens (T = max_target_length - max_prefill_predict_length, the completion budget; n_i
counts the completion's tokens including its stop token):
    truncated_i = (n_i == T) and o_{i,T} is not a stop token          (cut by the length limit, `truncated_rows`)
  `rl.mask_truncated_completions`: m_{i,t} = 0 for every t of a truncated completion, so it contributes no loss
  (neither policy gradient nor KL, and it leaves the row/token counts of the aggregation: DAPO's overlong filtering).
  `rl.overlong_buffer_len` = L_c > 0, `rl.overlong_penalty_factor` = f: DAPO's soft overlong punishment (Yu et al.
  2025, eq. 13) is added to the reward before the advantage, with L_max = T:
    R_len(n) = 0                              n <= T - L_c
             = ((T - L_c) - n) / L_c * f      T - L_c < n <= T
             = -f                             n > T   (cannot happen here: the engine stops at T)
  computed by Tunix's own `dapo_learner.reward_shaping` applied to token sequences. Tunix applies it to the decoded
  *text* (len(completion) counts characters, against a `max_response_length` that is a token budget), so its penalty
  depends on the tokenizer's characters per token; here n is the token count the length limit is defined in.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import dapo_learner


def completion_lengths(completion_ids: Any, pad_id: int) -> np.ndarray:
  """[B] tokens of each right-padded completion (its stop token included)."""
  return (np.asarray(completion_ids) != pad_id).sum(axis=-1)


def truncated_rows(completion_ids: Any, pad_id: int, stop_ids: Any) -> np.ndarray:
  """[B] bool: completions cut by the length limit T = completion_ids.shape[-1] (all T tokens used, the last one not a
  stop token); see the module docstring."""
  ids = np.asarray(completion_ids)
  full = completion_lengths(ids, pad_id) >= ids.shape[-1]
  return full & ~np.isin(ids[:, -1], np.asarray(list(stop_ids), ids.dtype))


def overlong_penalty(token_rows: Sequence[Sequence[int]], max_len: int, buffer_len: int, factor: float) -> np.ndarray:
  """[B] float32 DAPO soft overlong punishment R_len of each completion's token count (module docstring).

  Tunix's `dapo_learner.reward_shaping` computes min(-(n - (L_max - L_c)) / L_c * f, 0) of len(completion); given
  the token sequences, n is the token count. The paper's -f floor beyond L_max is added (unreachable at T).
  """
  if not 0 < buffer_len <= max_len or factor < 0:
    raise ValueError(f"need 0 < buffer_len <= max_len and factor >= 0; got {buffer_len}, {max_len}, {factor}")
  shaped = dapo_learner.reward_shaping(
      prompts=[],
      completions=[list(t) for t in token_rows],
      mode=rl_cluster_lib.Mode.TRAIN,
      overlong_buffer={
          "overlong_buffer_length": int(buffer_len),
          "overlong_buffer_penalty": float(factor),
          "max_response_length": int(max_len),
      },
  )
  return np.maximum(np.asarray(shaped, np.float64), -float(factor)).astype(np.float32)
