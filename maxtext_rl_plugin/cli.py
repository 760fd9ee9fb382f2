"""`maxtext-rl` console script: one front door to the plugin's commands.

maxtext-rl train <config.yml> [key=value ...]   (= python -m maxtext_rl_plugin.train_rl)
maxtext-rl score --input IN.jsonl --output OUT.jsonl
maxtext-rl export-lora --output DIR [--step N] <config.yml> [key=value ...]   (merged LoRA weights)
maxtext-rl bench {rewards,rollout,reshard,lora} ...
maxtext-rl launch {xpk,xpk-delete,xpk-list,ray} ...
maxtext-rl list                                  (registered configs, rewards, engines)
"""

# Each subcommand's module is imported when that subcommand runs: train_rl and export-lora import JAX, MaxText
# and Tunix (seconds), which `maxtext-rl score` or `--help` should not pay for.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import sys


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(__doc__)
    return 0 if argv else 2
  cmd, rest = argv[0], argv[1:]
  if cmd == "train":
    from maxtext_rl_plugin import train_rl

    return train_rl.main(rest)
  if cmd == "score":
    from maxtext_rl_plugin.rewards import __main__ as score

    return score.main(["score", *rest])
  if cmd == "export-lora":
    from maxtext_rl_plugin import export_lora

    return export_lora.main(rest)
  if cmd == "bench":
    from maxtext_rl_plugin.bench import __main__ as bench

    return bench.main(rest)
  if cmd == "launch":
    from maxtext_rl_plugin.launch import __main__ as launch

    return launch.main(rest)
  if cmd == "list":
    from maxtext_rl_plugin import registry

    for group, names in registry.describe().items():
      print(f"{group}: {', '.join(names) or '(none)'}")
    return 0
  print(f"error: unknown command '{cmd}' (expected train, score, export-lora, bench, launch or list)", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
