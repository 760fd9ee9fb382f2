"""The first pass's "not known yet": a key of the config as written whose typed value only the schema knows.

`validation.RawConfig` raises `Unresolved` for a key that is absent, set by a model file or an `M_<KEY>` environment
variable, or not of its default's type; the check reading it waits for the typed pass. It is its own exception, not an
`AttributeError`: a plain `getattr(view, key, default)` does not swallow it, so a check reads a not-yet-typed key as
unset only where it says so (`value_or`, `getattr` with a default that also catches `Unresolved`). The first pass
(`validation.validate_raw`) still skips a check that raises `AttributeError` (an untyped value's missing method), and
with it a real `AttributeError` bug in that check; the typed pass (`validation.validate`) runs the same check without
catching anything, so such a bug surfaces there.
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
