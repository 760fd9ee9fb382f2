"""The episode's tool set: Tunix's `ToolManager` over Tunix's tools, plus what a training run needs around it.

Tunix's `ToolManager.run` already turns an unknown tool or a tool that raises into an error `ToolOutput`; it has no
timeout, and a tool that never returns would stall the rollout (and the whole RL step). Here every call runs in a
worker thread and is abandoned after `rl.agentic_tool_timeout_s` with an error observation (a Python thread cannot
be killed: a runaway tool keeps its worker, which is why the pool is bounded and separate from the trainer's).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

from tunix.rl.agentic.tools import base_tool
from tunix.rl.agentic.tools import calculator_tool
from tunix.rl.agentic.tools import tool_manager

# rl.agentic_tools names -> Tunix tool classes (the tool's name in a call is the key).
TOOL_CLASSES: dict[str, type[base_tool.BaseTool]] = {"calculator": calculator_tool.CalculatorTool}


@dataclasses.dataclass(frozen=True)
class Observation:
  """What the environment answers to one tool call: the text shown to the model, and whether it is an error."""

  text: str
  error: bool


class Toolbox:
  """The configured tools behind one `run(name, arguments)` with a per-call timeout (see the module docstring)."""

  def __init__(self, names: list[str], timeout_s: float, max_workers: int = 4):
    self.manager = tool_manager.ToolManager({n: TOOL_CLASSES[n] for n in names})
    self.timeout_s = float(timeout_s)
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="agentic-tool")

  @property
  def names(self) -> list[str]:
    return list(self.manager.names)

  def run(self, name: str, arguments: Any) -> Observation:
    """The observation of calling tool `name` with `arguments` (never raises: every failure is an error text)."""
    if name not in self.manager.names:
      return Observation(f"Error: unknown tool '{name}' (tools: {', '.join(self.manager.names)})", True)
    if not isinstance(arguments, dict):
      return Observation(f"Error: arguments of '{name}' must be a JSON object", True)
    future = self._pool.submit(self.manager.run, name, **arguments)
    try:
      out = future.result(timeout=self.timeout_s)
    except concurrent.futures.TimeoutError:
      return Observation(f"Error: tool '{name}' timed out after {self.timeout_s:g}s", True)
    except Exception as e:  # pylint: disable=broad-exception-caught  # e.g. arguments that are not keywords
      return Observation(f"Error: {type(e).__name__}: {e}", True)
    if out.error:
      return Observation(f"Error: {out.error}", True)
    return Observation(repr(out), False)
