"""Where a completion ends: stop token ids and stop strings, on device (early exit) and on host (the decision).

Completion policy (plugin-wide): a completion INCLUDES its stop token (EOS or a stop-token id); positions after it
are pad, so Tunix's "not pad" completion mask is 1 up to and including the stop token. A row that runs out of
budget has no stop token.

Stop *strings* end a row on device when its last tokens equal the string's own tokenization (an early-exit hint
only), and are decided on host after the loop: the row is cut at the first token whose decoded prefix contains one
(which also catches other tokenizations); tokens, log-probs and lengths are cut together.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

# In-loop stop-string early exit: up to 8 stop strings of up to 16 tokens (fixed so they never recompile).
MAX_STOP_SEQS = 8
STOP_WINDOW = 16


def stop_id_array(stop_ids: Sequence[int]) -> np.ndarray:
  """Stop ids padded to a multiple of 8 with -1 (never sampled), so adding one id does not recompile."""
  arr = np.full((max(8, -(-len(stop_ids) // 8) * 8),), -1, np.int32)
  arr[: len(stop_ids)] = stop_ids
  return arr


def stop_sequences(tokenizer: Any, strings: Sequence[str]) -> np.ndarray:
  """[MAX_STOP_SEQS, STOP_WINDOW] token ids of each stop string's own tokenization, right-aligned, -1 = wildcard,
  rows of -2 never match. Strings that do not fit are left to the host-side check (no early exit for them)."""
  seqs = np.full((MAX_STOP_SEQS, STOP_WINDOW), -2, np.int32)
  row = 0
  for text in strings:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids or len(ids) > STOP_WINDOW or row == MAX_STOP_SEQS:
      continue
    seqs[row] = -1
    seqs[row, STOP_WINDOW - len(ids) :] = ids
    row += 1
  return seqs


def empty_window(rows: int):
  """The device-side window of each row's last STOP_WINDOW tokens before any is generated."""
  return jnp.full((rows, STOP_WINDOW), -2, jnp.int32)


def stopped(tok, window, stop_ids, stop_seqs):
  """(hit, window'): a stop-id hit, or the last generated tokens spell a stop string's tokenization (in jit)."""
  window = jnp.concatenate([window[:, 1:], tok[:, None]], axis=1)
  seq_hit = jnp.all((stop_seqs[None] == -1) | (window[:, None, :] == stop_seqs[None]), axis=-1).any(-1)
  return jnp.isin(tok, stop_ids) | seq_hit, window


def stop_string_cut(tokenizer: Any, tokens: np.ndarray, stop_strings: list[str]) -> int | None:
  """Number of tokens up to and including the one whose decoded prefix first contains a stop string."""

  def contains(k: int) -> bool:
    text = tokenizer.decode(tokens[:k].tolist(), skip_special_tokens=False)
    return any(s in text for s in stop_strings)

  if len(tokens) == 0 or not contains(len(tokens)):
    return None
  lo, hi = 1, len(tokens)  # contains(hi) is true; find the smallest such k
  while lo < hi:
    mid = (lo + hi) // 2
    if contains(mid):
      hi = mid
    else:
      lo = mid + 1
  return lo


def pad_stops(pad_id: int, eos_id: int) -> list[int]:
  """The pad id as a stop token (none when it is EOS, already one), for every engine.

  The trainer reads a completion as its tokens up to the first pad (Tunix's completion mask is `ids != pad_id`, and its
  attention mask and positions follow it), so a pad token an engine samples mid-row would drop out of the trainer's
  context while the sampler attended to it: every later token would be scored by another function (measured: a
  random-init model at temperature 30 sampled the demo tokenizer's pad id, and the rest of that row disagreed by up
  to 0.36 nats, mean 3.7e-3 over the batch, tripping the parity gate). Ending the completion at a sampled pad keeps
  both sides on the same tokens; a trained model rarely samples its pad token, so this changes nothing else.
  """
  return [] if int(pad_id) == int(eos_id) else [int(pad_id)]


def completion_ends(
    tokens: np.ndarray, stop_ids: Sequence[int], eos_id: int, tokenizer: Any, stop_strings: list[str]
) -> tuple[np.ndarray, list[str]]:
  """(lengths [N], finish reasons) of host tokens [N, T]: the first stop token, then the stop-string cut."""
  n, t = tokens.shape
  stop_set = np.asarray(stop_ids, np.int32)
  lengths = np.full((n,), t, np.int32)
  reasons = ["length"] * n
  for i in range(n):
    hits = np.nonzero(np.isin(tokens[i], stop_set))[0]
    if hits.size:
      lengths[i] = hits[0] + 1
      reasons[i] = "eos" if tokens[i, hits[0]] == eos_id else "stop_token"
    if stop_strings:
      cut = stop_string_cut(tokenizer, tokens[i, : lengths[i]], stop_strings)
      if cut is not None and cut < lengths[i]:
        lengths[i], reasons[i] = cut, "stop_string"
      elif cut is not None and reasons[i] == "length":
        reasons[i] = "stop_string"
  return lengths, reasons
