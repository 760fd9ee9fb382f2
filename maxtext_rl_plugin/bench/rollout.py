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
median of `--repeats` (engine, Tunix) / best of `--recompute-repeats` (baselines) runs.

Peer: Tunix 0.1.7's KV-cache `Sampler` (what its vanilla rollout runs). It cannot drive the MaxText model
(`TunixMaxTextAdapter` rejects the sampler's [B, L, cache] attention mask and returns no cache; the exact
error is printed and in the JSON), so it runs Tunix-native Qwen3 copies of the same shape holding the same
weights: Tunix's own tied Qwen3 (the speed peer, `speedup_vs_tunix`), and one whose output head reproduces MaxText
0.2.5's bfloat16 rounding of the tied table (`tunix_qwen3_like`), the same function as the MaxText model, against
which `tunix_greedy_match` checks token identity and `tunix_teacher_forced` compares logits step by step. Roofline:
achieved decode FLOP/s (2 x per-token params x tokens + attention, `peak.py`) as a fraction of an in-run matmul peak.

With random init (no load_parameters_path) the decoder weights are scaled by `--decoder-scale`
(default 3) so greedy continuations depend on the context and `greedy_match` means something; at init
scale a random model repeats one token. Speed does not depend on the weights.
"""

from __future__ import annotations

import argparse
import sys
import time

from flax import nnx
from flax.core.spmd import logical_axis_rules
import jax
import jax.numpy as jnp
import numpy as np
from tunix.generate import sampler as tunix_sampler
from tunix.models.qwen3 import model as q3

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin.bench import common
from maxtext_rl_plugin.bench import peak as bench_peak
from maxtext_rl_plugin.errors import UserError
from maxtext_rl_plugin.rollout import embedded
from maxtext_rl_plugin.run import engine as run_engine

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


def _prompt_texts(n: int) -> list[str]:
  return [f"Question {i}: {_QUESTIONS[i % len(_QUESTIONS)]}\nAnswer:" for i in range(n)]


def _prompts(tok, n: int) -> list[list[int]]:
  return [tok.encode(t) for t in _prompt_texts(n)]


def _recompute_program(model, prompt_len: int, new_tokens: int, last_position_only: bool):
  """Jitted greedy loop without a cache: each step re-runs the forward over the whole buffer.

  `last_position_only=False` is the plain no-cache loop through the TunixMaxTextAdapter (logits for every
  position, as a trainer-style forward returns them). `True` runs the decoder over the buffer but the
  output head on the current position only, isolating what the KV cache itself saves.
  """

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
        _, hidden, _ = base.decoder(
            shared_embedding=base.token_embedder,
            decoder_input_tokens=toks,
            decoder_positions=pos,
            decoder_segment_ids=seg,
            deterministic=True,
        )[:3]
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

  B, lp = len(prompts), max(len(p) for p in prompts)
  toks = np.full((B, lp + T), pad_id, np.int32)
  for i, p in enumerate(prompts):
    toks[i, lp - len(p) : lp] = p
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


def _tunix_error(model, tok, cfg, mesh) -> str:
  """The exact error of Tunix's `Sampler` driving the MaxText model through `TunixMaxTextAdapter` (or "")."""

  s = tunix_sampler.Sampler(model, tok, _tunix_cache_config(cfg, 64))
  try:
    with mesh:
      s(["What is 17 * 23?"], max_generation_steps=2, max_prompt_length=16, temperature=0.0, echo=False)
  except Exception as e:  # pylint: disable=broad-exception-caught  # any failure is the recorded answer
    return f"{type(e).__name__}: {e}"
  return ""


def _tunix_cache_config(cfg, cache_size: int):

  return tunix_sampler.CacheConfig(
      cache_size=cache_size,
      num_layers=int(cfg.num_decoder_layers),
      num_kv_heads=int(cfg.num_kv_heads),
      head_dim=int(cfg.head_dim),
  )


