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
with one line naming the step, the figure, the tolerance and the likeliest cause (`ParityError`).

Tolerances: fixed numbers set from the measured floor of each precision pairing and backend (`PAIRING_TOLERANCES`,
chosen by `pairing`; a `rl.parity_*_tolerance` key overrides one):

    pairing (sampler / trainer)                             mean |d|   max |d|   routing mismatch
    float32 / float32, float32 matmuls                        2e-5       1e-2        0.01
    float32 / float32, reduced-precision matmuls              0.05       1.5         0.10
    bfloat16 / float32, bfloat16 / bfloat16                   0.05       1.5         0.10
    int8 weights (rollout_quantization), float32 matmuls      0.01       0.25        0.10
    fp8 weights, float32 matmuls                              0.07       0.5         0.10
    int8 weights, bfloat16 (or reduced-precision) matmuls     0.05       1.5         0.10
    fp8 weights, bfloat16 (or reduced-precision) matmuls      0.1        1.5         0.10

A quantized sampler (`rollout_quantization`, rollout/precision.py) samples from another network than the trainer's by
design; its rows are set as the bfloat16 row was, from the noisiest honest stage measured (docs/low_precision.md has the
table; `scripts/parity_floor.py --mutations honest int8 fp8 fp8_fnuz fp8_rev_out_L1 int8_rev_out_L1` reproduces it):
on the demo model at 30 and 300 warm-start steps, 3 seeds each, the honest int8 sampler is off by 2.9e-4-5.2e-3 mean /
<= 0.044 max, fp8 by 2.2e-3-0.036 / <= 0.29; the deliberately wrong scales are FP8 scales read as e4m3fnuz's (bound 240
instead of 448: mean >= 2.3) and one tensor's scales in reversed channel order (layer 1's attention output: int8
>= 3.1e-3 / 0.39, fp8 >= 5.0e-3 / 0.55 after 300 steps; >= 0.10 mean after 30). The means sit 2x above the noisiest
honest stage; the max catches the reversed scales where the mean cannot (after 300 steps): int8 0.25 is 5.7x above
every honest max and 1.6x below the smallest reversed one, fp8 0.5 is 1.7x above and 1.1x below. With bfloat16 matmuls
the rounding of both adds up (bfloat16 after 30 steps: honest 0.024-0.025 mean, int8 0.026-0.028, fp8 0.044-0.048,
maxima <= 0.41) and only gross errors (a wrong float8 variant: mean >= 2.9, a head swap) are separable: the bfloat16
row's max, the means 2x the noisiest (int8 keeps the bfloat16 row).

"float32 matmuls" is the CPU, or an accelerator at `matmul_precision=highest`. An accelerator at MaxText's default
precision multiplies float32 at reduced precision (JAX's default: one bfloat16 pass on TPU, TF32 on recent NVIDIA GPUs;
docs.jax.dev "Matmul precision"), so its float32 floor is not the CPU's: it gets the bfloat16 row, an upper bound (TF32
keeps 10 mantissa bits to bfloat16's 7), not a measurement: no accelerator float32 floor was measured here.

The numbers (docs/moe.md, "Tolerances", has the tables; scripts/parity_floor.py reproduces them): one step's ~1,000
completion tokens of the README's demo model at its temperature 1, mutations installed in the sampler's copy only.
The honest float32 sampler is off by 2.7e-8-5.9e-8 mean / <= 7.6e-6 max after the demo's 300-step warm start (5
seeds), 4.6e-7 after 100 steps, 1.2e-6 after 30 (the noisiest stage measured), 1.1e-8 after 2; the tests' random-init
models and the MoE demo (free and replayed routing) by <= 2.7e-7 / <= 4.5e-5. The smallest near miss measured, one
layer's attention output kernel x1.02, is off by >= 3.3e-4 mean / >= 0.038 max; the final norm x1.05 by >= 1.1e-3 /
0.11; one layer's query heads exchanged by >= 0.023 / 6.25. So 2e-5 sits 17x above the noisiest honest mean and 16x
below the smallest near miss; 1e-2 sits 220x above every honest max and 3.8x below the smallest near miss's (the mean
catches every near miss; the max is for a bug that only a few tokens read). The old defaults (1e-3 / 0.1, set on
random-init models at temperature 30) sat 6,000x above the trained model's floor and let the x1.02 kernel through on 5
seeds of 5: a trained model is nearly deterministic on most tokens (median |d| is 0 even under a mutation), so a bug
that moves a few tokens is diluted in the mean.

