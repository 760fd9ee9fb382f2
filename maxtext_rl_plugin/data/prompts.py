"""The model's input: the prompt template (MaxText's JSON template files), reasoning/answer tags, the chat template.

`build_prompt` is the one place a question becomes a prompt (train, eval and SFT warm-up alike); `format_target` the
one place a reference solution becomes a completion in the reward's format. Both take `PromptSettings`, read from the
config once (`PromptSettings.from_config`), not the config.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Any, Sequence

import maxtext

from maxtext_rl_plugin import storage
from maxtext_rl_plugin.config.files import configs_dir
from maxtext_rl_plugin.data.splits import Example
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rewards import gsm8k

_CALC_ANNOTATION_RE = re.compile(r"<<[^<>]{0,200}>>")

# Used when data_template_path is empty: a shorter instruction than MaxText's gsm8k_rl.json (about 30
# fewer tokens), which keeps synthetic prompts for the CPU demo's tiny model near 60 tokens.
_DEFAULT_TEMPLATE = {
    "SYSTEM_PROMPT": (
        "Reason step by step between {reasoning_start_token} and {reasoning_end_token}, then give only the final "
        "number between {solution_start_token} and {solution_end_token}."
    ),
    "TEMPLATE": "{system_prompt}\n\n{question}\n",
}


def _template_candidates(path: str) -> list[str]:
  """Where a relative data_template_path may live: as given, MaxText's package root, the shipped configs."""
  cands = [path]
  if not os.path.isabs(path) and not storage.is_remote(path):
    pkg = os.path.dirname(os.path.abspath(maxtext.__file__))
    cands.append(os.path.join(os.path.dirname(pkg), path))  # MaxText's own resolution (site-packages root)
    if path.startswith("maxtext/"):
      cands.append(os.path.join(pkg, path[len("maxtext/") :]))
    cands.append(os.path.join(configs_dir(), path))
  return cands


@functools.lru_cache(maxsize=16)
def load_template(path: str) -> dict[str, str]:
  """MaxText's data template JSON (`SYSTEM_PROMPT`, `TEMPLATE`), resolved like MaxText does.

  A relative path is tried from the working directory, then against MaxText's installed package (the
  default 'maxtext/examples/chat_templates/gsm8k_rl.json'), then the plugin's configs.
  """
  if not path:
    return dict(_DEFAULT_TEMPLATE)
  found = next((c for c in _template_candidates(path) if storage.isfile(c)), None)
  if found is None:
    raise ConfigError(
        f"invalid value for 'data_template_path'='{path}': file not found (also looked in MaxText's package)"
    )
  try:
    tpl = json.loads(storage.read_text(found))
  except (OSError, ValueError) as e:
    raise ConfigError(f"invalid value for 'data_template_path'='{path}': not a readable JSON file ({e})") from None
  if not isinstance(tpl, dict) or not isinstance(tpl.get("SYSTEM_PROMPT"), str):
    raise ConfigError(
        f"invalid value for 'data_template_path'='{path}': expected a JSON object with a 'SYSTEM_PROMPT' string"
    )
  if not isinstance(tpl.get("TEMPLATE", ""), str) or "{question}" not in tpl.get("TEMPLATE", "{question}"):
    raise ConfigError(
        f"invalid value for 'data_template_path'='{path}': 'TEMPLATE' must be a string containing {{question}}"
    )
  tpl.setdefault("TEMPLATE", _DEFAULT_TEMPLATE["TEMPLATE"])
  return tpl


_TAG_KEYS = ("reasoning_start_token", "reasoning_end_token", "solution_start_token", "solution_end_token")


@dataclasses.dataclass(frozen=True)
class PromptSettings:
  """What a prompt and an SFT target are made of, read from the config once (`from_config`): the template file, the
  chat template switch, the four tag tokens (defaults: the reward stack's, MaxText's rl.yml) and whether the prompt
  already opens the reasoning."""

  template_path: str = ""
  use_chat_template: bool = True
  reasoning_start_token_in_prompt: bool = False
  tags: tuple[tuple[str, str], ...] = tuple((k, getattr(gsm8k.RewardConfig(), k)) for k in _TAG_KEYS)

  @classmethod
  def from_config(cls, config: Any) -> "PromptSettings":
    """The prompt keys of a MaxText/plugin config (a key it lacks keeps its default)."""
    default = cls()
    return cls(
        str(getattr(config, "data_template_path", "") or ""),
        bool(getattr(config, "use_chat_template", default.use_chat_template)),
        bool(getattr(config, "reasoning_start_token_in_prompt", default.reasoning_start_token_in_prompt)),
        tuple((k, str(getattr(config, k, v))) for k, v in default.tags),
    )


