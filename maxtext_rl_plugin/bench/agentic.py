"""`python -m maxtext_rl_plugin.bench agentic`: what re-prefilling the transcript costs a multi-turn episode's turn.

The embedded engine continues an episode by prefilling its whole transcript again (rollout/embedded.py,
`generate_turn`), not by appending the environment's tokens to the previous turn's KV cache. This measures the price
of that choice on the configured model: for each context length L (the transcript a later turn starts from) and
batch B, the wall time of a turn that generates T tokens (stop tokens ignored: every row does the same work) and of
one that generates 1 token (prefill + 1 step); `prefill_share` = t(1) / t(T) bounds what KV reuse could save on that
turn (it would remove at most the re-prefill of the part already cached). Compilation is excluded (one warm-up call
per shape); times are the median of `--repeats`.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from maxtext_rl_plugin.bench import common
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin.rollout import embedded
from maxtext_rl_plugin.run import engine as run_engine


def main(argv=None) -> int:
  ap = common.ArgumentParser(prog="python -m maxtext_rl_plugin.bench agentic")
  ap.add_argument("--config", default="configs/cpu_demo_tools.yml")
  ap.add_argument(
      "--contexts", type=common.positive_ints, default="48,128,512", help="comma-separated transcript lengths L"
  )
  ap.add_argument("--batch", type=common.positive_int, default=16)
  ap.add_argument("--new-tokens", type=common.positive_int, default=24)
  ap.add_argument("--repeats", type=common.positive_int, default=3)
  args, overrides = ap.parse_known_args(argv)
  rs = models.setup_devices(config_lib.parse([args.config, *overrides]))
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(rs.trainer_config))
  model, mesh = models.build_model(rs.sampler_config, rs.sampler_devices, pad_id=tok.pad_token_id)
  engine = embedded.EmbeddedRollout(
      rollout_actor=model, tokenizer=tok, mesh=mesh, **run_engine.embedded_arguments(rs.sampler_config, mesh)
  )
  rng = np.random.default_rng(0)
  rows = []
  print(f"{'L':>6}{'B':>5}{'T':>5}{'turn s':>10}{'prefill+1 s':>13}{'prefill_share':>15}")
  for length in args.contexts:
    ctx = [list(rng.integers(10, 500, length)) for _ in range(args.batch)]

    def turn(n, ctx=ctx):
      return engine.generate_tokens(ctx, max_new_tokens=n, greedy=True, ignore_stop=True, rng=jax.random.PRNGKey(0))

    times = {}
    for n in (args.new_tokens, 1):
      turn(n)  # compile
      samples = []
      for _ in range(args.repeats):
        t = time.perf_counter()
        turn(n)
        samples.append(time.perf_counter() - t)
      times[n] = statistics.median(samples)
    share = times[1] / times[args.new_tokens]
    rows.append(
        {"L": length, "B": args.batch, "T": args.new_tokens, "turn_s": times[args.new_tokens], "prefill_1_s": times[1]}
    )
    rows[-1]["prefill_share"] = share
    print(f"{length:>6}{args.batch:>5}{args.new_tokens:>5}{times[args.new_tokens]:>10.3f}{times[1]:>13.3f}{share:>15.2f}")
  print(common.finite_json({"bench": "agentic", "config": args.config, "rows": rows}))
  return 0
