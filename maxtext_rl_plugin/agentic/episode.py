r"""Multi-turn episodes: the policy's turns, the tools' answers in between, and the per-token loss mask.

An episode starts from a prompt. The policy generates one assistant turn until it closes a tool call (the parser's
closing tag is a stop string of the turn) or ends its answer (EOS / a stop token / a stop string). A closed call is
parsed (`parse.py`) and run (`tools.py`); the result, or an error observation, is appended as an environment turn
and the policy continues from the whole transcript, up to `rl.agentic_max_turns` assistant turns and a total of
`rl.agentic_max_tokens` completion tokens (assistant + environment), each assistant turn at most
`rl.agentic_turn_tokens` tokens.

The episode's completion is what the trainer sees after the prompt:

    completion = a_1 e_1 a_2 e_2 ... a_k      (a: assistant tokens, e: environment tokens)
    loss_mask  = 1..1 0..0 1..1 0..0 ... 1..1

The environment's tokens are in the context of every later token (the trainer's forward runs over the whole
completion) but carry no loss: `experience.score` ANDs `loss_mask` into the `TrainExample`'s completion mask, which
is the mask of the policy loss, its KL term and aggregation, the importance weights and the agreement metrics
(their behaviour log-prob is 0 here). Rewards score the assistant's text only (`Episode.text`), so a number the
tool printed is never taken for the model's answer.

Why not Tunix's agentic loop (`AgenticGRPOLearner` + `ToolAgent` + `ToolEnvironment`): it is a second trainer (its
own train loop, async queue, chat-message trajectories and re-tokenisation) beside the plugin's, which owns resume,
eval, metrics, async rollouts and multi-process placement. The episode here is token-level (the transcript is the
token ids the policy sampled plus the environment's, never re-tokenised text, so the trainer's log-probs are of
exactly the sampled tokens), and reuses Tunix's public tool-call parser, `ToolManager` and `CalculatorTool`.

Engines implement one call, `generate_turn(contexts, num_generations, max_new_tokens, rollout_config, rng,
stop_strings)` -> [(tokens, logps, finish_reason)] per row: the embedded engine (rollout/embedded.py) and the vLLM
adapter (rollout/vllm.py). `max_new_tokens` is always `agentic_turn_tokens` (rows are cut to their remaining budget
on host), so a run compiles one program per (batch, context) bucket, not one per remaining budget.

Across JAX processes (multi-controller) there are two layouts. With a per-host sampler (a disaggregated split per
process, or vLLM's engine per host) each process runs the episodes of its own prompt groups (`generate(groups=)`),
tools included, and the run gathers the rows with their loss masks and counters (`counters` / `from_counters`,
run/experience.py), so every process holds every episode and the metrics are the global batch's; the rollout
micro-batches keep their global index and key, so an episode samples what one process would have sampled. With a
sampler spanning the processes (colocated) every process runs every turn program together; each process then runs the
tool calls of its own rows (row r: process r mod P) and the observations are gathered every turn (`shared_observe`),
so every process continues from the same transcripts (a tool that timed out on one host alone would otherwise
split them, and the next turn's programs with them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.agentic import parse
from maxtext_rl_plugin.agentic import tools as tools_lib
from maxtext_rl_plugin.rollout import bucketing

# An assistant turn's end: "call" (a closed tool call), "answer" (EOS / stop token / another stop string), "length".
Turn = tuple[np.ndarray, np.ndarray, str]
TurnFn = Callable[[list[list[int]], int, int, int], list[Turn]]  # (contexts, generations, max_new, turn) -> rows
# The observations of one turn's tool calls, given as (row, parsed call) in row order.
ObserveFn = Callable[[list[tuple[int, Any]]], list[tools_lib.Observation]]
_FINISH = ("", "answer", "max_turns", "length")  # Episode.finish as a number (counters)


@dataclasses.dataclass(frozen=True)
class Limits:
  """`rl.agentic_*` limits of one episode."""

  max_turns: int
  turn_tokens: int
  total_tokens: int


@dataclasses.dataclass
class Episode:
  """One row of the rollout batch: the completion after the prompt and what happened in it."""

  prompt: list[int]
  tokens: list[int] = dataclasses.field(default_factory=list)
  logps: list[float] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)  # 1: the policy's token, 0: the environment's
  text: str = ""  # the assistant's turns, decoded (what rewards score)
  turns: int = 0  # assistant turns
  tool_calls: int = 0
  tool_errors: int = 0
  finish: str = ""  # "answer" | "max_turns" | "length"
  transcript: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (role, text) per turn

  def add(self, role: str, tokens: Sequence[int], logps: Sequence[float] | None, text: str) -> None:
    self.tokens.extend(int(t) for t in tokens)
    self.logps.extend([0.0] * len(tokens) if logps is None else [float(x) for x in logps])
    self.loss_mask.extend([1 if role == "assistant" else 0] * len(tokens))
    self.transcript.append((role, text))


def run_episodes(
    turn_fn: TurnFn,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    num_generations: int,
    limits: Limits,
    toolbox: tools_lib.Toolbox,
    parser: parse.CallParser,
    forbidden_ids: Any = (),
    observe: ObserveFn | None = None,
) -> list[Episode]:
  """`num_generations` episodes per prompt (rows of prompt i: i*G .. i*G+G-1), all turns of all rows batched.

  Turn 1 samples G continuations of each prompt (one shared prefill); later turns continue each row still in a
  tool call from its own transcript. `forbidden_ids` (pad, EOS, stop ids) are removed from environment tokens: in a
  completion they would end it or read as padding to the trainer's masks. `observe` runs a turn's tool calls (default:
  here, one by one; `shared_observe` across processes).
  """
  observe = observe or functools.partial(local_observe, toolbox)
  g = int(num_generations)
  eps = [Episode(prompt=list(prompts[i // g])) for i in range(len(prompts) * g)]
  forbidden = set(int(t) for t in forbidden_ids)
  rows = list(range(len(eps)))
  contexts, gens = [list(p) for p in prompts], g
  turn = 0
  while rows:
    outs = turn_fn(contexts, gens, limits.turn_tokens, turn)
    turn += 1
    calls: list[tuple[int, Any]] = []
    for r, (tokens, logps, finish) in zip(rows, outs):
      ep = eps[r]
      room = limits.total_tokens - len(ep.tokens)
      cut = len(tokens) > room
      tokens, logps = tokens[:room], logps[:room]
      text = tokenizer.decode(list(map(int, tokens)), skip_special_tokens=True)
      ep.add("assistant", tokens, logps, text)
      ep.text += text
      ep.turns += 1
      if cut or finish == "length":
        ep.finish = "length"
        continue
      if finish != "stop_string" or not parser.ends_with_call(text):
        ep.finish = "answer"
        continue
      ep.tool_calls += 1
      calls.append((r, parser.call(text)))
    follow: list[int] = []
    for (r, _), obs in zip(calls, observe(calls)):
      ep = eps[r]
      ep.tool_errors += int(obs.error)
      if ep.turns >= limits.max_turns:
        ep.finish = "max_turns"
        continue
      env_text = parser.observation(obs.text)
      env = [t for t in tokenizer.encode(env_text, add_special_tokens=False) if int(t) not in forbidden]
      if len(ep.tokens) + len(env) >= limits.total_tokens:  # no room left for the policy to read the answer
        ep.finish = "length"
        continue
      ep.add("tool", env, None, env_text)
      follow.append(r)
    rows = follow
    contexts, gens = [eps[r].prompt + eps[r].tokens for r in rows], 1
  return eps


def local_observe(toolbox: tools_lib.Toolbox, calls: list[tuple[int, Any]]) -> list[tools_lib.Observation]:
  """Each call's observation, run here: a parse error's text, or the tool's answer."""
  return [
      tools_lib.Observation(f"Error: {c.error}", True) if c.error else toolbox.run(c.name, c.arguments) for _, c in calls
  ]


