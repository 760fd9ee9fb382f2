"""Pathways start-up: the one place that decides "are we on Pathways" and initialises pathwaysutils.

Pathways-on-Cloud is selected with `JAX_PLATFORMS=proxy` (the criterion pathwaysutils itself uses).
`pathwaysutils.initialize()` registers the IFRT proxy backend factory, patches profiling and (with
`ENABLE_PATHWAYS_PERSISTENCE=1`) the Orbax array handler; it must run before anything creates a JAX backend:
afterwards JAX refuses the registration ("Backend proxy already initialized"). MaxText's `train_rl.main` calls it
first thing; so does the plugin's (`train_rl.main` -> `initialize()`), and nothing calls it later: a library
caller that skipped it gets one error line at the first weight sync (`require_initialized`).
"""

# pathwaysutils is optional: only Pathways runs need it.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import os
import sys

from absl import logging

from maxtext_rl_plugin.errors import ConfigError


def requested() -> bool:
  """Whether this process runs on the Pathways proxy backend: `proxy` in JAX_PLATFORMS (env or jax.config)."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  jax_mod = sys.modules.get("jax")  # read jax.config only if jax is already imported: importing it here is not needed
  if jax_mod is not None:
    platforms += "," + str(jax_mod.config.jax_platforms or "")
  return "proxy" in platforms


def initialize() -> bool:
  """Call `pathwaysutils.initialize()` when on Pathways, before any JAX backend exists; True if it ran.

  Off Pathways it does nothing (pathwaysutils' own initialize is a no-op there too), so CPU/GPU/plain TPU runs
  do not need pathwaysutils installed.
  """
  if not requested():
    return False
  try:
    import pathwaysutils
  except ImportError:
    raise ConfigError(
        "JAX_PLATFORMS=proxy (Pathways) needs pathwaysutils: pip install 'maxtext-rl-plugin[tpu]'"
    ) from None
  pathwaysutils.initialize()
  logging.info("Pathways: pathwaysutils.initialize() ran before any JAX backend was created")
  return True


def initialized() -> bool:
  """Whether `pathwaysutils.initialize()` has run in this process (pathwaysutils 0.1.13's counter)."""
  init_mod = sys.modules.get("pathwaysutils._initialize")
  return init_mod is not None and getattr(init_mod, "_initialization_count", 0) > 0


def require_initialized() -> None:
  """On Pathways, refuse to go on when pathwaysutils was never initialised (calling it now would be too late)."""
  if requested() and not initialized():
    raise ConfigError(
        "JAX_PLATFORMS=proxy but pathwaysutils.initialize() did not run before JAX started; start through "
        "`python -m maxtext_rl_plugin.train_rl` or call maxtext_rl_plugin.pathways.initialize() first"
    )
