r"""The parity gate (`rl.parity_check`): does the sampler compute the trainer's function on the tokens it sampled?

`rl.verify_weight_sync` checks that a sync's bytes arrived. It cannot see a mapping that puts the right bytes in the
wrong place with the same shape (gate and up kernels exchanged, two kv heads swapped), a sampler built with another
config, nor a precision or routing drift: those sample from another network, and the field's most-reported RL failure
is exactly that (gibberish after a weight sync: maxtext #4404/#4519/#4770, verl #7904, SkyRL #1680). Only the
log-probs can see it. At a checked step (`rl.parity_check` = off | first | every_n, with `rl.parity_check_every`; the
first step by default) the trainer's forward scores the sampled tokens at the weights that sampled them (the
old-policy forward of `experience.score`, reused when it runs; one extra forward on a checked step when it does not)
and compares with the log-probs the sampler assigned while sampling, over completion tokens (the loss's mask):

    d_t = lp_sampler(t) - lp_trainer(t)
    parity/logp_abs_diff_mean = mean_t |d_t|        parity/logp_abs_diff_max = max_t |d_t|
    parity/routing_mismatch_fraction (MoE, the trainer routing freely) = the fraction of (token, MoE layer) pairs whose
        top-k expert sets differ (moe.mismatch_fraction; prompt tokens and completion tokens but the last)

The figures are always logged (metrics stream, `parity/*`). Past a tolerance the run stops before the step's update,
with one line naming the step, the figure, the tolerance and the likeliest cause (`ParityError`). Tolerances default
by the precision pairing of the two sides (`PAIRING_TOLERANCES`; a `rl.parity_*_tolerance` key overrides one):

    pairing (sampler / trainer)   mean |d|   max |d|   routing mismatch
    float32 / float32               1e-3       0.1         0.01
    bfloat16 / float32              0.05       2.0         0.10
    bfloat16 / bfloat16             0.05       2.0         0.10

float32 on both sides agrees to ~1e-6 nats (the cached decode and the full forward sum in another order:
docs/moe.md); bfloat16 costs ~5e-3 mean and a tail of a few 1e-2 on the tiny models (docs/moe.md's table), ~1e-2 mean
on production models (the field's reports). A sampler computing another function is off by far more: swapped gate/up
kernels or kv heads move the mean by ~0.1-1 nats (tests/test_parity.py). The routing figure gates MoE samplers whose
router ties break differently (a bf16 router); under `rl.router_replay` the trainer replays the sampler's routing, so
that figure is not defined and only the log-probs are checked.

A step whose batch was sampled by older weights than the trainer's (`rl.off_policy_steps` > 0) is not checked: the
two sides are different policies by design. A launch's first step (a fresh run's step 1, or the first step after a
resume) always has both sides at the same weights. Both sides read a completion up to its first pad token: an engine
that samples the pad id mid-row ends the completion there (rollout/stops.pad_stops says why).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from maxtext_rl_plugin.errors import UserError
from maxtext_rl_plugin.resharding import verify

POLICIES = ("off", "first", "every_n")


@dataclasses.dataclass(frozen=True)
class Tolerance:
  """Largest figures a checked step may show (module docstring)."""

  mean: float
  max: float
  routing: float


PAIRING_TOLERANCES = {
    "float32/float32": Tolerance(mean=1e-3, max=0.1, routing=0.01),
    "bfloat16/float32": Tolerance(mean=0.05, max=2.0, routing=0.10),
    "bfloat16/bfloat16": Tolerance(mean=0.05, max=2.0, routing=0.10),
}


class ParityError(UserError):
  """The sampler's log-probs of its own tokens are not the trainer's: the run stops before the step's update."""


def precision(dtype: Any) -> str:
  """'float32' or 'bfloat16' (anything below 32 bits counts as bfloat16: the looser tolerances)."""
  return "float32" if jnp.dtype(dtype).itemsize >= 4 else "bfloat16"


def pairing(config: Any, engine: str = "embedded") -> str:
  """'<sampler>/<trainer>' precision of a run: the embedded engine computes in MaxText's `dtype` like the trainer;
  vLLM in the weights' dtype (rollout/vllm_config.py passes `weight_dtype` as vLLM's `dtype`). A float32 sampler
  against a bfloat16 trainer gets the bfloat16/bfloat16 tolerances."""
  trainer = precision(config.dtype)
  sampler = precision(config.weight_dtype if engine == "vllm" else config.dtype)
  if sampler == "float32" and trainer == "bfloat16":
    sampler = "bfloat16"
  return f"{sampler}/{trainer}"