def shared_observe(toolbox: tools_lib.Toolbox, calls: list[tuple[int, Any]]) -> list[tools_lib.Observation]:
  """The observations of calls every process holds alike (a sampler spanning the processes): process p runs the
  calls of rows r with r mod P == p, and every process gets all of them (module docstring)."""
  if not calls:  # the same on every process: no gather
    return []
  n, me = distributed.process_count(), jax.process_index()
  mine = local_observe(toolbox, [(r, c) for r, c in calls if r % n == me])
  texts, errors, it = [""] * len(calls), np.zeros(len(calls), np.int32), iter(mine)
  for i, (r, _) in enumerate(calls):
    if r % n == me:
      obs = next(it)
      texts[i], errors[i] = obs.text, int(obs.error)
  all_texts, all_errors = distributed.gather_texts(texts), distributed.gather_rows(errors)
  at = [(r % n) * len(calls) + i for i, (r, _) in enumerate(calls)]
  return [tools_lib.Observation(all_texts[j], bool(all_errors[j])) for j in at]


def counters(ep: Episode) -> list[int]:
  """An episode's figures besides its tokens, as numbers (gathered across processes with the rows)."""
  return [ep.turns, ep.tool_calls, ep.tool_errors, _FINISH.index(ep.finish)]


def from_counters(tokens: Sequence[int], loss_mask: Sequence[int], numbers: Sequence[int]) -> Episode:
  """An episode rebuilt from its gathered rows (what metrics and the loss mask read; no transcript)."""
  ep = Episode(prompt=[], tokens=[int(t) for t in tokens], loss_mask=[int(m) for m in loss_mask])
  ep.turns, ep.tool_calls, ep.tool_errors = (int(x) for x in numbers[:3])
  ep.finish = _FINISH[int(numbers[3])]
  return ep


