"""A turn's tool call, found with Tunix's tool-call parser for the model family (`rl.agentic_tool_parser`).

The assistant turn is generated until the parser's closing tag (`</tool_call>` for Qwen's markup), so a turn holds at
most one complete call: the text from its last opening tag to that closing tag. Tunix's `QwenToolParser.parse`
returns the calls it could decode and drops a block with bad JSON (printing it), and raises on a JSON object without
`name`/`arguments`; both become a `Call` with an error here, so the episode answers with an error observation instead
of losing the turn or the run. Tunix's Gemini parser (0.1.7) parses nothing (`parse` returns []), so only the Qwen
markup is offered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Any

from tunix.rl.agentic.parser.tool_parser import tool_parser_registry

PARSERS = ("qwen",)


@dataclasses.dataclass(frozen=True)
class Call:
  """One parsed call (`name`, `arguments`), or `error` when the markup could not be read as a call."""

  name: str = ""
  arguments: Any = None
  error: str = ""


class CallParser:
  """The markup of one model family: the stop string that ends a tool-call turn and the environment turn's wrapper."""

  def __init__(self, family: str = "qwen"):
    self.parser = tool_parser_registry.get_tool_parser(family)()
    self.begin = self.parser.tool_call_begin
    self.end = self.parser.tool_call_end
    self.output_begin = self.parser.tool_output_begin
    self.output_end = self.parser.tool_output_end

  def ends_with_call(self, text: str) -> bool:
    """Whether an assistant turn stopped on the call's closing tag (the turn then asks for a tool)."""
    return text.rstrip().endswith(self.end)

  def call(self, text: str) -> Call:
    """The call that `text` (a turn ending with the closing tag) asks for."""
    head = text[: text.rstrip().rfind(self.end)]
    start = head.rfind(self.begin)
    if start < 0:
      return Call(error=f"{self.end} without {self.begin}")
    block = head[start:] + self.end
    try:
      with contextlib.redirect_stdout(io.StringIO()):  # Tunix prints each block it cannot decode
        calls = self.parser.parse(block)
    except (KeyError, TypeError) as e:
      return Call(error=f"a tool call needs 'name' and 'arguments' ({type(e).__name__}: {e})")
    if not calls:
      return Call(error="the tool call is not valid JSON")
    return Call(name=str(calls[0].name), arguments=calls[0].arguments)

  def observation(self, text: str) -> str:
    """The environment turn that carries a tool's result back to the model."""
    return f"{self.output_begin}{text}{self.output_end}\n"
