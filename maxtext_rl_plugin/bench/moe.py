"""`python -m maxtext_rl_plugin.bench moe`: how often the sampler and the trainer route a token differently, and what
router replay (`rl.router_replay`, moe.py) does to the sampler-trainer log-prob mismatch and to the parity gate.

The sampler is the embedded engine on the model in `--sampler-dtype` (MaxText's `dtype`: activations and the router's
logits, bfloat16 by default, as a production sampler runs); the trainer is the same weights in `--trainer-dtype`
(float32 by default), MaxText's full forward of prompt + completion. Routing is close to tied when the router's logits
are small, so the router kernels are scaled by each `--router-scales` value (1 = the model's own) to show the range.
For each scale, the engine samples `--prompts` x `--generations` completions at `--temperature`; then, on the sampled
tokens:

  routing_mismatch  fraction of (token, MoE layer) pairs whose top-k expert sets differ, sampler vs trainer
                    (prompt tokens and completion tokens but the last: the ones both sides route)
  |dlogp| mean/max  |lp_sampler - lp_trainer| over completion tokens, the trainer routing freely ("free") or
                    replaying the sampler's routing ("replay"): the parity gate's figures (parity.py)
  ratio std / range the spread of the per-token policy ratio exp(lp_trainer - lp_sampler) that an on-policy update
                    would see at its first step (1 everywhere when both sides compute the same function)
  kl_k3             k3 estimate of KL(trainer || sampler) (experience.agreement_metrics, the step metric)
  gate              the parity gate's verdict at its default tolerances for this precision pairing: "ok", or the
                    first figure past its tolerance ("mean", "routing", "max": the run would stop)

With replay the routing mismatch is zero by construction; what remains of the log-prob mismatch is the precision
difference of the expert and attention math itself.
"""

from __future__ import annotations


from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from maxtext_rl_plugin.bench import common
from maxtext_rl_plugin.run import experience
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin import moe
from maxtext_rl_plugin.run import parity
from maxtext_rl_plugin.rollout import embedded
from maxtext_rl_plugin.rollout import sampling
from maxtext_rl_plugin.run import engine as run_engine

_PROMPTS = [
    "Tom has 3 apples and buys 4 more. How many apples does he have now?",
    "What is 12 * 7?",
    "A box holds 6 eggs. How many eggs are in 5 boxes?",
    "Sara had 20 stickers and gave away 8. How many are left?",
    "Name three colours.",
    "Write a short sentence about the sea.",
    "How many legs do 4 cats have?",
    "What comes after Monday?",
]


def _scaled(state, scale: float):
  """`state` with every MoE router kernel (`.../gate/kernel`) times `scale`."""

  def f(path, x):
    keys = [getattr(k, "key", None) for k in path]
    return x * scale if "gate" in keys and "kernel" in keys else x

  return jax.tree_util.tree_map_with_path(f, state)


def _compare(sampler_lp, trainer_lp, mask, routing_mismatch, tol) -> dict:
  """One side's figures: the agreement metrics, the policy ratio's spread and the parity gate's figures and verdict."""
  m = np.asarray(mask, bool)
  ratio = np.exp(np.asarray(trainer_lp, np.float64) - np.asarray(sampler_lp, np.float64))[m]
  out = dict(experience.agreement_metrics(sampler_lp, trainer_lp, mask))
  out.update(
      {
          "ratio_std": float(ratio.std()) if ratio.size else 0.0,
          "ratio_min": float(ratio.min()) if ratio.size else 1.0,
          "ratio_max": float(ratio.max()) if ratio.size else 1.0,
      }
  )
  figs = parity.figures(sampler_lp, trainer_lp, mask, routing_mismatch)
  out.update(figs)
  out["gate"] = parity.exceeded(figs, tol) or "ok"
  return out


