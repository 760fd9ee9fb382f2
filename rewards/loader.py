"""Build the reward-function list the trainer hands to Tunix, from a `RewardSelection` (read from the config once).

* default: the GSM8K stack `match_format_exactly`, `match_format_approximately`, `check_answer`;
* `reward_functions=a,b` (comma-separated): these names instead, looked up in `reward_functions_path`
  (a .py file) when set, then in the `maxtext_rl_plugin.reward_functions` entry-point group (other
  installed packages can register there), then among the built-ins (`check_numbers` is MaxText's
  name for `check_answer`).

Tunix calls `fn(prompts=..., completions=..., **batch_columns)` and uses `fn.__name__` as the metric
name. Functions written for MaxText take `tmvp_config` as well; that is detected from the signature
and bound: a built-in gets the small `gsm8k.RewardConfig`, a user's function what the caller hands `reward_fns` as
`tmvp_config` (MaxText's contract for `utils_rl` reward functions: the run's config; run/rewards.py, the builder,
passes it, and nothing here reads it). A signature that cannot work is rejected at start-up, not at step 1.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import math
import numbers
import os
import sys
import threading
import traceback
from typing import Any, Callable, Sequence

from absl import logging

from maxtext_rl_plugin.algorithms import reward_aggregation
from maxtext_rl_plugin.config.unresolved import Unresolved
from maxtext_rl_plugin import registry
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rewards import gsm8k

# Arguments the trainer supplies (Tunix passes the batch's extra columns as keyword arguments).
SUPPLIED_ARGS = ("prompts", "completions", "answer", "question", "mode", "tmvp_config")
TUNIX_SIGNATURE = "fn(prompts, completions, answer, **kwargs) -> list[float]"
MAXTEXT_SIGNATURE = "fn(prompts, completions, tmvp_config, **kwargs) -> list[float]"
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(float32).max: rewards become float32 (experience.sum_rewards)


class RewardFunctionError(ConfigError):
  """A reward function raised, exited, hung or returned something that is not one finite number per completion."""


class RewardFn:
  """A reward function with what it receives as `tmvp_config` bound: picklable (no closure), keeps the wrapped
  `__name__`.

  Each call runs in a daemon thread and is checked, so a user's function can neither hang the run (after
  `timeout_s` the run stops with one line; the stuck thread is abandoned), fake success (`sys.exit(0)` inside it is
  caught: it must not end the run with exit 0), nor end it in a traceback (an exception, NaN, inf, None or a wrong
  count). Every error names the function, its file and line, and what it returned.
  """

  def __init__(
      self,
      fn: Callable,
      tmvp_config: Any = None,
      pass_config: bool = False,
      source: str = "built-in",
      timeout_s: float | None = None,
  ):
    functools.update_wrapper(self, fn)
    self.fn = fn
    self.tmvp_config = tmvp_config  # passed on when `pass_config` (the module docstring says what it is), never read
    self.pass_config = pass_config
    self.source = source
    self.timeout_s = timeout_s

  def where(self) -> str:
    """`name (file:line)` of the wrapped function, or its source when it has no Python file."""
    try:
      path = inspect.getsourcefile(self.fn)
      line = inspect.getsourcelines(self.fn)[1]
    except (TypeError, OSError):
      return f"'{self.__name__}' ({self.source})"
    return f"'{self.__name__}' ({path}:{line})"

  def _call(self, prompts: Sequence[str], completions: Sequence[str], kwargs: dict) -> Any:
    """The function's return value, run in a daemon thread bounded by `timeout_s`."""
    box: dict[str, Any] = {}

    def target():
      try:
        box["out"] = self.fn(prompts=prompts, completions=completions, **kwargs)
      except BaseException as e:  # pylint: disable=broad-exception-caught  # SystemExit too: reported, never exit 0
        box["error"] = e

    worker = threading.Thread(target=target, name=f"reward-{self.__name__}", daemon=True)
    worker.start()
    worker.join(self.timeout_s)
    if worker.is_alive():
      raise RewardFunctionError(
          f"reward function {self.where()} did not return within reward_call_timeout_seconds={self.timeout_s:g} s "
          f"(one call over {len(completions)} completions); fix it or raise the timeout"
      )
    err = box.get("error")
    if isinstance(err, SystemExit):
      raise RewardFunctionError(
          f"reward function {self.where()} called sys.exit({err.code!r}); a reward function must return its rewards"
      )
    if err is not None:
      tb = traceback.extract_tb(err.__traceback__)
      at = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
      raise RewardFunctionError(
          f"reward function {self.where()} raised {type(err).__name__}{at}: {str(err)[:200] or '(no message)'}"
      ) from None
    return box.get("out")

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **kwargs: Any) -> list[float]:
    # Each function gets its own copies of the batch: one that rewrites completions[i] (or pops an answer) in place
    # must not change what the next function scores, nor the count it is checked against.
    n = len(completions)
    prompts, completions = _own_copy(prompts), _own_copy(completions)
    kwargs = {k: _own_copy(v) for k, v in kwargs.items()}
    if self.pass_config:
      kwargs["tmvp_config"] = self.tmvp_config
    out = self._call(prompts, completions, kwargs)
    expected = f"expected one finite number per completion ({n})"
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
      raise RewardFunctionError(f"reward function {self.where()} returned {_shown(out)}; {expected}")
    out = list(out)
    if len(out) != n:  # the count asked for, whatever the function did to its copies
      raise RewardFunctionError(
          f"reward function {self.where()} returned {len(out)} values for {n} completions; {expected}"
      )
    values = []
    for i, v in enumerate(out):
      if not isinstance(v, numbers.Real) and not (getattr(v, "shape", None) == () and hasattr(v, "__float__")):
        raise RewardFunctionError(
            f"reward function {self.where()} returned a {type(out).__name__} whose item {i} is {_shown(v)}; {expected}"
        )
      try:
        f = float(v)
      except OverflowError:  # an int beyond any float (10**400)
        raise RewardFunctionError(
            f"reward function {self.where()} returned {_shown(v)} for completion {i}, beyond any float; {expected}"
        ) from None
      if not math.isfinite(f):
        raise RewardFunctionError(f"reward function {self.where()} returned {f} for completion {i}; {expected}")
      if abs(f) > FLOAT32_MAX:
        raise RewardFunctionError(
            f"reward function {self.where()} returned {f:g} for completion {i}, beyond the float32 range "
            f"(|r| <= {FLOAT32_MAX:.4g}) the trainer computes advantages and the loss in; {expected} of that range"
        )
      values.append(f)
    return values

  def __repr__(self) -> str:
    return f"RewardFn({self.__name__} from {self.source})"


