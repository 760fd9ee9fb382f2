"""`python -m maxtext_rl_plugin.rewards score --input IN.jsonl --output OUT.jsonl` (see cli.py)."""

import sys

from maxtext_rl_plugin.rewards.cli import main

if __name__ == "__main__":
  sys.exit(main())