def tunix_qwen3_like(model, cfg, maxtext_head: bool = True):
  """A Tunix-native `Qwen3` of the MaxText model's shape holding the MaxText model's weights (copied).

  MaxText's scanned layers keep the layer on axis 1 of every decoder kernel; Tunix keeps one module per
  layer. Projections, norms and the input embedding map one to one. The output head does not: MaxText 0.2.5's
  tied head (`embeddings.attend_on_embedding`) rounds the embedding table to bfloat16 whatever `dtype` says, while
  Tunix's tied head uses the table as it is -- logits ~2e-3 apart (relative), enough to flip greedy near-ties after a
  few dozen tokens. So with `maxtext_head` the copy gets an untied `lm_head` holding the bfloat16-rounded table (in
  float32), which computes what MaxText's head computes; without it, the copy is Tunix's own tied Qwen3 (the shape
  Qwen3-0.6B has), the peer a user would run.
  """

  if not cfg.scan_layers or not cfg.logits_via_embedding:
    raise NotImplementedError("the Tunix Qwen3 copy needs scan_layers=true and tied embeddings")
  tc = q3.ModelConfig(
      num_layers=int(cfg.num_decoder_layers),
      vocab_size=int(cfg.vocab_size),
      embed_dim=int(cfg.emb_dim),
      hidden_dim=int(cfg.mlp_dim),
      num_heads=int(cfg.num_query_heads),
      head_dim=int(cfg.head_dim),
      num_kv_heads=int(cfg.num_kv_heads),
      rope_theta=int(cfg.rope_max_timescale),
      norm_eps=float(cfg.normalization_layer_epsilon),
      use_tied_embedding=not maxtext_head,
  )
  t = nnx.eval_shape(lambda: q3.Qwen3(tc, rngs=nnx.Rngs(0)))
  src = nnx.to_pure_dict(nnx.state(model, nnx.Param))["base"]
  dec, lay = src["decoder"], src["decoder"]["layers"]
  a = jnp.asarray
  table = a(src["token_embedder"]["embedding"])
  dst = {
      "embedder": {"input_embedding": table},
      "final_norm": {"w": a(dec["decoder_norm"]["scale"])},
      "layers": {},
  }
  if maxtext_head:
    dst["lm_head"] = {"w": table.astype(jnp.bfloat16).astype(table.dtype).T}
  for i in range(tc.num_layers):
    sa = lay["self_attention"]
    dst["layers"][i] = {
        "attn": {
            "q_proj": {"w": a(sa["query"]["kernel"][:, i])},
            "k_proj": {"w": a(sa["key"]["kernel"][:, i])},
            "v_proj": {"w": a(sa["value"]["kernel"][:, i])},
            "o_proj": {"w": a(sa["out"]["kernel"][:, i])},
            "q_norm": {"w": a(sa["query_norm"]["scale"][:, i])},
            "k_norm": {"w": a(sa["key_norm"]["scale"][:, i])},
        },
        "input_layernorm": {"w": a(lay["pre_self_attention_layer_norm"]["scale"][:, i])},
        "post_attention_layernorm": {"w": a(lay["post_self_attention_layer_norm"]["scale"][:, i])},
        "mlp": {
            "gate_proj": {"kernel": a(lay["mlp"]["wi_0"]["kernel"][:, i])},
            "up_proj": {"kernel": a(lay["mlp"]["wi_1"]["kernel"][:, i])},
            "down_proj": {"kernel": a(lay["mlp"]["wo"]["kernel"][:, i])},
        },
    }
  graphdef, state = nnx.split(t)
  nnx.replace_by_pure_dict(state, dst)
  return nnx.merge(graphdef, state)


FLOAT_TIE_RTOL = 1e-4  # two float32 implementations of one model: logits apart by rounding, ~1e-6 of their size