def tolerance(config: Any, engine: str = "embedded") -> Tolerance:
  """The run's tolerances: the pairing's defaults, each replaced by its `rl.parity_*_tolerance` key when set."""
  base = PAIRING_TOLERANCES[pairing(config, engine)]
  rl = config.rl

  def pick(key: str, default: float) -> float:
    value = getattr(rl, key)
    return default if value is None else float(value)

  return Tolerance(
      mean=pick("parity_logp_tolerance_mean", base.mean),
      max=pick("parity_logp_tolerance_max", base.max),
      routing=pick("parity_routing_tolerance", base.routing),
  )


def due(config: Any, step: int, start: int = 0) -> bool:
  """Whether step `step` (1-based) of a launch that resumed after step `start` (0: a fresh run) is checked: the
  launch's first step (a resume's sampler got its weights from a checkpoint: the same risk as a first sync), and
  under every_n every `rl.parity_check_every`-th step of the launch, counted as `rl.verify_weight_sync` counts syncs."""
  return verify.verify_due(str(config.rl.parity_check), int(config.rl.parity_check_every), int(step) - int(start))


def figures(
    sampler_logps: np.ndarray,
    trainer_logps: np.ndarray,
    mask: np.ndarray,
    routing_mismatch: float | None = None,
) -> dict[str, float]:
  """The gate's metrics (module docstring) over the masked completion tokens."""
  m = np.asarray(mask, bool)
  d = np.abs(np.asarray(sampler_logps, np.float64) - np.asarray(trainer_logps, np.float64))[m]
  out = {
      "parity/logp_abs_diff_mean": float(d.mean()) if d.size else 0.0,
      "parity/logp_abs_diff_max": float(d.max()) if d.size else 0.0,
      "parity/tokens": float(d.size),
  }
  if routing_mismatch is not None:
    out["parity/routing_mismatch_fraction"] = float(routing_mismatch)
  return out


def exceeded(figs: dict[str, float], tol: Tolerance) -> str | None:
  """The first figure past its tolerance ('mean', 'routing' or 'max'), or None: the mean first (a sampler computing
  another function moves every token), then the routing, then the tail."""
  if figs["parity/logp_abs_diff_mean"] > tol.mean:
    return "mean"
  routing = figs.get("parity/routing_mismatch_fraction")
  if routing is not None and routing > tol.routing:
    return "routing"
  if figs["parity/logp_abs_diff_max"] > tol.max:
    return "max"
  return None


def check(step: int, figs: dict[str, float], tol: Tolerance, pair: str) -> None:
  """Raise `ParityError` (one line: the step, the figure, the tolerance, the likeliest cause) when `exceeded`."""
  which = exceeded(figs, tol)
  where = f"step {step}: the sampler and the trainer disagree on the sampled tokens"
  stop = f"stopped before step {step}'s update (rl.parity_check; {pair} sampler/trainer)"
  mean, worst = figs["parity/logp_abs_diff_mean"], figs["parity/logp_abs_diff_max"]
  n = int(figs.get("parity/tokens", 0))
  if which == "mean":
    raise ParityError(
        f"{where}: mean |log p_sampler - log p_trainer| = {mean:.3g} over {n} completion tokens > "
        f"rl.parity_logp_tolerance_mean = {tol.mean:g}; {stop}. Likeliest cause: the sampler runs another function "
        "than the trainer: a weight mapping that puts same-shape tensors in the wrong place (gate/up kernels or kv "
        "heads exchanged, a transposed or unpadded kernel) or a sampler built with another model config"
    )
  if which == "routing":
    routing = figs["parity/routing_mismatch_fraction"]
    raise ParityError(
        f"{where}: {routing:.1%} of (token, MoE layer) pairs go to other experts > rl.parity_routing_tolerance = "
        f"{tol.routing:g}; {stop}. Likeliest cause: the two sides' routers break near-ties differently (a bfloat16 "
        "router); rl.router_replay=true replays the sampler's routing in the trainer, float32_gate_logits=true "
        "computes the router in float32"
    )
  if which == "max":
    raise ParityError(
        f"{where}: max |log p_sampler - log p_trainer| = {worst:.3g} (mean {mean:.3g}) > rl.parity_logp_tolerance_max "
        f"= {tol.max:g}; {stop}. Likeliest cause: a few tokens scored very differently while most agree: precision "
        "(a bfloat16 side) on low-probability tokens or, on a mixture of experts, tokens routed to other experts "
        "(rl.router_replay=true)"
    )