def _own_copy(value: Any) -> Any:
  """A container of the batch (list, tuple, dict, set, NumPy array) copied for one reward function; the items are
  strings and numbers (immutable), so one level suffices. Anything else is passed as is (a config, a scalar)."""
  if isinstance(value, (list, tuple)):
    return list(value)
  if isinstance(value, (dict, set)):
    return type(value)(value)
  if hasattr(value, "copy") and hasattr(value, "__array__"):
    return value.copy()
  return value


def _shown(v: Any) -> str:
  text = repr(v)
  return f"{type(v).__name__} {text[:60]}{'...' if len(text) > 60 else ''}" if v is not None else "None"


def check_signature(fn: Any, name: str, source: str) -> bool:
  """Validate a reward function's signature; returns whether it wants `tmvp_config` (MaxText style)."""
  if not callable(fn):
    raise ConfigError(f"reward_functions: '{name}' in {source} is a {type(fn).__name__}, not a function")
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False  # builtins / C callables: trust them
  kinds = {p.kind for p in params.values()}
  has_var_kw = inspect.Parameter.VAR_KEYWORD in kinds
  expected = f"expected {TUNIX_SIGNATURE} or {MAXTEXT_SIGNATURE}"
  sig = f"({', '.join(str(p) for p in params.values())})"
  for needed in ("prompts", "completions"):
    p = params.get(needed)
    if p is None or p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
      raise ConfigError(f"reward_functions: '{name}' in {source} has signature {sig}; {expected}")
  if not has_var_kw:
    raise ConfigError(
        f"reward_functions: '{name}' in {source} has signature {sig} without **kwargs (the trainer passes the batch's "
        f"columns such as answer and question); {expected}"
    )
  missing = [
      p.name
      for p in params.values()
      if p.default is inspect.Parameter.empty
      and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
      and p.name not in SUPPLIED_ARGS
  ]
  if missing:
    raise ConfigError(
        f"reward_functions: '{name}' in {source} requires {', '.join(missing)}, which the trainer does not supply "
        f"(it passes {', '.join(SUPPLIED_ARGS)}); {expected}"
    )
  return "tmvp_config" in params


