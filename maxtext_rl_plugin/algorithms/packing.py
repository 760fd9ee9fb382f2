r"""`max_seq_token_per_tpu`: the trainer's forwards on packed rows, the loss on the batch layout.

Without packing every sequence is one row of P + T tokens (prompt left-padded to P, completion right-padded to T), so
the reference, old-policy and update forwards pay for every pad. With `max_seq_token_per_tpu` = L > 0 each forward
packs the batch's sequences into rows of L tokens, as MaxText packs pre-training rows (`packing: true`): a sequence
keeps its own `decoder_segment_ids` (1, 2, ... within a row; 0 for the row's padding), its positions restart at 0,
and MaxText's attention masks across segments. The per-token log-probs of the completion tokens are then gathered
back to the batch layout [B, T], so advantages, KL, clipping, importance weights and every `loss_agg_mode` see the
values the padded forward gives, to float round-off (the same products summed over other shapes).

A sequence is its non-pad tokens in order: the prompt's (left padding dropped) and the completion's up to its first
pad, which both engines end a completion at (rollout/stops.pad_stops). That is exactly what the padded forward
computes with (Tunix's `process_ids`: positions are the cumulative count of non-pad tokens, attention skips pads).
A multi-turn episode's completion is one such sequence: its environment tokens are ordinary tokens (context, outside
the loss mask) with pad and EOS removed (agentic/episode.py), and each assistant turn ends at a sampled pad.

How rows are filled: first-fit decreasing (longest sequence first, ties by row index; each into the first row with
room, else a new row), deterministic for a given batch. FFD uses at most 11/9 OPT + 6/9 rows (Dosa 2007). Tunix
0.1.7's `utils.pack_sequences` instead streams next-fit, skips a longer sequence with a warning, and aggregates the loss
over packed rows (so `sequence-mean-token-mean` averages per pack); neither is what a user of the key expects.

Shapes: the number of packed rows is rounded up to a multiple of `rows_multiple` (the data-parallel ways and the
micro-batches of an update), and each distinct count compiles once; a batch of N sequences never needs more than N
rows when L >= P + T, which config validation requires (a longer sequence could not fit a row).

MoE models (moe.py): the sampler's routing [B, P + T, layers, k] is packed with its tokens (`Packed.routing`, UNSET in
the row padding), so `rl.router_replay` forces each packed token's experts exactly as the padded forward forces that
token's. MaxText's load-balancing term is computed on the rows the forward runs, padded or packed, as MaxText's own
packed pre-training computes it: it counts every slot of those rows, so its value differs between the two layouts by
what the pad slots contribute (the policy loss does not). The trainer's own routing is not unpacked: a packed run logs
no `moe/routing_mismatch_fraction` or trainer-side expert load.

Micro-batches: an update's example holds its micro-batches interleaved for MaxText's strided split
(`accumulation.split_micro_batches`: micro-batch i = rows i, i + k, ...); `pack_example` packs each micro-batch's
sequences into rows laid out the same way, and its gather indices point into that micro-batch's own packed rows, so
the split hands every micro-batch its sequences and their rows together.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import common as tunix_common

from maxtext_rl_plugin.algorithms import loss as loss_lib
from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import moe


def sequence_lengths(prompt_ids: np.ndarray, completion_ids: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(non-pad prompt tokens, completion tokens before the first pad) of each row."""
  prompt_len = (np.asarray(prompt_ids) != pad_id).sum(axis=1)
  is_pad = np.asarray(completion_ids) == pad_id
  width = is_pad.shape[1]
  completion_len = np.where(is_pad.any(axis=1), is_pad.argmax(axis=1), width)
  return prompt_len.astype(np.int64), completion_len.astype(np.int64)


