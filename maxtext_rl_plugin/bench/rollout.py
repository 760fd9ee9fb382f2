"""`python -m maxtext_rl_plugin.bench rollout`: embedded KV-cache engine vs. no-cache recompute loops.

Same model, same prompts, greedy, every row generates exactly `--new-tokens` (stop tokens ignored so
all sides do the same work). Two baselines, each one jitted `fori_loop` over a buffer of width
prompt + new tokens (left-padded prompts, future columns masked by segment id):
* `recompute`: each step is the full TunixMaxTextAdapter forward (logits for every position), i.e. the
  no-cache loop the issue asks for. It is quadratic and its cost is mostly the 150k-vocab projection of
  every position, so it is skipped above `--recompute-max-batch`.
* `recompute_lastpos`: the decoder over the whole buffer but the output head on the current position only;
  the gap to it is what the KV cache itself saves (small on the 2-layer tiny model, whose cost is the head).
Compile time is measured separately (AOT lower + compile) and excluded from tokens/s; tokens/s is the
best of `--repeats` (engine) / `--recompute-repeats` (baselines) runs.

With random init (no load_parameters_path) the decoder weights are scaled by `--decoder-scale`
(default 3) so greedy continuations depend on the context and `greedy_match` means something; at init
scale a random model repeats one token. Speed does not depend on the weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

_QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "What is 17 * 23?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her "
    "parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much "
    "more money does Betty need to buy the wallet?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
    "Solve for x: 3x + 5 = 20.",
]


def _prompts(tok, n: int) -> list[list[int]]:
  return [tok.encode(f"Question {i}: {_QUESTIONS[i % len(_QUESTIONS)]}\nAnswer:") for i in range(n)]


def _recompute_program(model, prompt_len: int, new_tokens: int, last_position_only: bool):
  """Jitted greedy loop without a cache: each step re-runs the forward over the whole buffer.

  `last_position_only=False` is the plain no-cache loop through the TunixMaxTextAdapter (logits for every
  position, as a trainer-style forward returns them). `True` runs the decoder over the buffer but the
  output head on the current position only, isolating what the KV cache itself saves.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  graphdef, _ = nnx.split(model)
  width = prompt_len + new_tokens

  def run(state, toks, lens):
    col = jnp.arange(width)[None, :]

    def body(s, toks):
      m = nnx.merge(graphdef, state)
      cur = prompt_len + s  # filled columns
      seg = ((col >= prompt_len - lens[:, None]) & (col < cur)).astype(jnp.int32)
      pos = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0)
      if last_position_only:
        base = m.base
        _, hidden, _ = base.decoder(shared_embedding=base.token_embedder, decoder_input_tokens=toks, decoder_positions=pos,
                                    decoder_segment_ids=seg, deterministic=True)[:3]
        h = jax.lax.dynamic_slice_in_dim(hidden, cur - 1, 1, axis=1)
        last = base.logits_from_hidden_states_for_vocab_tiling(h, deterministic=True, model_mode="train")[:, 0]
      else:
        logits, _ = m(toks, pos, None, None, decoder_segment_ids=seg)
        last = jax.lax.dynamic_index_in_dim(logits, cur - 1, axis=1, keepdims=False)
      nxt = jnp.argmax(last, axis=-1)
      return jax.lax.dynamic_update_index_in_dim(toks, nxt.astype(toks.dtype), cur, axis=1)

    return jax.lax.fori_loop(0, new_tokens, body, toks)[:, prompt_len:]

  return run