def teacher_forced_agreement(model, tmodel, cfg, mesh, prompts, completions, rows: int = 8) -> dict:
  """Both models scored on the plugin's own greedy sequences (prompt + completion, one forward each, no cache): how
  far their logits are apart, and whether every step where their argmax differs is a float tie.

  Free-running greedy decoding compounds: once one near-tied argmax flips, the two continuations differ from then on,
  so a first-mismatch step alone cannot tell a rounding tie from a wrong model. Teacher forcing compares every step on
  the same context. A disagreement is a tie when the gap between the two models' chosen tokens, in either model's
  logits, is within the largest logit difference between the models (`max_abs_logit_diff`); the verdict
  `identical_up_to_ties` also needs that difference to be float32 rounding (`FLOAT_TIE_RTOL` of the largest logit),
  which a wrong weight copy or a wrong model far exceeds.
  """
  stats = {"positions": 0, "max_abs_logit_diff": 0.0, "max_abs_logit": 0.0}
  gaps = []
  for prompt, completion in list(zip(prompts, completions))[:rows]:
    toks = jnp.asarray(np.concatenate([np.asarray(prompt), np.asarray(completion)])[None].astype(np.int32))
    n = toks.shape[1]
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    with mesh, logical_axis_rules(cfg.logical_axis_rules):
      lm, _ = model(toks, pos, None, None, decoder_segment_ids=jnp.ones_like(toks))
    lt, _ = tmodel(toks, pos, None, jnp.tril(jnp.ones((1, n, n), jnp.bool_)))
    # Logits at position p predict token p + 1: the completion's tokens are predicted from len(prompt) - 1 on.
    lm = np.asarray(lm[0, len(prompt) - 1 : n - 1], np.float64)
    lt = np.asarray(lt[0, len(prompt) - 1 : n - 1], np.float64)
    am, at = lm.argmax(-1), lt.argmax(-1)
    stats["positions"] += len(am)
    stats["max_abs_logit_diff"] = max(stats["max_abs_logit_diff"], float(np.abs(lm - lt).max()))
    stats["max_abs_logit"] = max(stats["max_abs_logit"], float(np.abs(lm).max()))
    for p in np.nonzero(am != at)[0]:
      gap = max(lm[p, am[p]] - lm[p, at[p]], lt[p, at[p]] - lt[p, am[p]])
      gaps.append(float(gap))
  stats["argmax_disagreements"] = len(gaps)
  stats["max_gap_at_disagreement"] = max(gaps, default=0.0)
  stats["all_disagreements_are_ties"] = all(g <= stats["max_abs_logit_diff"] for g in gaps)
  stats["identical_up_to_ties"] = stats["all_disagreements_are_ties"] and (
      stats["max_abs_logit_diff"] <= FLOAT_TIE_RTOL * stats["max_abs_logit"]
  )
  return {k: round(v, 8) if isinstance(v, float) else v for k, v in stats.items()}


def _time_tunix(tmodel, tok, cfg, prompts_text, T, repeats):
  """(tokens [B, T], best seconds, first-call seconds) of Tunix's KV-cache `Sampler`, greedy, no early stop."""

  lp = max(len(tok.encode(p)) for p in prompts_text)
  s = tunix_sampler.Sampler(tmodel, tok, _tunix_cache_config(cfg, lp + T + 8))
  kw = {"max_generation_steps": T, "max_prompt_length": lp, "temperature": 0.0, "echo": False, "eos_tokens": [-1]}
  t0 = time.perf_counter()
  out = s(prompts_text, **kw)
  first = time.perf_counter() - t0
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = s(prompts_text, **kw)
    best = min(best, time.perf_counter() - t0)
  toks = np.full((len(prompts_text), T), -1, np.int64)
  for i, r in enumerate(out.tokens):
    r = np.asarray(r)[:T]
    toks[i, : len(r)] = r
  return toks, best, first