def tag_tokens(settings: PromptSettings) -> dict[str, str]:
  """The four tag tokens, by key name."""
  return dict(settings.tags)


def system_prompt(settings: PromptSettings) -> str:
  """The instruction to answer as `<reasoning>...</reasoning><answer>...</answer>` (configured tokens)."""
  tpl = load_template(settings.template_path)
  try:
    return tpl["SYSTEM_PROMPT"].format(**tag_tokens(settings))
  except (KeyError, IndexError) as e:
    raise ConfigError(f"data_template_path: SYSTEM_PROMPT has an unknown placeholder {e}") from None


def _has_chat_template(tokenizer) -> bool:
  return (
      tokenizer is not None
      and bool(getattr(tokenizer, "chat_template", None))
      and hasattr(tokenizer, "apply_chat_template")
  )


def build_prompt(question: str, tokenizer, settings: PromptSettings) -> str:
  """The model input for a question.

  With `use_chat_template` and a tokenizer that has one: system prompt + user question through
  `apply_chat_template(add_generation_prompt=True)` (templates without a system role, e.g. Gemma's,
  get the system prompt prepended to the user turn). Otherwise the template file's `TEMPLATE`.
  With `reasoning_start_token_in_prompt`, the prompt ends with the reasoning start token.
  """
  sp = system_prompt(settings)
  if settings.use_chat_template and _has_chat_template(tokenizer):
    msgs = [{"role": "system", "content": sp}, {"role": "user", "content": question}]
    try:
      prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    except Exception:  # pylint: disable=broad-exception-caught  # jinja raises for unsupported roles
      prompt = tokenizer.apply_chat_template(
          [{"role": "user", "content": f"{sp}\n\n{question}"}], add_generation_prompt=True, tokenize=False
      )
  else:
    tpl = load_template(settings.template_path)
    try:
      prompt = tpl["TEMPLATE"].format(system_prompt=sp, question=question)
    except (KeyError, IndexError) as e:
      raise ConfigError(f"data_template_path: TEMPLATE has an unknown placeholder {e}") from None
  if settings.reasoning_start_token_in_prompt:
    rs = tag_tokens(settings)["reasoning_start_token"]
    if not prompt.endswith(rs):
      prompt += rs
  return prompt


def format_target(example: Example, settings: PromptSettings) -> str:
  """The completion an SFT warm start should learn: `<reasoning>steps</reasoning>\\n<answer>N</answer>`.

  Steps are the reference solution without its `#### N` line and GSM8K's `<<calculator>>` notes.
  """
  t = tag_tokens(settings)
  sol = example.solution or ""
  if t["solution_start_token"] in sol and t["solution_end_token"] in sol:
    return sol
  reasoning, _, final = sol.rpartition("####") if "####" in sol else (sol, "", "")
  reasoning = _CALC_ANNOTATION_RE.sub("", reasoning).strip()
  shown = final.strip() or example.answer  # the demonstration's own answer (a flawed teacher's may be wrong)
  rs = "" if settings.reasoning_start_token_in_prompt else t["reasoning_start_token"]
  return f"{rs}{reasoning}{t['reasoning_end_token']}\n{t['solution_start_token']}{shown}{t['solution_end_token']}"


def prompt_lengths(tokenizer, prompts: Sequence[str]) -> list[int]:
  """Token counts as the rollout will see them (special tokens the tokenizer adds included)."""
  if not prompts:
    return []
  if callable(tokenizer) and hasattr(tokenizer, "batch_decode"):  # a Hugging Face tokenizer: batched, fast
    return [len(ids) for ids in tokenizer(list(prompts))["input_ids"]]
  if hasattr(tokenizer, "encode"):
    return [len(tokenizer.encode(p)) for p in prompts]
  return [len(tokenizer.tokenize(p)) for p in prompts]