def metrics(eps: Sequence[Episode], prefix: str = "agentic/") -> dict[str, float]:
  """Per-batch episode figures: turns, tool calls and errors, the tokens the loss mask removes."""
  n = max(len(eps), 1)
  masked = sum(len(e.loss_mask) - sum(e.loss_mask) for e in eps)
  total = sum(len(e.loss_mask) for e in eps)
  return {
      f"{prefix}turns_mean": sum(e.turns for e in eps) / n,
      f"{prefix}tool_calls_mean": sum(e.tool_calls for e in eps) / n,
      f"{prefix}tool_call_rate": sum(e.tool_calls > 0 for e in eps) / n,
      f"{prefix}tool_errors": float(sum(e.tool_errors for e in eps)),
      f"{prefix}tool_error_rate": sum(e.tool_errors for e in eps) / max(sum(e.tool_calls for e in eps), 1),
      f"{prefix}masked_tokens": float(masked),
      f"{prefix}masked_fraction": masked / max(total, 1),
      f"{prefix}max_turns_fraction": sum(e.finish == "max_turns" for e in eps) / n,
  }


@functools.lru_cache(maxsize=4)
def toolbox_for(names: tuple[str, ...], timeout_s: float) -> tools_lib.Toolbox:
  """One tool set (and its worker threads) per configuration, shared by every step and eval of a run."""
  return tools_lib.Toolbox(list(names), timeout_s)


@dataclasses.dataclass(frozen=True)
class AgenticSettings:
  """The keys an episode reads, from the config once (`from_config`): the tools, their markup and timeout, the turn
  and token limits (0 = the completion budget), the prompts per rollout call and the group size."""

  tools: tuple[str, ...]
  tool_parser: str
  tool_timeout_s: float
  max_turns: int
  turn_tokens: int
  max_tokens: int
  rollout_micro_batch_size: int
  num_generations: int

  @classmethod
  def from_config(cls, config: Any) -> "AgenticSettings":
    """`rl.agentic_*`, `rollout_micro_batch_size` and `rl.num_generations` of a MaxText/plugin config."""
    rl = config.rl
    return cls(
        tuple(rl.agentic_tools),
        str(rl.agentic_tool_parser),
        float(rl.agentic_tool_timeout_s),
        int(rl.agentic_max_turns),
        int(rl.agentic_turn_tokens),
        int(rl.agentic_max_tokens),
        int(config.rollout_micro_batch_size),
        int(rl.num_generations),
    )