def _parse_args(argv):
  """The command line (flags documented in --help)."""
  ap = common.ArgumentParser(prog="python -m maxtext_rl_plugin.bench rollout", description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/cpu_tiny.yml", help="plugin/MaxText yml (default: the tiny CPU model)")
  ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
  ap.add_argument("--batch-sizes", type=common.positive_ints, default="1,8,32", help="comma-separated batch sizes")
  ap.add_argument("--new-tokens", type=common.positive_int, default=128)
  ap.add_argument("--repeats", type=common.positive_int, default=3, help="timed engine runs per batch size (best)")
  ap.add_argument("--recompute-repeats", type=common.positive_int, default=1, help="timed runs of each baseline")
  ap.add_argument(
      "--recompute-max-batch",
      type=common.non_negative_int,
      default=8,
      help="skip the full-logits recompute baseline above this batch size (it is quadratic: B x (prompt + "
      "new) x vocab per step; ~10 min at 32 x 128 on 2 cores)",
  )
  ap.add_argument(
      "--tunix",
      action=argparse.BooleanOptionalAction,
      default=True,
      help="also time Tunix's own KV-cache Sampler (on a Tunix Qwen3 with the same weights)",
  )
  ap.add_argument(
      "--peak-n", type=common.positive_int, default=1024, help="matmul size of the in-run peak FLOP/s measurement"
  )
  ap.add_argument(
      "--decoder-scale", type=common.positive_float, default=3.0, help="random-init decoder weight scale (see docstring)"
  )
  return ap.parse_args(argv)


def _build(args):
  """(config, tokenizer, model, mesh, engine, sampler device count): the sampler-side model and its engine."""
  t0 = time.perf_counter()
  rs = models.setup_devices(config_lib.parse([args.config, *args.overrides]))
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(rs.trainer_config))
  model, mesh = models.build_model(rs.sampler_config, rs.sampler_devices, pad_id=tok.pad_token_id)
  cfg = rs.sampler_config
  if not cfg.load_parameters_path and args.decoder_scale != 1.0:

    def scale(path, x):
      in_decoder = "decoder" in [getattr(k, "key", None) for k in path]
      return x * args.decoder_scale if in_decoder and x.ndim >= 2 else x

    nnx.update(model, jax.tree_util.tree_map_with_path(scale, nnx.state(model, nnx.Param)))
  engine = embedded.EmbeddedRollout(
      rollout_actor=model, tokenizer=tok, mesh=mesh, **run_engine.embedded_arguments(cfg, mesh)
  )
  print(
      f"model {cfg.model_name} ({cfg.num_decoder_layers} layers, emb {cfg.emb_dim}, vocab {cfg.vocab_size}) on "
      f"{len(rs.sampler_devices)} {jax.devices()[0].platform} device(s); setup {time.perf_counter() - t0:.1f}s",
      flush=True,
  )
  return cfg, tok, model, mesh, engine


def _first_mismatch(ref: np.ndarray, tokens: np.ndarray) -> int | None:
  """The first decode step at which any row of `ref` differs from `tokens` [B, T]; None when they are identical."""
  return None if np.array_equal(ref, tokens) else int(np.argmax((ref != tokens).any(0)))