def first_fit_decreasing(lengths: np.ndarray, row_tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
  """(row, offset) of each sequence and the number of rows: FFD into rows of `row_tokens` tokens."""
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and int(lengths.max()) > row_tokens:
    i = int(lengths.argmax())
    raise ValueError(
        f"sequence {i} has {int(lengths[i])} tokens, more than max_seq_token_per_tpu={row_tokens} (one packed row)"
    )
  row = np.zeros(lengths.size, np.int64)
  offset = np.zeros(lengths.size, np.int64)
  used: list[int] = []
  for i in np.argsort(-lengths, kind="stable"):
    n = int(lengths[i])
    for r, u in enumerate(used):
      if u + n <= row_tokens:
        row[i], offset[i] = r, u
        used[r] += n
        break
    else:
      row[i], offset[i] = len(used), 0
      used.append(n)
  return row, offset, len(used)


@dataclasses.dataclass(frozen=True)
class Packed:
  """A batch's packed forward input and where each completion token's log-prob lands (host arrays).

  tokens, positions, segments: [R, L]. src_row, src_col: [B, T] indices into the packed next-token log-probs
  [R, L - 1] (column j scores token j + 1 from the logits at j); valid: [B, T], the completion tokens that have one.
  row, offset: [B], where each sequence starts. routing: [R, L, layers, k], the packed tokens' experts (MoE rows
  packed with their routing; UNSET in the row padding), else None.
  """

  tokens: np.ndarray
  positions: np.ndarray
  segments: np.ndarray
  src_row: np.ndarray
  src_col: np.ndarray
  valid: np.ndarray
  row: np.ndarray
  offset: np.ndarray
  routing: np.ndarray | None = None


def pack(
    prompt_ids: np.ndarray,
    completion_ids: np.ndarray,
    pad_id: int,
    row_tokens: int,
    rows_multiple: int = 1,
    routing: np.ndarray | None = None,
) -> Packed:
  """Pack the rows of a left-padded prompt / right-padded completion batch into rows of `row_tokens` tokens;
  `routing` [B, P + T, layers, k] (an MoE batch's, laid out like its tokens) is packed with them."""
  prompt_ids, completion_ids = np.asarray(prompt_ids), np.asarray(completion_ids)
  b, t = completion_ids.shape
  p_len, c_len = sequence_lengths(prompt_ids, completion_ids, pad_id)
  row, offset, n_rows = first_fit_decreasing(p_len + c_len, row_tokens)
  n_rows = max(rows_multiple, -(-n_rows // rows_multiple) * rows_multiple)
  tokens = np.full((n_rows, row_tokens), pad_id, np.int32)
  positions = np.zeros((n_rows, row_tokens), np.int32)
  segments = np.zeros((n_rows, row_tokens), np.int32)
  src_row = np.zeros((b, t), np.int32)
  src_col = np.zeros((b, t), np.int32)
  valid = np.zeros((b, t), bool)
  segment_in_row = np.zeros(n_rows, np.int32)
  packed_routing = None
  if routing is not None:
    routing = np.asarray(routing)
    packed_routing = np.full((n_rows, row_tokens) + routing.shape[2:], moe.UNSET, np.int32)
  for i in range(b):
    prompt = prompt_ids[i][prompt_ids[i] != pad_id]
    seq = np.concatenate([prompt, completion_ids[i, : c_len[i]]])
    r, o, n = int(row[i]), int(offset[i]), seq.size
    segment_in_row[r] += 1
    tokens[r, o : o + n] = seq
    positions[r, o : o + n] = np.arange(n)
    segments[r, o : o + n] = segment_in_row[r]
    if packed_routing is not None:  # the same columns the tokens came from: the prompt's real ones, then the completion
      cols = np.concatenate([np.flatnonzero(prompt_ids[i] != pad_id), prompt_ids.shape[1] + np.arange(int(c_len[i]))])
      packed_routing[r, o : o + n] = routing[i, cols]
    # completion token k sits at o + p + k; its log-prob is column o + p + k - 1 of the next-token log-probs
    k = np.arange(int(c_len[i]))
    src_row[i, k] = r
    src_col[i, k] = o + int(p_len[i]) + k - 1
    valid[i, k] = p_len[i] > 0  # a completion with no prompt before it has no logits for its first token
  return Packed(tokens, positions, segments, src_row, src_col, valid, row, offset, packed_routing)


def packed_forward(
    model: Any,
    tokens: jax.Array,
    positions: jax.Array,
    segments: jax.Array,
    src_row: jax.Array,
    src_col: jax.Array,
    valid: jax.Array,
    temperature: float = 1.0,
    with_entropy: bool = False,
    forced: jax.Array | None = None,
    with_lb: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """([B, T] log-probs of the completion tokens (0 where not `valid`), their entropy, the load-balancing term) from one
  forward of the packed rows. The entropy of each token's next-token distribution (no gradient) with `with_entropy`,
  else None; `forced`: the packed routing to replay (`Packed.routing`, rl.router_replay); MaxText's load-balancing
  term (moe.lb_loss, with the model's own MoE settings) with `with_lb` when the model sows one, else None.

  Replay and the load-balancing term run on a model merged for this one forward, as moe.forward_logps does: forcing
  changes the MoE modules' classes and both leave intermediates, which must not land on the trainer's model."""
  settings = moe.MoeSettings.of_model(model)
  kwargs = {}
  if forced is not None or with_lb:
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, state)
    if forced is not None and settings is not None and settings.replay_native:
      kwargs["forced_routed_experts"] = forced
    elif forced is not None:
      moe.set_replay(model, forced)
  logits, _ = model(tokens, positions, None, None, segment_ids=segments, **kwargs)
  lb = moe.lb_loss(model, settings) if with_lb and settings is not None else None
  logits = logits[:, :-1, :]
  if temperature not in (0.0, 1.0):
    logits = logits / temperature
  logps = tunix_common.selective_log_softmax(logits, tokens[:, 1:])
  out = jnp.where(valid, logps[src_row, src_col], 0.0)
  entropy = None
  if with_entropy:
    entropy = jnp.where(valid, loss_lib.token_entropy(logits)[src_row, src_col], 0.0)
  return out, entropy, lb


@flax.struct.dataclass(frozen=True)
class PackedTrainExample(moe.RoutedTrainExample):
  """Tunix's `TrainExample` (batch layout [B, ...]) with its packed forward input ([R, L]) and gather indices ([B, T]).

  `prompt_ids` / `completion_ids` stay, for the metrics that read them; the loss's forward reads the packed fields.
  An MoE batch's routing travels packed (`packed_routing`, [R, L, layers, k]); its batch-layout `routed_experts` is
  dropped, so the update holds one copy.
  """

  packed_tokens: jax.Array | None = None
  packed_positions: jax.Array | None = None
  packed_segments: jax.Array | None = None
  src_row: jax.Array | None = None
  src_col: jax.Array | None = None
  src_valid: jax.Array | None = None
  packed_routing: jax.Array | None = None


def _packed_fields(example: Any, pad_id: int, row_tokens: int, steps: int, rows_multiple: int) -> dict[str, np.ndarray]:
  """The packed fields of `example` as host arrays, micro-batch i's rows at i, i + steps, ... (see `pack_example`)."""
  prompt = distributed.to_host(example.prompt_ids)
  completion = distributed.to_host(example.completion_ids)
  routing = getattr(example, "routed_experts", None)
  routing = None if routing is None else distributed.to_host(routing)
  groups = [
      pack(
          prompt[i::steps],
          completion[i::steps],
          pad_id,
          row_tokens,
          rows_multiple,
          None if routing is None else routing[i::steps],
      )
      for i in range(steps)
  ]
  n_rows = max(g.tokens.shape[0] for g in groups)

  def rows(x: np.ndarray, fill: int) -> np.ndarray:
    return np.concatenate([x, np.full((n_rows - x.shape[0],) + x.shape[1:], fill, x.dtype)])

  def interleave(parts: list[np.ndarray]) -> np.ndarray:
    stacked = np.stack(parts, axis=1)  # [rows per micro-batch, steps, ...]
    return stacked.reshape((-1,) + stacked.shape[2:])

  fields = {
      "packed_tokens": interleave([rows(g.tokens, pad_id) for g in groups]),
      "packed_positions": interleave([rows(g.positions, 0) for g in groups]),
      "packed_segments": interleave([rows(g.segments, 0) for g in groups]),
      "src_row": interleave([g.src_row for g in groups]),
      "src_col": interleave([g.src_col for g in groups]),
      "src_valid": interleave([g.valid for g in groups]),
  }
  if routing is not None:
    fields["packed_routing"] = interleave([rows(g.routing, moe.UNSET) for g in groups])
  return fields


def _with_fields(example: Any, packed: dict[str, Any]) -> PackedTrainExample:
  fields = {f.name: getattr(example, f.name) for f in dataclasses.fields(example)}
  fields["routed_experts"] = None  # packed_routing replaces it
  return PackedTrainExample(**fields, **packed)


def pack_example(
    example: Any,
    pad_id: int,
    row_tokens: int,
    steps: int,
    put: Callable[[np.ndarray], Any] = np.asarray,
    rows_multiple: int = 1,
) -> PackedTrainExample:
  """`example` (rows interleaved for `steps` micro-batches, `updates.update_batches`) with packed fields laid out the
  same way: micro-batch i's packed rows at i, i + steps, ... and its indices local to them. `put` places each new
  field (the trainer's rows sharding, run/logps.put_rows); every process packs the same host batch alike."""
  packed = _packed_fields(example, pad_id, row_tokens, steps, rows_multiple)
  return _with_fields(example, {k: put(v) for k, v in packed.items()})


def pack_update_batches(
    batches: list[Any],
    pad_id: int,
    row_tokens: int,
    steps: int,
    put: Callable[[np.ndarray], Any],
    iterations: int = 1,
) -> tuple[list[PackedTrainExample], dict[str, float]]:
  """An RL step's update batches (`updates.update_batches`) packed, and the step's `metrics`.

  With rl.num_iterations = mu > 1 the same mini-batches repeat in every iteration, so each distinct one is packed and
  placed once and reused mu times; the fill figures come from the host arrays it was packed from (no device read)."""
  per_iteration, rest = divmod(len(batches), iterations)
  if rest:
    raise ValueError(f"{len(batches)} update batches do not split into {iterations} iterations")
  distinct = batches[:per_iteration]
  host = [_packed_fields(b, pad_id, row_tokens, steps, 1) for b in distinct]
  packed = [_with_fields(b, {k: put(v) for k, v in h.items()}) for b, h in zip(distinct, host, strict=True)]
  return packed * iterations, metrics(distinct, [h["packed_segments"] for h in host])


_packed_forward_jit = nnx.jit(packed_forward, static_argnames=("temperature", "with_entropy"))


def batch_logps(
    model: Any,
    prompt_ids: Any,
    completion_ids: Any,
    pad_id: int,
    row_tokens: int,
    temperature: float,
    put: Callable[[np.ndarray], Any],
    micro_batch_size: int | None = None,
    forced: Any = None,
) -> jax.Array:
  """[B, T] completion log-probs of `model` (no gradient), each micro-batch of rows packed into rows of `row_tokens`:
  the reference and old-policy forwards of a packed run. `put` places host arrays as the trainer's rows; `forced`
  [B, P + T, layers, k] is the routing to replay (rl.router_replay), packed with its rows."""
  prompt, completion = distributed.to_host(prompt_ids), distributed.to_host(completion_ids)
  routing = None if forced is None else distributed.to_host(forced)
  rows = prompt.shape[0]
  step = micro_batch_size or rows
  outs = []
  for s in range(0, rows, step):
    pk = pack(
        prompt[s : s + step],
        completion[s : s + step],
        pad_id,
        row_tokens,
        routing=None if routing is None else routing[s : s + step],
    )
    lp, _, _ = _packed_forward_jit(
        model,
        *(put(x) for x in (pk.tokens, pk.positions, pk.segments, pk.src_row, pk.src_col, pk.valid)),
        temperature=float(temperature),
        forced=None if pk.routing is None else put(pk.routing),
    )
    outs.append(jax.lax.stop_gradient(lp))
  return jnp.concatenate(outs, axis=0)


def metrics(examples: list[Any], segments: list[np.ndarray]) -> dict[str, float]:
  """What packing bought on a step's updates: packed rows per update, and the share of the forward's token slots that
  hold a sequence's token, packed (`packing/fill`) and as padded rows would hold them (`packing/padded_fill`).
  `segments[i]` is `examples[i]`'s packed segment ids, as the host packed them."""
  rows = real = padded = slots = 0
  for ex, seg in zip(examples, segments, strict=True):
    rows += seg.shape[0]
    slots += seg.size
    real += int((seg > 0).sum())
    padded += int(ex.prompt_ids.shape[0]) * (int(ex.prompt_ids.shape[1]) + int(ex.completion_ids.shape[1]))
  return {
      "packing/rows": rows / max(len(examples), 1),
      "packing/fill": real / max(slots, 1),
      "packing/padded_fill": real / max(padded, 1),
  }