bfloat16 has no such gap. The honest sampler's rounding noise on the demo is 7.7e-4-1.6e-3 mean / 0.11-0.23 max after
300 warm-start steps, 7.8e-3 / 0.25 after 100, 0.024-0.025 / 0.22 after 30; 2.5e-3-4.3e-3 / <= 0.12 on the tests' MoE
models and the MoE demo; 4.9e-4-4.2e-3 / <= 0.69 over 44 checks of the MoE demo on an H200
(docs/bench/gpu_h200_moe_demo_bf16_2026-11-28.json); ~1e-2 mean on production models (the field's reports). The x1.05
norm and the x1.02 kernel sit inside it. The mean stays at 0.05 (2x the noisiest honest stage: it cannot come down);
the max comes down from 2.0 to 1.5, 2.2x the worst honest figure (0.69): a head swap (max >= 6.25) stops the run, and
one token's embedding row x1.1 (max 1.2-2.6) on 4 seeds of 5 (3 at 2.0). To vet a new sampler or weight mapping, run
its first step in float32 (`dtype=float32`, and `matmul_precision=highest` on an accelerator): that gate is 2,500x
tighter on the mean.

Why fixed numbers and not a baseline or a quantile: the check that matters most is a launch's first step, where a
baseline from the launch's own batch would already include the bug, and the only independent baseline (the trainer's
forward at another precision) costs a second model; with median |d| at 0 under every mutation, every quantile short
of the tail is blind, and the tail is what `max` reads. The routing figure gates MoE samplers whose router ties break
differently (a bf16 router); under `rl.router_replay` the trainer replays the sampler's routing, so that figure is not
defined and only the log-probs are checked.

A step whose batch was sampled by older weights than the trainer's (`rl.off_policy_steps` > 0) is not checked: the
two sides are different policies by design. A launch's first step (a fresh run's step 1, or the first step after a
resume) always has both sides at the same weights. Both sides read a completion up to its first pad token: an engine
that samples the pad id mid-row ends the completion there (rollout/stops.pad_stops says why).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_rl_plugin.errors import UserError
from maxtext_rl_plugin.resharding import verify
from maxtext_rl_plugin.rollout import engines
from maxtext_rl_plugin.rollout import precision as precision_lib

POLICIES = ("off", "first", "every_n")


@dataclasses.dataclass(frozen=True)
class Tolerance:
  """Largest figures a checked step may show (module docstring)."""

  mean: float
  max: float
  routing: float


REDUCED = "float32/float32 at reduced-precision matmuls"

PAIRING_TOLERANCES = {  # the module docstring's table and the measurements behind it
    "float32/float32": Tolerance(mean=2e-5, max=1e-2, routing=0.01),
    REDUCED: Tolerance(mean=0.05, max=1.5, routing=0.10),
    "bfloat16/float32": Tolerance(mean=0.05, max=1.5, routing=0.10),
    "bfloat16/bfloat16": Tolerance(mean=0.05, max=1.5, routing=0.10),
    # A quantized sampler's weights (rollout_quantization) against the trainer's, by the matmuls' precision.
    "int8/float32": Tolerance(mean=0.01, max=0.25, routing=0.10),
    "fp8/float32": Tolerance(mean=0.07, max=0.5, routing=0.10),
    "int8/bfloat16": Tolerance(mean=0.05, max=1.5, routing=0.10),
    "fp8/bfloat16": Tolerance(mean=0.1, max=1.5, routing=0.10),
}


class ParityError(UserError):
  """The sampler's log-probs of its own tokens are not the trainer's: the run stops before the step's update."""