_LOADED: dict[tuple[str, int, int], Any] = {}  # (absolute path, mtime, size) -> module: imported once per process


def _load_user_module(path: str):
  """Import reward_functions_path as a uniquely named module; a missing or broken file is a ConfigError. The first
  pass (`check`) and the trainer's start-up share one import: the module's top level runs once."""
  try:
    if not storage.isfile(path):
      raise ConfigError(f"reward_functions_path='{path}': file not found")
    local = storage.local_copy(path)  # Python imports local files: an object in a bucket is copied once
  except OSError as e:
    raise ConfigError(f"reward_functions_path='{path}': {e.strerror or e}") from None
  st = os.stat(local)
  key = (os.path.abspath(local), st.st_mtime_ns, st.st_size)
  if key not in _LOADED:
    _LOADED[key] = _import_user_module(local)
  return _LOADED[key]


def _import_user_module(path: str):
  """Execute the file as a fresh module; any error, `sys.exit` included, becomes one ConfigError line."""
  stem = os.path.splitext(os.path.basename(path))[0]
  mod_name = f"_maxtext_rl_user_rewards_{''.join(c if c.isalnum() else '_' for c in stem)}"
  spec = importlib.util.spec_from_file_location(mod_name, os.path.abspath(path))
  if spec is None or spec.loader is None:
    raise ConfigError(f"reward_functions_path='{path}': not an importable Python file")
  module = importlib.util.module_from_spec(spec)
  sys.modules[mod_name] = module  # so the functions pickle by reference
  try:
    spec.loader.exec_module(module)
  except SystemExit as e:  # user code must never end the process silently (sys.exit(0) at import: exit 0, nothing)
    sys.modules.pop(mod_name, None)
    raise ConfigError(
        f"reward_functions_path='{path}': importing it called sys.exit({e.code!r}); a reward module must define "
        "functions, not end the process"
    ) from None
  except Exception as e:  # pylint: disable=broad-exception-caught
    sys.modules.pop(mod_name, None)
    tb = traceback.extract_tb(e.__traceback__)
    at = f" (line {tb[-1].lineno})" if tb and tb[-1].filename == os.path.abspath(path) else ""
    raise ConfigError(f"reward_functions_path='{path}': importing it failed{at}: {type(e).__name__}: {e}") from None
  return module


def _registered(name: str):
  """The reward function another package registered under `name` (entry points), or None."""
  try:
    eps = registry.entry_points("reward_functions")
  except Exception:  # pylint: disable=broad-exception-caught
    return None
  ep = eps.get(name)
  if ep is None:
    return None
  try:
    return ep.load(), f"entry point {ep.value}"
  except SystemExit as e:
    raise ConfigError(
        f"reward_functions: entry point '{name}' ({ep.value}) called sys.exit({e.code!r}) when loaded"
    ) from None
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise ConfigError(f"reward_functions: entry point '{name}' ({ep.value}) failed to load: {e}") from None


def resolve(names: Sequence[str], path: str = "") -> list[tuple[str, Callable, str]]:
  """(name, function, where-it-came-from) for each name; ConfigError naming the first missing one."""
  module = _load_user_module(path) if path else None
  out = []
  for name in names:
    if module is not None and hasattr(module, name):
      out.append((name, getattr(module, name), f"reward_functions_path='{path}'"))
      continue
    reg = _registered(name)
    if reg is not None:
      out.append((name, reg[0], reg[1]))
      continue
    if name in gsm8k.BUILTIN_REWARD_FNS:
      out.append((name, gsm8k.BUILTIN_REWARD_FNS[name], "built-in"))
      continue
    defined = (
        sorted(
            k
            for k, v in vars(module).items()
            if inspect.isfunction(v) and not k.startswith("_") and v.__module__ == module.__name__
        )
        if module is not None
        else []
    )
    where = f"'{path}' (defines: {', '.join(defined) or 'no functions'})" if module is not None else "the built-ins"
    raise ConfigError(
        f"reward_functions: '{name}' is not defined in {where}; built-ins: {', '.join(sorted(gsm8k.BUILTIN_REWARD_FNS))}"
    )
  return out