def main(argv=None) -> int:
  ap = common.ArgumentParser(prog="python -m maxtext_rl_plugin.bench moe")
  ap.add_argument("--config", default="configs/cpu_tiny_moe.yml")
  ap.add_argument("--sampler-dtype", default="bfloat16")
  ap.add_argument("--trainer-dtype", default="float32")
  ap.add_argument(
      "--router-scales",
      type=common.positive_floats,
      default="1,0.1,0.01",
      help="router logit scales (0 would tie every expert, a negative one invert the routing)",
  )
  ap.add_argument("--prompts", type=common.positive_int, default=8)
  ap.add_argument("--generations", type=common.positive_int, default=4)
  ap.add_argument("--new-tokens", type=common.positive_int, default=24)
  ap.add_argument(
      "--temperature", type=common.positive_float, default=1.0, help="log-probs are taken at this temperature"
  )
  ap.add_argument("--seed", type=common.non_negative_int, default=0)
  args, overrides = ap.parse_known_args(argv)
  scales = args.router_scales

  rs = models.setup_devices(config_lib.parse([args.config, *overrides, f"dtype={args.trainer_dtype}"]))
  cfg = rs.trainer_config
  moe_settings = moe.MoeSettings.from_config(cfg)
  if not moe_settings.is_moe:
    print(f"error: {cfg.model_name} is not a mixture-of-experts model (num_experts={cfg.num_experts})")
    return 2
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(cfg))
  pad, eos = int(tok.pad_token_id), int(tok.eos_token_id)
  trainer, _ = models.build_model(cfg, rs.trainer_devices, pad_id=pad)
  srs = models.setup_devices(config_lib.parse([args.config, *overrides, f"dtype={args.sampler_dtype}"]))
  sampler_model, mesh = models.build_model(srs.sampler_config, srs.sampler_devices, pad_id=pad)
  base = nnx.state(trainer, nnx.Param)
  engine = embedded.EmbeddedRollout(
      rollout_actor=sampler_model,
      tokenizer=tok,
      mesh=mesh,
      **run_engine.embedded_arguments(srs.sampler_config, mesh),
  )
  graphdef = moe.recording_graphdef(trainer)
  replay_ok = moe_settings.replay_supported
  fwd = jax.jit(
      lambda state, p, c, forced: moe.forward_logps(
          graphdef, state, p, c, pad, eos, temperature=args.temperature, forced=forced
      )[::2]
  )
  prompts = [tok.encode(p) for p in (_PROMPTS * args.prompts)[: args.prompts]]
  width = max(len(p) for p in prompts)
  params = sampling.SamplingParams.create(args.temperature, 0, 1.0)
  # The gate's tolerances for this pairing (the sampler is the embedded engine in its own dtype).
  pair = f"{parity.precision(args.sampler_dtype)}/{parity.precision(args.trainer_dtype)}"
  tol = parity.PAIRING_TOLERANCES.get(pair, parity.PAIRING_TOLERANCES["bfloat16/bfloat16"])
  rows = []
  print(
      f"{cfg.model_name} ({cfg.decoder_block.value}), {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, "
      f"{cfg.num_decoder_layers} layers; sampler {args.sampler_dtype}, trainer {args.trainer_dtype}; gate tolerances "
      f"mean {tol.mean:g} max {tol.max:g} routing {tol.routing:g}"
  )
  print(
      f"{'router x':>9}{'routing':>9} | {'free: |dlogp| mean/max':>23}{'ratio std':>10}{'kl_k3':>10}{'gate':>6} | "
      f"{'replay: |dlogp| mean/max':>25}{'ratio std':>10}{'kl_k3':>10}{'gate':>6}"
  )
  for scale in scales:
    weights = _scaled(base, scale)
    nnx.update(trainer, weights)
    engine.update_params(weights)
    res = engine.generate_tokens(
        prompts,
        num_generations=args.generations,
        max_new_tokens=args.new_tokens,
        rng=jax.random.PRNGKey(args.seed),
        sampling_params=params,
        prompt_pad_to=width,
    )
    state = nnx.state(trainer)
    p, c = jnp.asarray(res.left_padded_prompts), jnp.asarray(res.tokens)
    lp_free, route_free = (np.asarray(x) for x in fwd(state, p, c, None))
    mask = moe.routed_mask(res.left_padded_prompts != pad, res.mask)
    mismatch = moe.mismatch_fraction(res.routing, route_free, mask)
    row = {
        "router_scale": scale,
        "routing_mismatch": mismatch,
        "free": _compare(res.logps, lp_free, res.mask, mismatch, tol),
        "tokens": int(res.mask.sum()),
    }
    if replay_ok:
      lp_replay, _ = fwd(state, p, c, jnp.asarray(res.routing))
      row["replay"] = _compare(res.logps, np.asarray(lp_replay), res.mask, None, tol)
    rows.append(row)

    def cells(m):
      if m is None:
        return f"{'n/a':>51}"
      return (
          f"{m['mismatch/logp_abs_diff_mean']:>12.2e}/{m['mismatch/logp_abs_diff_max']:<10.2e}{m['ratio_std']:>10.2e}"
          f"{m['mismatch/kl_k3']:>10.2e}{m['gate']:>6}"
      )

    print(f"{scale:>9g}{mismatch:>9.2%} | {cells(row['free'])} | {cells(row.get('replay'))}")
  if not replay_ok:
    print(f"replay: the trainer cannot replay {cfg.model_name}'s routing")
  print(
      common.finite_json(
          {
              "bench": "moe",
              "model": cfg.model_name,
              "sampler_dtype": args.sampler_dtype,
              "trainer_dtype": args.trainer_dtype,
              "rows": rows,
          }
      )
  )
  return 0