def precision(dtype: Any) -> str:
  """'float32' or 'bfloat16' (anything below 32 bits counts as bfloat16: the looser tolerances)."""
  return "float32" if jnp.dtype(dtype).itemsize >= 4 else "bfloat16"


def float32_matmuls(config: Any, backend: str | None = None) -> bool:
  """Whether float32 matmuls multiply in float32: always on the CPU; on an accelerator only at MaxText's
  `matmul_precision=highest` (its default multiplies float32 in one bfloat16 pass on TPU, in TF32 on GPU)."""
  backend = backend or jax.default_backend()
  value = getattr(config.matmul_precision, "value", config.matmul_precision)
  return backend == "cpu" or str(value).lower() == "highest"


def pairing(config: Any, engine: str = "embedded", backend: str | None = None) -> str:
  """'<sampler>/<trainer>' precision of a run: the sampler computes in the dtype of the config key its engine declares
  (`Capabilities.sample_dtype_key`, rollout/engines.py): the embedded engine in MaxText's `dtype` like the trainer,
  vLLM in the weights' dtype (rollout/vllm_config.py passes `weight_dtype` as vLLM's `dtype`). A float32 sampler
  against a bfloat16 trainer gets the bfloat16/bfloat16 tolerances; float32 on both sides off the CPU below
  `matmul_precision=highest` is `REDUCED` (`float32_matmuls`). A quantized sampler (`rollout_quantization`) is
  '<int8|fp8>/float32' when both sides multiply in float32, else '<int8|fp8>/bfloat16'."""
  trainer = precision(config.dtype)
  sample_key = engines.spec(engine).capabilities.sample_dtype_key
  sampler = precision(config.weight_dtype if sample_key == "weight_dtype" else config.dtype)
  if sampler == "float32" and trainer == "bfloat16":
    sampler = "bfloat16"
  pair = f"{sampler}/{trainer}"
  exact = pair == "float32/float32" and float32_matmuls(config, backend)
  quantized = precision_lib.requested(getattr(config, precision_lib.KEY, precision_lib.NONE))
  if quantized:  # the sampler's weights are int8/fp8 (rollout_quantization); the matmuls' precision picks the row
    return f"{quantized}/{'float32' if exact else 'bfloat16'}"
  if pair == "float32/float32" and not exact:
    return REDUCED
  return pair


def tolerance(config: Any, engine: str = "embedded", backend: str | None = None) -> Tolerance:
  """The run's tolerances: the pairing's defaults, each replaced by its `rl.parity_*_tolerance` key when set."""
  base = PAIRING_TOLERANCES[pairing(config, engine, backend)]
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
  stop = f"stopped before step {step}'s update (rl.parity_check; sampler/trainer {pair})"
  mean, worst = figs["parity/logp_abs_diff_mean"], figs["parity/logp_abs_diff_max"]
  n = int(figs.get("parity/tokens", 0))
  if which == "mean":
    raise ParityError(
        f"{where}: mean |log p_sampler - log p_trainer| = {mean:.3g} over {n} completion tokens > "
        f"rl.parity_logp_tolerance_mean = {tol.mean:g}; {stop}. Likeliest cause: the sampler runs another function "
        "than the trainer: a weight mapping that puts same-shape tensors in the wrong place (gate/up kernels or kv "
        "heads exchanged, a transposed or unpadded kernel), a scale or norm off by a few percent, or a sampler built "
        "with another model config"
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
    cause = (
        "a weight that only some tokens read is off (an embedding row, one expert, a position range: rope or the KV "
        "cache) or, on a mixture of experts, tokens routed to other experts (rl.router_replay=true)"
        if pair == "float32/float32"
        else "precision on low-probability tokens, a weight that only some tokens read (an embedding row, one expert, a "
        "position range) or, on a mixture of experts, tokens routed to other experts (rl.router_replay=true)"
    )
    raise ParityError(
        f"{where}: max |log p_sampler - log p_trainer| = {worst:.3g} (mean {mean:.3g}) > rl.parity_logp_tolerance_max "
        f"= {tol.max:g}; {stop}. Likeliest cause: a few tokens scored very differently while most agree: {cause}"
    )
