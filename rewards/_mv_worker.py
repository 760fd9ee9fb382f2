"""math_verify worker process: `python -m maxtext_rl_plugin.rewards._mv_worker` (started by verify.MathVerifyPool).

Reads `{"g": gold, "p": pred}` JSON lines on stdin and answers "1"/"0" per line. It prints "ready" once
the imports are warm, so start-up is not charged to the first item's deadline. Kept apart from
verify.py so the worker imports nothing but math_verify/sympy.
"""

# math_verify is imported in the worker's main so that a missing install is reported to the parent as "broken"
# (non-numeric answers then score as wrong) instead of the worker dying on import.
# pylint: disable=import-outside-toplevel

import json
import sys


def math_verify_equal(gold: str, pred: str) -> bool:
  """math_verify's parse + verify on `\\boxed{}`-wrapped strings (the way MaxText feeds it)."""
  from math_verify import parse
  from math_verify import verify
  from math_verify.parser import ExprExtractionConfig
  from math_verify.parser import LatexExtractionConfig

  targets = (ExprExtractionConfig(), LatexExtractionConfig())

  def wrap(s: str) -> str:
    return s if s.startswith("\\boxed{") else "\\boxed{" + s + "}"

  golds = parse(wrap(gold), targets, parsing_timeout=None)
  preds = parse(wrap(pred), targets, parsing_timeout=None)
  if not golds or not preds:
    return False
  return bool(verify(golds, preds, timeout_seconds=None))


def main() -> int:
  out = sys.stdout
  try:
    math_verify_equal("1", "1")  # import and warm math_verify/sympy before the first timed item
  except Exception:  # pylint: disable=broad-exception-caught
    out.write("broken\n")
    out.flush()
    return 1
  out.write("ready\n")
  out.flush()
  for line in sys.stdin:
    try:
      item = json.loads(line)
      ok = math_verify_equal(item["g"], item["p"])
    except Exception:  # pylint: disable=broad-exception-caught
      ok = False
    out.write("1\n" if ok else "0\n")
    out.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