def _measure_batch(args, batch, ctx, peak, tmodels) -> dict:
  """One batch size: the engine and Tunix's sampler on both Tunix copies (interleaved, same repetitions), then the
  recompute baselines. `tmodels`: (Tunix's tied Qwen3, the copy with MaxText's head rounding) or None."""
  cfg, tok, model, mesh, engine = ctx
  T = args.new_tokens
  prompts = _prompts(tok, batch)
  texts = _prompt_texts(batch)
  # Engine: first call compiles (timed separately inside the engine), then timed runs, interleaved with
  # Tunix's sampler when it runs (same repetitions side by side; shared cores make medians the figure).
  c0 = engine.compile_seconds
  res = engine.generate_tokens(prompts, greedy=True, max_new_tokens=T, ignore_stop=True)
  compile_s = engine.compile_seconds - c0
  times, ttimes = [], {"tied": [], "maxtext_head": []}
  first = {}
  if tmodels is not None:
    tied_toks, _, first["tied"] = _time_tunix(tmodels[0], tok, cfg, texts, T, 0)
    tunix_toks, _, first["maxtext_head"] = _time_tunix(tmodels[1], tok, cfg, texts, T, 0)
  for _ in range(args.repeats):
    s = time.perf_counter()
    res = engine.generate_tokens(prompts, greedy=True, max_new_tokens=T, ignore_stop=True)
    times.append(time.perf_counter() - s)
    if tmodels is not None:
      for name, tm in zip(ttimes, tmodels):
        ttimes[name].append(_time_tunix(tm, tok, cfg, texts, T, 1)[1])
  eng_s = float(np.median(times))
  eng_tps = batch * T / eng_s
  lp = max(len(p) for p in prompts)
  flops = bench_peak.decode_flops(cfg, batch, lp, T)
  row = {
      "batch": batch,
      "new_tokens": int(res.lengths.min()),
      "engine_tokens_per_s": round(eng_tps, 1),
      "engine_seconds": round(eng_s, 3),
      "engine_compile_seconds": round(compile_s, 2),
      "engine_flops_per_s": round(flops / eng_s),
      "engine_fraction_of_peak": round(flops / eng_s / peak["peak_flops"], 4),
  }
  if tmodels is not None:
    t_s, x_s = float(np.median(ttimes["tied"])), float(np.median(ttimes["maxtext_head"]))
    mismatch, tied_mismatch = _first_mismatch(tunix_toks, res.tokens), _first_mismatch(tied_toks, res.tokens)
    row.update(
        {
            "tunix_tokens_per_s": round(batch * T / t_s, 1),
            "tunix_seconds": round(t_s, 3),
            "tunix_first_call_seconds": round(first["tied"], 2),
            "tunix_maxtext_head_first_call_seconds": round(first["maxtext_head"], 2),
            "speedup_vs_tunix": round(t_s / eng_s, 2),
            "tunix_fraction_of_peak": round(flops / t_s / peak["peak_flops"], 4),
            "tunix_maxtext_head_tokens_per_s": round(batch * T / x_s, 1),
            "speedup_vs_tunix_maxtext_head": round(x_s / eng_s, 2),
            # Token identity against the copy that computes MaxText's function (bf16-rounded tied head).
            "tunix_greedy_match": mismatch is None,
            "tunix_first_mismatch_step": mismatch,
            "tunix_tied_first_mismatch_step": tied_mismatch,
            "tunix_teacher_forced": teacher_forced_agreement(model, tmodels[1], cfg, mesh, prompts, res.tokens),
        }
    )

  for name, last_only, limit in (("recompute", False, args.recompute_max_batch), ("recompute_lastpos", True, 1 << 30)):
    if batch > limit:
      continue
    ref, secs, rc_compile = _time_recompute(
        model, mesh, cfg, prompts, tok.pad_token_id, T, last_only, args.recompute_repeats
    )
    mismatch = _first_mismatch(ref, res.tokens)
    row.update(
        {
            f"{name}_tokens_per_s": round(batch * T / secs, 1),
            f"{name}_seconds": round(secs, 3),
            f"{name}_compile_seconds": round(rc_compile, 2),
            f"{name}_speedup": round(eng_tps * secs / (batch * T), 2),
            f"{name}_greedy_match": mismatch is None,
            f"{name}_first_mismatch_step": mismatch,
        }
    )
  return row


