"""The first pass's "not known yet": a key of the config as written whose typed value only the schema knows.

`validation.RawConfig` raises `Unresolved` for a key that is absent, set by a model file or an `M_<KEY>` environment
variable, or not of its default's type; the check reading it waits for the typed pass. It is its own exception, not an
`AttributeError`, so a real `AttributeError` in a check is a bug that surfaces instead of quietly turning the first
pass off; `value_or` is `getattr` with a default for the checks that read such a key as unset.
"""

from __future__ import annotations

from typing import Any


class Unresolved(Exception):
  """A key of a `RawConfig` whose typed value only the schema knows; the check reading it waits for `validate`."""


def value_or(config: Any, key: str, default: Any = None) -> Any:
  """`getattr(config, key, default)`, where a first-pass key not known yet (`Unresolved`) reads as unset too."""
  try:
    return getattr(config, key, default)
  except Unresolved:
    return default