def limits_of(settings: AgenticSettings, completion_budget: int) -> Limits:
  """The episode limits of a run; 0 = the completion budget (max_tokens_to_generate)."""
  total = settings.max_tokens or int(completion_budget)
  turn = settings.turn_tokens or total
  return Limits(max_turns=settings.max_turns, turn_tokens=min(turn, total), total_tokens=total)


def generate(
    run: Any, prompts: list[str], mode: Any = rl_cluster_lib.Mode.TRAIN, groups: slice | None = None
) -> tuple[base_rollout.RolloutOutput, list[Episode]]:
  """The plugin's rollout of `prompts` (each repeated G times consecutively, as Tunix passes them) as episodes.

  Returns the `RolloutOutput` the single-turn path would (text = the assistant's text, tokens = the whole
  completion, logprobs = the sampler's, 0 on environment tokens) and the episodes (their `loss_mask`, metrics).
  `groups`: the prompts this process runs (a per-host sampler, module docstring); None = all of them.
  """
  settings = AgenticSettings.from_config(run.config)
  cluster = run.rl_cluster
  rollout = cluster.rollout
  rc = cluster.cluster_config.rollout_config[mode]
  tokenizer = run.tokenizer  # the Hugging Face tokenizer (the engines encode prompts with it too)
  ids = [list(tokenizer.encode(p))[-int(rc.max_prompt_length) :] for p in prompts]
  unique, group = bucketing.consecutive_groups(ids)
  seed = rc.seed
  rng = seed if isinstance(seed, jax.Array) else jax.random.PRNGKey(0 if seed is None else int(seed))
  parser = parse.CallParser(settings.tool_parser)
  toolbox = toolbox_for(settings.tools, settings.tool_timeout_s)
  # A sampler spanning every process (colocated, several processes): agree on each turn's tool results.
  spans = distributed.is_multiprocess() and not (run.setup.disaggregated or rollout.per_host)
  observe = functools.partial(shared_observe if spans else local_observe, toolbox)

  def turn_fn(chunk_rng):
    def call(contexts, gens, max_new, turn):
      return rollout.generate_turn(
          contexts,
          num_generations=gens,
          max_new_tokens=max_new,
          rollout_config=rc,
          rng=jax.random.fold_in(chunk_rng, turn),
          stop_strings=[parser.end],
      )

    return call

  forbidden = {int(rollout.pad_id()), int(rollout.eos_id())} | {int(t) for t in (rc.eos_tokens or [])}
  limits = limits_of(settings, rc.max_tokens_to_generate)
  # rollout_micro_batch_size prompts per call (MaxText's key, as on the single-turn path), each with its own key.
  micro = settings.rollout_micro_batch_size
  size = len(unique) if micro <= 0 or mode != rl_cluster_lib.Mode.TRAIN else micro
  # Chunk c keeps its key however the prompts are split over processes (`groups`, in groups of rl.num_generations
  # rows; `unique` is in groups of `group` rows, the same unless adjacent groups repeat a prompt).
  g_rows = settings.num_generations
  lo, hi = (0, len(unique)) if groups is None else (groups.start * g_rows // group, groups.stop * g_rows // group)
  eps: list[Episode] = []
  for c, s in enumerate(range(0, len(unique), size)):
    a, b = max(s, lo), min(s + size, hi)
    if a < b:
      eps += run_episodes(
          turn_fn(jax.random.fold_in(rng, c)), tokenizer, unique[a:b], group, limits, toolbox, parser, forbidden, observe
      )
  out = base_rollout.RolloutOutput(
      text=[e.text for e in eps],
      logits=None,
      tokens=[np.asarray(e.tokens, np.int32) for e in eps],
      left_padded_prompt_tokens=bucketing.left_padded(
          unique[lo:hi], group, int(rc.max_prompt_length), int(rollout.pad_id())
      ),
      logprobs=[np.asarray(e.logps, np.float32) for e in eps],
  )
  return out, eps
