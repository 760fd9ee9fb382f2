"""Which path moves the weights: Pathways' resharding (with an intermediate sharding) or `jax.device_put`.

On Pathways (`JAX_PLATFORMS` contains `proxy` and `pathwaysutils` imports) each chunk goes through
`pathwaysutils.experimental.reshard.sidechannel_reshard_with_intermediate_sharding` with resharding-plan caching; if
only the stable API exists, through `pathwaysutils.reshard.reshard_with_intermediate_sharding`; elsewhere through
`jax.device_put`. The path is logged once (`backend_path()`), never chosen silently (Tunix 0.1.7's `reshard_pytree`
falls back to `device_put` at debug level).
"""

# pathwaysutils is optional (Pathways images, the `tpu` extra): imported only where a Pathways path is taken.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import importlib

from absl import logging

from maxtext_rl_plugin import pathways

PATH_PATHWAYS_EXPERIMENTAL = "pathways_experimental"
PATH_PATHWAYS = "pathways"
PATH_DEVICE_PUT = "device_put"
_logged_paths: set[str] = set()


def pathways_requested() -> bool:
  """Whether the process runs on the Pathways proxy backend (the decision lives in `pathways.requested`)."""
  return pathways.requested()


def backend_path() -> str:
  """Which resharding path is active: 'pathways_experimental', 'pathways' or 'device_put' (logged once)."""
  path, why = PATH_DEVICE_PUT, "JAX_PLATFORMS has no 'proxy' (not a Pathways backend)"
  if pathways_requested():
    try:
      import pathwaysutils
    except ImportError:
      path, why = (
          PATH_DEVICE_PUT,
          "JAX_PLATFORMS=proxy but pathwaysutils is not installed (pip install 'maxtext-rl-plugin[tpu]')",
      )
    else:
      del pathwaysutils
      pathways.require_initialized()  # train_rl.main initialised it before JAX started; too late to do it here
      try:
        importlib.import_module("pathwaysutils.experimental.reshard")  # a probe

        path, why = PATH_PATHWAYS_EXPERIMENTAL, "sidechannel reshard with intermediate sharding, cached plans"
      except ImportError:
        try:
          importlib.import_module("pathwaysutils.reshard")  # a probe

          path, why = (
              PATH_PATHWAYS,
              "pathwaysutils.experimental.reshard unavailable; IFRT reshard with intermediate sharding",
          )
        except ImportError:
          path, why = PATH_DEVICE_PUT, "pathwaysutils has no reshard module"
  if path not in _logged_paths:
    _logged_paths.add(path)
    log = logging.warning if (pathways_requested() and path == PATH_DEVICE_PUT) else logging.info
    log("weight sync path: %s (%s)", path, why)
  return path
