r"""A reward model: a MaxText model with a scalar head, trained on preference pairs (train_rm.py) and scored as one more
reward in RL (`rl.reward_model_path`, docs/rewards.md "Reward models").

    r(x, y) = w . h_L(x + y)[last] + b

h_L is the decoder's final hidden state after MaxText's final norm (`decoder_norm`, what the LM head reads), at the
last non-pad token of the prompt x (formatted as the run formats prompts: data/prompts.build_prompt) followed by the
response y; (w, b) is a linear head emb_dim -> 1 (float32). The backbone is the run's model family, built by MaxText's
own code (run/models.build_model: `model_creation_utils.from_pretrained`, any family the trainer runs), initialised from
`load_parameters_path` or at random. That build needs MaxText's HyperParameters, so it is a builder in the run
(run/rewards.py: `build_reward_model`, `reward_model_reward`); this module takes `RewardModelSettings` and
`ModelIdentity`, read from the config once.

Hidden states: MaxText 0.2.5's `Transformer.__call__` returns the logits only (the hidden state comes back only on
vLLM's attention path or, sown, under `num_vocab_tiling > 1`); its `decoder` returns `(logits, hidden_state, caches)`,
so `last_hidden` calls the decoder as `Transformer.__call__` does for a text-only model and applies the decoder's
final norm to the hidden state. The decoder also computes the logits, which are dropped: the reward model's forward
costs one output-head matmul more than it needs (counted in the FLOPs docs/rewards.md reports).

In RL the reward model is a reward function named `reward_model` (`RewardModelReward`, appended after the reward
functions by run/rewards.py), wrapped like every reward (rewards/loader.RewardFn:
reward_call_timeout_seconds, one finite number per completion) and weighted by
`rl.reward_model_weight`; it scores `rl.reward_model_batch_size` texts per forward, on the trainer's devices. A
checkpoint whose head reads another hidden size, or that was trained with another tokenizer or vocabulary, is refused
in one line before any step (`check_meta`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
from maxtext.common.common_types import MODEL_MODE_TRAIN
import numpy as np
import orbax.checkpoint as ocp

from maxtext_rl_plugin import checkpointing
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.errors import ConfigError

KIND = "maxtext_rl_plugin reward model"
ITEMS = ("params", "meta")
_KEY = "rl.reward_model_path"


def last_hidden(transformer: Any, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """[B, emb] the final-norm hidden state of each row's last token (`lengths - 1`), rows right-padded (module doc)."""
  b, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
  segments = (positions < lengths[:, None]).astype(jnp.int32)  # pads attend to nothing and are never read
  out = transformer.decoder(
      shared_embedding=transformer.token_embedder,
      decoder_input_tokens=tokens,
      decoder_positions=positions,
      decoder_segment_ids=segments,
      deterministic=True,
      model_mode=MODEL_MODE_TRAIN,
  )
  hidden = transformer.decoder.decoder_norm(out[1])
  return hidden[jnp.arange(b), jnp.maximum(lengths - 1, 0)]