def _names_and_path(names_raw: str, path: str) -> tuple[list[str], str]:
  """The function names (the default stack when unset) and reward_functions_path, checked."""
  names_raw, path = (names_raw or "").strip(), (path or "").strip()
  if path and not names_raw:
    raise ConfigError(
        f"reward_functions_path='{path}' is set but reward_functions is empty; name the functions to use "
        "(comma-separated)"
    )
  names = [n.strip() for n in names_raw.split(",") if n.strip()] or list(gsm8k.DEFAULT_STACK)
  if len(set(names)) != len(names):
    raise ConfigError(f"reward_functions='{names_raw}' lists a function twice")
  return names, path


@dataclasses.dataclass(frozen=True)
class RewardSelection:
  """Which reward functions a run scores with, read from the config once (`of`): the names (the default stack when
  `reward_functions` is unset), the file looked in first (`reward_functions_path`) and `rl.reward_weights` (None: a
  config without an `rl:` block, such as the scoring CLI's, or a first-pass view that cannot type it yet)."""

  names: tuple[str, ...]
  path: str = ""
  reward_weights: tuple[float, ...] | None = None

  @classmethod
  def of(cls, config: Any) -> "RewardSelection":
    """The selection of a MaxText/plugin config, or of a first-pass `validation.RawConfig` (an `Unresolved`
    reward_functions or reward_functions_path propagates: the caller leaves the check to the typed pass)."""
    names, path = _names_and_path(getattr(config, "reward_functions", ""), getattr(config, "reward_functions_path", ""))
    try:
      weights = config.rl.reward_weights
    except (AttributeError, Unresolved):  # no rl: block, or a key the first pass cannot type yet
      weights = None
    return cls(tuple(names), path, None if weights is None else tuple(weights))

  def check_weights(self) -> None:
    """One weight per function, refused in one line (`reward_aggregation.configured_weights` reads `reward_weights`,
    as on the rl: block); nothing to check when the weights are not known."""
    if self.reward_weights is not None:
      reward_aggregation.configured_weights(self, self.names)


def check(selection: RewardSelection) -> None:
  """What `reward_fns` would refuse, before the schema's and the trainer's imports (train_rl's first pass,
  print_config=true too): the file exists and imports (sys.exit in it included), each name resolves, each signature
  works, one weight per function."""
  for name, fn, source in resolve(selection.names, selection.path):
    check_signature(fn, name, source)
  selection.check_weights()


def reward_fns(
    selection: RewardSelection, grading: gsm8k.RewardConfig, timeout_s: float, tmvp_config: Any = None
) -> list[Callable]:
  """Tunix-compatible reward functions `fn(prompts, completions, answer, **kwargs) -> list[float]`, each call bounded by
  `timeout_s` (reward_call_timeout_seconds).

  A built-in receives `grading` (`gsm8k.RewardConfig.of(config)`: cheap to pickle) as its `tmvp_config`; a user's
  function that takes `tmvp_config` receives the `tmvp_config` given here (module docstring)."""
  selection.check_weights()  # before any file is imported: a bare rewards config (no rl: block) has no weights
  fns = []
  for name, fn, source in resolve(selection.names, selection.path):
    wants_config = check_signature(fn, name, source)
    builtin = fn in gsm8k.BUILTIN_REWARD_FNS.values()
    bound = grading if builtin else tmvp_config
    fns.append(RewardFn(fn, bound, pass_config=wants_config, source=source, timeout_s=float(timeout_s)))
  logging.info("reward functions: %s", ", ".join(f"{f.__name__} ({f.source})" for f in fns))
  return fns
