"""`python -m maxtext_rl_plugin.compile_rl <config.yml> compile_topology=v5p-128 [key=value ...]`: the RL run's
programs compiled for a TPU topology on this host, per-device HBM and a fit verdict, instead of training.

MaxText has `train_compile` beside `train`; this is `train_rl` with `compile_topology` required (the same command
line, the same keys, with MaxText's meaning: `compile_topology` a name of MaxText's `accelerator_to_spec_map`,
`compile_topology_num_slices` its slice count). Needs libtpu (`pip install 'maxtext-rl-plugin[aot]'`); no TPU,
checkpoint, tokenizer or data is opened. What it compiles and reports: docs/aot.md.
"""

from __future__ import annotations

import sys
from typing import Sequence

from maxtext_rl_plugin.config import precheck as config_precheck
from maxtext_rl_plugin import errors
from maxtext_rl_plugin.config.unresolved import Unresolved
from maxtext_rl_plugin import train_rl


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point; `argv` excludes the program name."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0
  if not asks_topology(argv):
    print(
        "error: compile_topology=<MaxText topology name, e.g. v5p-128> is required (on the command line or in the yml)",
        file=sys.stderr,
        flush=True,
    )
    return 2
  return train_rl.main(argv)


def asks_topology(argv: Sequence[str]) -> bool:
  """Whether the command line or the yml chain sets compile_topology (train_rl accepts either); a config the first
  pass refuses is left to train_rl, which says what is wrong in its one line."""
  if any(a.startswith("compile_topology=") and a != "compile_topology=" for a in argv):
    return True
  if any(a.startswith("compile_topology=") for a in argv):
    return False  # cleared on the command line
  try:
    view = config_precheck.precheck(argv)
  except errors.UserError:
    return True
  try:
    return bool(view.compile_topology)
  except Unresolved:
    return "compile_topology" in view


if __name__ == "__main__":
  sys.exit(main())