class RewardModel(nnx.Module):
  """A MaxText `Transformer` with a linear scalar head on its last token's hidden state (module docstring)."""

  def __init__(self, transformer: Any, emb_dim: int, rngs: nnx.Rngs):
    self.transformer = transformer
    self.head = nnx.Linear(
        emb_dim, 1, kernel_init=nnx.initializers.normal(1.0 / np.sqrt(emb_dim)), param_dtype=jnp.float32, rngs=rngs
    )

  def __call__(self, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    h = last_hidden(self.transformer, tokens, lengths).astype(jnp.float32)
    return self.head(h)[:, 0]


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
  """The run's model keys a reward model checkpoint records and must agree on with the run that scores with it, from
  the config once (`of`)."""

  model_name: str
  emb_dim: int  # the head's input size
  num_decoder_layers: int
  vocab_size: int
  tokenizer: str  # config.files.tokenizer_identity: a local tokenizer's content, else the hub id
  use_chat_template: bool

  @classmethod
  def of(cls, config: Any) -> "ModelIdentity":
    return cls(
        str(config.model_name),
        int(config.emb_dim),
        int(config.num_decoder_layers),
        int(config.vocab_size),
        config_files.tokenizer_identity(config.tokenizer_path),
        bool(config.use_chat_template),
    )


@dataclasses.dataclass(frozen=True)
class RewardModelSettings:
  """The reward model as a reward in RL (`rl.reward_model_*`), from the config once (`of`, only when
  `rl.reward_model_path` is set)."""

  path: str  # rl.reward_model_path
  batch_size: int  # rl.reward_model_batch_size: texts per forward
  max_len: int  # max_target_length: a longer text keeps its last tokens (`encode`)
  timeout_s: float  # reward_call_timeout_seconds, as for every reward function
  model: ModelIdentity  # what the checkpoint must agree on (`check_meta`)

  @classmethod
  def of(cls, config: Any) -> "RewardModelSettings":
    return cls(
        str(config.rl.reward_model_path),
        int(config.rl.reward_model_batch_size),
        int(config.max_target_length),
        float(config.reward_call_timeout_seconds),
        ModelIdentity.of(config),
    )


def meta_of(model: ModelIdentity, tokenizer: Any) -> dict[str, Any]:
  """What a checkpoint must agree on with the run that scores with it (saved as the `meta` item)."""
  return {
      "kind": KIND,
      "model_name": model.model_name,
      "head_input": model.emb_dim,
      "num_decoder_layers": model.num_decoder_layers,
      "vocab_size": model.vocab_size,
      "tokenizer": model.tokenizer,
      "tokenizer_size": len(tokenizer),
      "use_chat_template": model.use_chat_template,
  }


def check_meta(path: str, saved: dict[str, Any], expected: dict[str, Any]) -> None:
  """A checkpoint that cannot score this run's texts is one line: its head size, vocabulary or tokenizer differ."""
  if saved.get("kind") != KIND:
    raise ConfigError(f"invalid value for '{_KEY}'='{path}': not a reward model checkpoint (train one with train_rm)")
  for key, what in (
      ("head_input", "its head reads hidden states of size"),
      ("num_decoder_layers", "its backbone has decoder layers:"),
      ("vocab_size", "it was trained with vocab_size"),
      ("tokenizer", "it was trained with the tokenizer"),
      ("tokenizer_size", "its tokenizer has token ids:"),
  ):
    if saved.get(key) != expected[key]:
      raise ConfigError(
          f"invalid value for '{_KEY}'='{path}': {what} {saved.get(key)!r}, the run's model {expected[key]!r} (a reward "
          "model is built like the run's model: same family, size, vocabulary and tokenizer)"
      )


def checkpoint_dir(path: str) -> str:
  """The checkpoints directory of a reward model run (`<run>` or `<run>/checkpoints`)."""
  sub = os.path.join(path, "checkpoints")
  return sub if storage.isdir(sub) else path


def save(directory: str, step: int, rm: RewardModel, meta: dict[str, Any], store: checkpointing.Storage) -> None:
  """Orbax checkpoint `step` of the reward model's parameters and its meta (checkpointing's format; `store`: the run's
  storage keys, `checkpointing.Storage.from_config`)."""
  manager = checkpointing.open_manager(directory, ITEMS, storage=store)
  checkpointing.save_items(manager, step, {"params": nnx.state(rm, nnx.Param).to_pure_dict()}, meta, storage=store)
  manager.close()


def read_meta(path: str) -> tuple[Any, int, dict[str, Any]]:
  """(Orbax manager, newest step, its meta) of the reward model checkpoints under `path`; one line when there are none."""
  directory = checkpoint_dir(path)
  if not storage.isdir(directory):
    raise ConfigError(f"invalid value for '{_KEY}'='{path}': no such directory")
  manager = checkpointing.open_manager(directory, ITEMS, storage=checkpointing.Storage(), create=False)
  step = manager.latest_step()
  if step is None:
    raise ConfigError(f"invalid value for '{_KEY}'='{path}': no reward model checkpoint in it (train one with train_rm)")
  restored = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
  return manager, step, dict(restored.meta)


def restore(manager: Any, step: int, rm: RewardModel, mesh: Any) -> None:
  """Load checkpoint `step` (read_meta's, checked by check_meta) into `rm`."""
  target = nnx.state(rm, nnx.Param).to_pure_dict()
  restored, _ = checkpointing.restore_items(manager, step, {"params": target}, mesh)
  state = nnx.state(rm, nnx.Param)
  state.replace_by_pure_dict(restored["params"])
  nnx.update(rm, state)


def encode(tokenizer: Any, texts: Sequence[str], max_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """([B, L] right-padded ids, [B] lengths) of `texts` with the tokenizer's own defaults (as the run encodes prompts);
  a text longer than `max_len` keeps its last `max_len` tokens (the end is what the head reads). L is the longest row
  rounded up to a multiple of 16, so a batch compiles for a few widths only."""
  ids = [tokenizer.encode(t)[-max_len:] or [pad_id] for t in texts]
  width = min(max_len, -(-max(len(i) for i in ids) // 16) * 16)
  out = np.full((len(ids), width), pad_id, np.int32)
  for r, row in enumerate(ids):
    out[r, : len(row)] = row
  return out, np.asarray([len(i) for i in ids], np.int32)


class Scorer:
  """Batched scores of texts on the reward model's mesh (`batch_size` rows per forward; the last batch padded to it,
  so one shape compiles per width; a text keeps its last `max_len` tokens)."""

  def __init__(self, rm: RewardModel, mesh: Any, tokenizer: Any, batch_size: int, max_len: int):
    self.rm, self.mesh, self.tokenizer = rm, mesh, tokenizer
    self.batch_size, self.max_len = int(batch_size), int(max_len)
    self.pad_id = int(tokenizer.pad_token_id)
    self._fn = nnx.jit(lambda m, t, n: m(t, n))

  def __call__(self, texts: Sequence[str]) -> np.ndarray:
    out = []
    with self.mesh:
      for i in range(0, len(texts), self.batch_size):
        chunk = list(texts[i : i + self.batch_size])
        n = len(chunk)
        chunk += [chunk[-1]] * (self.batch_size - n)
        tokens, lengths = encode(self.tokenizer, chunk, self.max_len, self.pad_id)
        out.append(np.asarray(self._fn(self.rm, jnp.asarray(tokens), jnp.asarray(lengths)), np.float64)[:n])
    return np.concatenate(out) if out else np.zeros(0)


class RewardModelReward:
  """The reward model as a reward function (Tunix's signature): the score of prompt + completion."""

  __name__ = "reward_model"

  def __init__(self, scorer: Scorer):
    self.scorer = scorer

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **kwargs: Any) -> list[float]:
    del kwargs
    return [float(x) for x in self.scorer([p + c for p, c in zip(prompts, completions)])]
