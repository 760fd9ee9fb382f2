"""Pathways start-up order: pathwaysutils' proxy backend factory is registered before JAX creates any backend.

On a Pathways cluster JAX refuses the registration once backends exist ("Backend proxy already initialized").
Here JAX runs on CPU; the proxy platform is simulated at the narrowest boundary: pathwaysutils believes it is on
Pathways (`is_pathways_backend_used`), its real `initialize()` and `proxy_backend.register_backend_factory()` run
and register a real "proxy" factory with JAX, and a spy on JAX's registration raises JAX's own error when a backend
already exists (which on CPU nothing else would enforce).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pathwaysutils
import pathwaysutils._initialize as pinit
import pytest

from maxtext_rl_plugin import errors
from maxtext_rl_plugin import pathways
from maxtext_rl_plugin.resharding import backend
from maxtext_rl_plugin.resharding import move
from maxtext_rl_plugin.run import engine as run_engine

SIMULATE = textwrap.dedent("""
    import json, sys
    from jax._src import xla_bridge
    import jax.extend.backend
    import pathwaysutils._initialize as pinit
    from maxtext_rl_plugin import pathways

    events = []
    pinit.is_pathways_backend_used = lambda: True  # pathwaysutils sees the proxy platform
    pathways.requested = lambda: True  # ... and so does the plugin's one decision point
    real_register = jax.extend.backend.register_backend_factory

    def spy(name, factory, **kw):
      backends_exist = bool(xla_bridge._backends)
      events.append(["register", name, backends_exist])
      if name == "proxy" and backends_exist:  # what JAX does on Pathways, where the proxy backend is among them
        raise RuntimeError("Backend proxy already initialized")
      return real_register(name, factory, **kw)

    jax.extend.backend.register_backend_factory = spy
    """)


def _run(body: str) -> dict:
  """Run `body` after the Pathways simulation in a fresh interpreter; returns its `out` dict."""
  script = SIMULATE + textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(out))\n"
  proc = subprocess.run(
      [sys.executable, "-c", script],
      capture_output=True,
      text=True,
      timeout=300,
      env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
      check=False,
  )
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert lines, proc.stderr[-3000:]
  return json.loads(lines[-1][len("RESULT ") :])


def test_train_rl_main_initializes_pathways_before_any_backend():
  out = _run("""
      from maxtext_rl_plugin import train_rl
      rc = train_rl.main(["configs/cpu_tiny.yml", "print_config=true"])
      import jax
      devices_after = len(jax.devices())  # the first backend comes up after the registration
      out = {"rc": rc, "events": events, "count": pinit._initialization_count, "devices": devices_after,
             "proxy_factory": "proxy" in xla_bridge._backend_factories}
      """)
  assert out["rc"] == 0 and out["count"] == 1 and out["devices"] >= 1
  assert out["events"] == [["register", "proxy", False]]  # registered once, while no backend existed
  assert out["proxy_factory"]


def test_the_simulation_catches_a_late_initialize():
  """The same spy fails the old order (a backend first, pathwaysutils.initialize() after): the test can fail."""
  out = _run("""
      import jax
      jax.devices()
      import pathwaysutils
      try:
        pathwaysutils.initialize()
        err = None
      except RuntimeError as e:
        err = str(e)
      out = {"err": err, "events": events}
      """)
  assert out["err"] == "Backend proxy already initialized" and out["events"] == [["register", "proxy", True]]


def test_resharding_never_initializes_late(monkeypatch):
  """A Pathways process that skipped initialisation gets one error line at the first sync, not a late call."""
  monkeypatch.setenv("JAX_PLATFORMS", "proxy")
  monkeypatch.setattr(pinit, "_initialization_count", 0)
  monkeypatch.setattr(pathwaysutils, "initialize", lambda: pytest.fail("pathwaysutils.initialize() called late"))
  monkeypatch.setattr(backend, "_logged_paths", set())
  with pytest.raises(errors.ConfigError, match="did not run before JAX started") as ei:
    backend.backend_path()
  assert "\n" not in str(ei.value)
  assert not any(hasattr(m, "_ensure_pathwaysutils_initialized") for m in (backend, move))
  monkeypatch.setattr(pinit, "_initialization_count", 1)  # what train_rl.main leaves behind
  assert backend.backend_path() in (backend.PATH_PATHWAYS_EXPERIMENTAL, backend.PATH_PATHWAYS)
  assert pathways.initialized()


def test_one_decision_point(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert not pathways.requested() and not pathways.initialize()  # off Pathways: nothing to do
  monkeypatch.setattr(pathways, "requested", lambda: True)
  assert backend.pathways_requested()
  cfg = type(
      "C",
      (),
      {
          "rollout_engine": "auto",
          "model_name": "llama3.1-8b",
          "head_dim": 128,
          "vllm_hf_overrides": "",
          "rollout_quantization": "",
      },
  )()

  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else None)
  assert run_engine.resolve_name(cfg) == "vllm"  # the one resolution point
