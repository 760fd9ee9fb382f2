"""`python -m maxtext_rl_plugin.bench <name> [args]`: run one benchmark module's `main(argv)`.

Each benchmark measures the plugin and its baseline side by side in one run and ends with one JSON
line of results, so ratios are comparable on whatever machine runs it.
"""

import importlib
import sys

from maxtext_rl_plugin.errors import exit_on_user_error

BENCHMARKS = {
    "rewards": "maxtext_rl_plugin.bench.rewards",
    "rollout": "maxtext_rl_plugin.bench.rollout",
    "reshard": "maxtext_rl_plugin.bench.reshard",
    "async": "maxtext_rl_plugin.bench.async_rollout",
    "peak": "maxtext_rl_plugin.bench.peak",
    "lora": "maxtext_rl_plugin.bench.lora",
    "step": "maxtext_rl_plugin.bench.step",
    "gpu": "maxtext_rl_plugin.bench.gpu",
    "agentic": "maxtext_rl_plugin.bench.agentic",
    "moe": "maxtext_rl_plugin.bench.moe",
    "packing": "maxtext_rl_plugin.bench.packing",
}


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] not in BENCHMARKS:
    print(f"usage: python -m maxtext_rl_plugin.bench {{{','.join(BENCHMARKS)}}} [--help]", file=sys.stderr)
    return 2
  # A benchmark's config and argument mistakes (an unknown flag, `batch_size=abc`) are one `error:` line, exit 2, as
  # for train_rl: every benchmark reads its config through the same loader.
  with exit_on_user_error():
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
  sys.exit(main())