def _time_recompute(model, mesh, cfg, prompts, pad_id, T, last_position_only, repeats):
  """(tokens, best seconds, compile seconds) of the recompute loop."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from flax.core.spmd import logical_axis_rules  # pylint: disable=import-outside-toplevel

  B, lp = len(prompts), max(len(p) for p in prompts)
  toks = np.full((B, lp + T), pad_id, np.int32)
  for i, p in enumerate(prompts):
    toks[i, lp - len(p): lp] = p
  lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
  toks = jnp.asarray(toks)
  state = nnx.state(model)
  with mesh, logical_axis_rules(cfg.logical_axis_rules):
    s = time.perf_counter()
    run = jax.jit(_recompute_program(model, lp, T, last_position_only)).lower(state, toks, lens).compile()
    compile_s = time.perf_counter() - s
    best = float("inf")
    for _ in range(repeats):
      s = time.perf_counter()
      out = np.asarray(run(state, toks, lens))
      best = min(best, time.perf_counter() - s)
  return out, best, compile_s


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m maxtext_rl_plugin.bench rollout", description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/cpu_tiny.yml", help="plugin/MaxText yml (default: the tiny CPU model)")
  ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
  ap.add_argument("--batch-sizes", default="1,8,32", help="comma-separated rollout batch sizes")
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3, help="timed engine runs per batch size (best is reported)")
  ap.add_argument("--recompute-repeats", type=int, default=1, help="timed runs of each recompute baseline")
  ap.add_argument("--recompute-max-batch", type=int, default=8,
                  help="skip the full-logits recompute baseline above this batch size (it is quadratic: B x (prompt + "
                       "new) x vocab per step; ~10 min at 32 x 128 on 2 cores)")
  ap.add_argument("--decoder-scale", type=float, default=3.0, help="random-init decoder weight scale (see docstring)")
  args = ap.parse_args(argv)
  if args.new_tokens < 1:
    ap.error("--new-tokens must be >= 1")
  batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]

  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from maxtext_rl_plugin import models  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.errors import UserError  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.rollout import embedded  # pylint: disable=import-outside-toplevel

  t0 = time.perf_counter()
  try:
    rs = models.setup_devices([args.config, *args.overrides])
    tok = models.load_tokenizer(rs.trainer_config)
    model, mesh = models.build_model(rs.sampler_config, rs.sampler_devices, pad_id=tok.pad_token_id)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  cfg = rs.sampler_config
  if not cfg.load_parameters_path and args.decoder_scale != 1.0:
    scale = lambda path, x: x * args.decoder_scale if "decoder" in [getattr(k, "key", None) for k in path] and x.ndim >= 2 else x  # noqa: E731
    nnx.update(model, jax.tree_util.tree_map_with_path(scale, nnx.state(model, nnx.Param)))
  engine = embedded.EmbeddedRollout(rollout_actor=model, tokenizer=tok, mesh=mesh, config=cfg)
  print(f"model {cfg.model_name} ({cfg.num_decoder_layers} layers, emb {cfg.emb_dim}, vocab {cfg.vocab_size}) on "
        f"{len(rs.sampler_devices)} {jax.devices()[0].platform} device(s); setup {time.perf_counter() - t0:.1f}s",
        flush=True)

  T = args.new_tokens
  rows = []
  for B in batch_sizes:
    prompts = _prompts(tok, B)
    # Engine: first call compiles (timed separately inside the engine), then timed runs.
    c0 = engine.compile_seconds
    res = engine.generate_tokens(prompts, greedy=True, max_new_tokens=T, ignore_stop=True)
    compile_s = engine.compile_seconds - c0
    times = []
    for _ in range(args.repeats):
      s = time.perf_counter()
      res = engine.generate_tokens(prompts, greedy=True, max_new_tokens=T, ignore_stop=True)
      times.append(time.perf_counter() - s)
    eng_tps = B * T / min(times)
    row = {"batch": B, "new_tokens": int(res.lengths.min()), "engine_tokens_per_s": round(eng_tps, 1),
           "engine_seconds": round(min(times), 3), "engine_compile_seconds": round(compile_s, 2)}

    for name, last_only, limit in (("recompute", False, args.recompute_max_batch), ("recompute_lastpos", True, 1 << 30)):
      if B > limit:
        continue
      ref, secs, rc_compile = _time_recompute(model, mesh, cfg, prompts, tok.pad_token_id, T, last_only,
                                              args.recompute_repeats)
      match = bool(np.array_equal(ref, res.tokens))
      row.update({f"{name}_tokens_per_s": round(B * T / secs, 1), f"{name}_seconds": round(secs, 3),
                  f"{name}_compile_seconds": round(rc_compile, 2), f"{name}_speedup": round(eng_tps * secs / (B * T), 2),
                  f"{name}_greedy_match": match,
                  f"{name}_first_mismatch_step": None if match else int(np.argmax((ref != res.tokens).any(0)))})
    rows.append(row)
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)

  print()
  print(f"{'batch':>6} {'engine tok/s':>13} {'recompute tok/s':>16} {'x':>6} {'lastpos tok/s':>14} {'x':>6} "
        f"{'match':>6} {'compile s':>10}")
  nan = float("nan")
  for r in rows:
    matches = [v for k, v in r.items() if k.endswith("greedy_match")]
    print(f"{r['batch']:>6} {r['engine_tokens_per_s']:>13.1f} {r.get('recompute_tokens_per_s', nan):>16.1f} "
          f"{r.get('recompute_speedup', nan):>6.2f} {r.get('recompute_lastpos_tokens_per_s', nan):>14.1f} "
          f"{r.get('recompute_lastpos_speedup', nan):>6.2f} {str(all(matches)):>6} {r['engine_compile_seconds']:>10.1f}")
  head = max((r for r in rows if "recompute_speedup" in r), key=lambda r: r["batch"], default=rows[-1])
  summary = {
      "benchmark": "rollout",
      "model": cfg.model_name,
      "new_tokens": min(r["new_tokens"] for r in rows),
      "batch": head["batch"],
      "engine_tokens_per_s": head["engine_tokens_per_s"],
      "recompute_tokens_per_s": head.get("recompute_tokens_per_s"),
      "speedup": head.get("recompute_speedup"),
      "recompute_lastpos_tokens_per_s": head.get("recompute_lastpos_tokens_per_s"),
      "speedup_vs_lastpos": head.get("recompute_lastpos_speedup"),
      "greedy_match": all(v for r in rows for k, v in r.items() if k.endswith("greedy_match")),
      "engine_tokens_per_s_by_batch": {str(r["batch"]): r["engine_tokens_per_s"] for r in rows},
      "engine_compile_seconds": round(sum(r["engine_compile_seconds"] for r in rows), 2),
      "engine_compile_count": engine.compile_count,
      "by_batch": rows,
  }
  print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
