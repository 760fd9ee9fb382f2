"""The engine contract: what the plugin's RL loop needs from a rollout engine beyond Tunix's `BaseRollout`.

Tunix's `BaseRollout` (generate, get_per_token_logps, update_params, pad_id, eos_id, model) is what `RLCluster`
calls. The loop (run/, agentic/, resharding/) asks an engine for more, and `RolloutEngine` declares it here once;
each engine (rollout/embedded.py, rollout/vllm.py, or a third party's) subclasses it. Which optional parts an engine
honours is its `EngineSpec.capabilities` (rollout/engines.py), readable before the engine is imported; callers read
those flags instead of probing the object:

| member | flag | who asks |
| --- | --- | --- |
| `generate_turn` | `multi_turn` | agentic/episode.py: one assistant turn of multi-turn episodes |
| `take_routing` | `routing_capture` | run/experience.py: MoE routing for rl.router_replay and the mismatch metrics |
| `prompt_offset` | `row_keys` | run/experience.py: per-row sampling keys on per-host and disaggregated samplers |
| `snapshot_weights`, `release_snapshot` | `snapshots` | run/loop.py, run/step.py: rollouts ahead of a colocated trainer |
| `per_host` | `per_host` | run/experience.py: this instance samples only its host's share of a batch |
| `weight_sync` | `weight_sync == "engine"` | resharding/sync.py hands the engine the plugin's guarded sync |
| `ensure_available` | | run/build.py: a missing optional dependency refused before any model is built |

An engine is built by Tunix as `cls(rollout_actor=, tokenizer=, mesh=, rollout_config=)`; the plugin binds the keyword
arguments its spec's `bind` makes from the sampler's config (its settings; `config=` the config whole when the spec
names no `bind`) with `functools.partial` (run/engine.rollout_engine_factory). Its config checks are its spec's
(rollout/engines.py), run by config/ through the entry point before the engine is imported.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Optional, Sequence

import jax
import numpy as np
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin.rollout import engines

# One row of `generate_turn`: (completion token ids, their log-probs, finish reason).
TurnRow = tuple[np.ndarray, np.ndarray, str]
FINISH_REASONS = ("eos", "stop_token", "stop_string", "length")


class RolloutEngine(base_rollout.BaseRollout, abc.ABC):
  """A Tunix `BaseRollout` with the plugin's additions (the module docstring's table)."""

  # The engine's declaration: the entry point's EngineSpec (capabilities, config checks).
  spec: ClassVar[engines.EngineSpec]
  # True when this instance samples only its own host's prompts of a batch (one engine per host in a multi-controller
  # run); the rows are then gathered across processes (run/experience.py). Set by the engine at construction.
  per_host: bool = False
  # With `capabilities.row_keys`: the global index of the first prompt of the next `generate` call (None: one key per
  # call for the whole batch). Set by run/experience.generate around a call; the engine advances it past each call.
  prompt_offset: Optional[int] = None
  # With `capabilities.weight_sync == "engine"`: the plugin's `resharding.sync.WeightSync`, set by
  # `resharding.sync.attach_to_rl_cluster` on disaggregated runs and run inside the engine's `update_params`.
  weight_sync: Any = None

  @property
  def capabilities(self) -> engines.Capabilities:
    return self.spec.capabilities

  @classmethod
  def ensure_available(cls) -> None:
    """Raise `errors.MissingExtraError` (one line) when the engine's optional dependencies are missing; called before
    any model is built. The default needs nothing beyond the plugin's own dependencies."""

  @abc.abstractmethod
  def generate_turn(
      self,
      contexts: Sequence[Sequence[int]],
      *,
      num_generations: int,
      max_new_tokens: int,
      rollout_config: base_rollout.RolloutConfig,
      rng: jax.Array,
      stop_strings: Sequence[str] = (),
  ) -> list[TurnRow]:
    """One assistant turn of multi-turn episodes (agentic/episode.py): a `TurnRow` per row, `num_generations`
    consecutive rows per context.

    `contexts` are token ids: the prompts on the first turn (G rows each), then each episode's whole transcript
    (prompt + its turns + the tool's answers) with G = 1. `max_new_tokens` bounds this turn; `rollout_config` gives
    the sampling knobs (temperature, top-k/p) and `eos_tokens`; `rng` seeds the turn where the engine draws its own
    keys; `stop_strings` (the tool call's closing tag) end a completion besides the config's stops and stay in its
    tokens. The finish reason is one of `FINISH_REASONS`: "eos" (the tokenizer's EOS), "stop_token" (another stop
    id), "stop_string", "length" (`max_new_tokens` reached).
    """

  def take_routing(self) -> np.ndarray | None:
    """The MoE routing of every `generate` call this thread made since the last take, in call order,
    [rows, max_prompt_length + T, layers, k] laid out like the trainer's input (moe.py), and clears it; None on a
    dense model or when the engine captures none. Engines with `capabilities.routing_capture` override it."""
    return None

  def snapshot_weights(self) -> None:
    """From now on sample with the weights as they are now, even while the trainer updates them, until
    `release_snapshot` (engines with `capabilities.snapshots`)."""
    raise NotImplementedError(f"{type(self).__name__} cannot pin a weight version (capabilities.snapshots is False)")

  def release_snapshot(self) -> None:
    """Back to sampling with the live weights."""
    raise NotImplementedError(f"{type(self).__name__} cannot pin a weight version (capabilities.snapshots is False)")