def _print_table(rows) -> None:
  """The human-readable table (the JSON line that follows it holds every number)."""
  print()
  print(
      f"{'batch':>6} {'engine tok/s':>13} {'recompute tok/s':>16} {'x':>6} {'lastpos tok/s':>14} {'x':>6} "
      f"{'match':>6} {'compile s':>10}"
  )
  nan = float("nan")
  for r in rows:
    matches = [v for k, v in r.items() if k.endswith("greedy_match") and not k.startswith("tunix")]
    print(
        f"{r['batch']:>6} {r['engine_tokens_per_s']:>13.1f} {r.get('recompute_tokens_per_s', nan):>16.1f} "
        f"{r.get('recompute_speedup', nan):>6.2f} {r.get('recompute_lastpos_tokens_per_s', nan):>14.1f} "
        f"{r.get('recompute_lastpos_speedup', nan):>6.2f} {str(all(matches)):>6} {r['engine_compile_seconds']:>10.1f}"
    )


def _summary(args, cfg, engine, rows, peak, tunix_error) -> dict:
  """The final JSON line: the largest batch that ran every baseline as the headline, then every row."""
  head = max((r for r in rows if "recompute_speedup" in r), key=lambda r: r["batch"], default=rows[-1])
  return {
      "benchmark": "rollout",
      "model": cfg.model_name,
      "new_tokens": min(r["new_tokens"] for r in rows),
      "batch": head["batch"],
      "engine_tokens_per_s": head["engine_tokens_per_s"],
      "recompute_tokens_per_s": head.get("recompute_tokens_per_s"),
      "speedup": head.get("recompute_speedup"),
      "recompute_lastpos_tokens_per_s": head.get("recompute_lastpos_tokens_per_s"),
      "speedup_vs_lastpos": head.get("recompute_lastpos_speedup"),
      "greedy_match": all(
          v for r in rows for k, v in r.items() if k.endswith("greedy_match") and not k.startswith("tunix")
      ),
      "engine_tokens_per_s_by_batch": {str(r["batch"]): r["engine_tokens_per_s"] for r in rows},
      "engine_compile_seconds": round(sum(r["engine_compile_seconds"] for r in rows), 2),
      "engine_compile_count": engine.compile_count,
      **{k: v for k, v in peak.items() if k != "peak_seconds"},
      "engine_fraction_of_peak_by_batch": {str(r["batch"]): r["engine_fraction_of_peak"] for r in rows},
      "tunix_maxtext_error": tunix_error if args.tunix else None,
      "tunix_tokens_per_s_by_batch": {
          str(r["batch"]): r["tunix_tokens_per_s"] for r in rows if "tunix_tokens_per_s" in r
      },
      "speedup_vs_tunix_by_batch": {str(r["batch"]): r["speedup_vs_tunix"] for r in rows if "speedup_vs_tunix" in r},
      "speedup_vs_tunix_maxtext_head_by_batch": {
          str(r["batch"]): r["speedup_vs_tunix_maxtext_head"] for r in rows if "speedup_vs_tunix" in r
      },
      "tunix_greedy_match": all(r["tunix_greedy_match"] for r in rows) if args.tunix else None,
      "by_batch": rows,
  }


def main(argv=None) -> int:
  args = _parse_args(argv)
  try:
    ctx = _build(args)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  cfg, tok, model, mesh, engine = ctx
  peak = bench_peak.measure_peak_flops(args.peak_n)
  print(
      f"peak {peak['peak_flops'] / 1e9:.1f} GFLOP/s ({args.peak_n}^3 f32 matmul); per-token params "
      f"{bench_peak.param_counts(cfg)}",
      flush=True,
  )
  tunix_error, tmodels = "", None
  if args.tunix:
    tunix_error = _tunix_error(model, tok, cfg, mesh)
    print(f"Tunix Sampler on the MaxText model (TunixMaxTextAdapter): {tunix_error or 'ok'}", flush=True)
    tmodels = (tunix_qwen3_like(model, cfg, maxtext_head=False), tunix_qwen3_like(model, cfg, maxtext_head=True))
  rows = []
  for batch in args.batch_sizes:
    rows.append(_measure_batch(args, batch, ctx, peak, tmodels))
    print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
  _print_table(rows)
  print(common.finite_json(_summary(args, cfg, engine, rows, peak, tunix_error)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
