r"""Policy loss (GRPO, GSPO-token), group advantages and KL estimators, wired into Tunix 0.1.7's learner.

Notation: B completions, T completion positions, m_{i,t} in {0,1} the completion mask, n_i = sum_t m_{i,t},
lp = log pi_theta(o_{i,t} | q, o_{i,<t}) (`per_token_logps`), lp_old (the sampling policy), lp_ref (the
frozen reference), A_i the (sequence-level) advantage, eps_lo = `epsilon`, eps_hi = `epsilon_high`.

GRPO (Shao et al. 2024, DeepSeekMath; asymmetric "clip-higher" from DAPO, Yu et al. 2025):
    r_{i,t} = exp(lp - lp_old)
    L_{i,t} = -( min(r_{i,t} A_i, clip(r_{i,t}, 1 - eps_lo, 1 + eps_hi) A_i) - beta * KL_{i,t} )

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", sequence-level and its GSPO-token variant):
    s_i       = exp( (1/n_i) sum_t m_{i,t} (lp - lp_old) )                  (length-normalised sequence ratio)
    s_{i,t}   = sg[s_i] * exp(lp_{i,t} - sg[lp_{i,t}])                       (numerically s_i; d/dlp_t = s_i)
    L_{i,t}   = -( min(s_{i,t} A_i, clip(s_{i,t}, 1 - eps_lo, 1 + eps_hi) A_i) - beta * KL_{i,t} )
  With per-sequence advantages and `sequence-mean-token-mean` aggregation, the gradient of GSPO-token equals the
  gradient of sequence-level GSPO,  -(1/B) sum_i min(s_i A_i, clip(s_i, ...) A_i): every token of sequence i
  receives -A_i s_i / (B n_i) unless the sequence is clipped. The paper's clip ranges are ~1e-4 (3e-4 / 4e-4),
  not GRPO's 0.2: the sequence ratio is a geometric mean, so set `rl.grpo_epsilon` accordingly.

KL estimators (Schulman, "Approximating KL divergence"), d = lp_ref - lp:
    k1 = lp - lp_ref = -d                      (Tunix 0.1.7's default `kl_loss_mode="kl"`)
    k3 = exp(d) - d - 1  >= 0                   (DeepSeekMath's; Tunix's "low_var_kl")
  As a *loss* k1's gradient is the constant beta per token (it pushes every sampled token's log-prob down equally),
  while k3's gradient beta (1 - pi_ref/pi) pulls towards the reference; k3 is the default.

Aggregation of L_{i,t} (`loss_agg_mode`; rows with n_i = 0 are excluded from the row count B'):
    token-mean                  sum_{i,t} m L / sum_{i,t} m                       (DAPO)
    sequence-mean-token-mean    (1/B') sum_i (1/n_i) sum_t m L                    (GRPO / GSPO papers)
    sequence-mean               (1/B') sum_i sum_t m L                            (Tunix's "seq-mean-token-sum")
  MaxText 0.2.5 accepts `sequence-mean` in `rl.loss_agg_mode`, but Tunix 0.1.7's `aggregate_loss` has no such mode
  and raises; here it is the sum-over-tokens/mean-over-sequences reading above.

Advantages (`group_advantages`; `rl.advantage_estimator`, `rl.advantage_norm`), contiguous groups g of
G = num_generations completions per prompt, R_i the completion's reward. First a baseline is subtracted:
    grpo, drgrpo:  c_i = R_i - mean_g R                                     (Tunix's `compute_drgrpo_advantages`)
    rloo:          c_i = R_i - (1/(G-1)) sum_{j in g, j != i} R_j = G/(G-1) (R_i - mean_g R)
                                                                            (leave-one-out, Ahmadian et al. 2024;
                                                                             Tunix's `compute_rloo_advantages`)
  then it is scaled (`rl.advantage_norm`; null = the estimator's own, in brackets):
    group_std:  A_i = c_i / (std_g(R, ddof=1) + 1e-6)                       [grpo]  (Tunix's `compute_advantages`)
    batch_std:  A_i = c_i / (std_B(c, ddof=1) + 1e-6)    over all B rows of the batch (Hu 2025, REINFORCE++-baseline;
                                                          Liu et al. 2025 "Lite PPO": group mean, batch scale)
    none:       A_i = c_i                                                   [rloo, drgrpo]
  rloo and drgrpo refuse group_std: a per-group scale is exactly the question-difficulty weighting that Dr. GRPO
  (Liu et al. 2025, "Understanding R1-Zero-like training") removes, and RLOO's estimator is unbiased only unscaled;
  a batch-wide scale is one constant per step and changes neither.
  Dr. GRPO also drops the 1/n_i length normalisation: `drgrpo` aggregates with
    sequence-mean-token-scale   (1/B') sum_i (1/T) sum_t m L                (T = the completion budget, constant)
  (Tunix's `DrGRPOConfig` default, `aggregate_loss(..., "sequence-mean-token-scale")` with its default norm T);
  it needs `rl.loss_agg_mode` at its default `sequence-mean-token-mean`, which it replaces (the other modes are
  other normalisations, refused in one line). A group whose rewards are all equal gets A = 0 under every estimator.

Overlong completions, in tokens (T = max_target_length - max_prefill_predict_length, the completion budget; n_i
counts the completion's tokens including its stop token):
    truncated_i = (n_i == T) and o_{i,T} is not a stop token          (cut by the length limit, `truncated_rows`)
  `rl.mask_truncated_completions`: m_{i,t} = 0 for every t of a truncated completion, so it contributes no loss
  (neither policy gradient nor KL, and it leaves the row/token counts of the aggregation: DAPO's overlong filtering).
  `rl.overlong_buffer_len` = L_c > 0, `rl.overlong_penalty_factor` = f: DAPO's soft overlong punishment (Yu et al.
  2025, eq. 13) is added to the reward before the advantage, with L_max = T:
    R_len(n) = 0                              n <= T - L_c
             = ((T - L_c) - n) / L_c * f      T - L_c < n <= T
             = -f                             n > T   (cannot happen here: the engine stops at T)
  computed by Tunix's own `dapo_learner.reward_shaping` applied to token sequences. Tunix applies it to the decoded
  *text* (len(completion) counts characters, against a `max_response_length` that is a token budget), so its penalty
  depends on the tokenizer's characters per token; here n is the token count the length limit is defined in.

Rollout importance sampling (`rl.rollout_is`; Yao et al. 2025 "truncated importance sampling", verl's rollout_corr),
for batches whose behaviour policy mu (the sampler's log-probs lp_mu, returned by the rollout engine at sampling time)
differs from pi_old (the trainer's forward at the batch's starting weights: another engine, bf16 vs f32, stale weights):
    truncate:  w_{i,t} = min( exp(lp_old - lp_mu), C )                      (TIS, per token; C = rl.rollout_is_cap)
    mask:      W_i = exp( (1/n_i) sum_t m (lp_old - lp_mu) ),  w_{i,t} = 1[1/C <= W_i <= C]   (sequence-level MIS)
  w is a constant (no gradient) multiplying the policy-gradient term of L_{i,t} before aggregation; the KL term is not
  weighted. Metrics: `is_weight_mean` (over tokens), `is_truncated_fraction` (tokens with exp(lp_old - lp_mu) > C),
  `is_masked_fraction` (sequences dropped by `mask`).

EOS policy: the completion mask the trainer passes covers the tokens *up to and including* the first EOS/stop token
(the plugin trains the stop token, so the policy learns when to stop); everything after it is padding. Padded
positions get exactly zero gradient and may hold any value (even NaN/-inf), as they are replaced before any
arithmetic. Note that Tunix's learner builds the mask as `completion_ids != pad_id`, so the rollout engine must keep
the EOS token in the completion and `pad_id` must differ from `eos_id`.

Numerical guards (no effect in any sane regime): log-ratios and KL log-differences are clamped to +-20 (ratios
within [2e-9, 4.9e8]) so one runaway token cannot overflow exp() and poison the step with inf/NaN.

Differences from Tunix 0.1.7's `grpo_loss_fn` (tunix/rl/algo_core.py), which this module replaces in the learner:
  * `epsilon_high` is a real config field (Tunix reads it with `hasattr`, and `GRPOConfig` has none, so the clip is
    always symmetric there); the KL estimator is chosen explicitly (Tunix's default is k1).
  * GSPO: Tunix clamps the token log-ratio to [-20, 20] *before* the sequence mean and the final log-ratio to <= 10,
    which zeroes the gradient of a sequence whose ratio exceeds e^10; here the clamp is on the stop-gradient
    sequence part only, so the gradient always follows the paper.
  * beta == 0 ignores the reference entirely (no KL metric), matching the learner, which then computes no ref
    log-probs. Dual-clip (`epsilon_c`), sampler importance weights and `kl_clamp_value` are not supported (the
    +-20 clamp above already bounds k3 by e^20). Sampler importance weights (`sampler_is_weights`) multiply the
    policy-gradient term as in Tunix's `algo_core`; the plugin computes them with `rollout_is_weights` below.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import algo_core
from tunix.rl import common as tunix_common
from tunix.rl import function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import dapo_learner
from tunix.rl.grpo import grpo_learner

from maxtext_rl_plugin import moe
from maxtext_rl_plugin.errors import ConfigError

LOSS_ALGOS = ("grpo", "gspo-token")
KL_ESTIMATORS = ("k1", "k3")
# MaxText's `rl.loss_agg_mode` Literal: the only values a config can reach.
LOSS_AGG_MODES = ("token-mean", "sequence-mean-token-mean", "sequence-mean")
# Dr. GRPO's constant-length aggregation (Tunix's name); reached through `rl.advantage_estimator=drgrpo`.
TOKEN_SCALE = "sequence-mean-token-scale"
AGG_MODES = LOSS_AGG_MODES + (TOKEN_SCALE,)
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "drgrpo")
ADVANTAGE_NORMS = ("group_std", "batch_std", "none")
# The scalings each estimator allows; the first is its own (`rl.advantage_norm: null`).
ESTIMATOR_NORMS = {
    "grpo": ("group_std", "batch_std", "none"),
    "rloo": ("none", "batch_std"),
    "drgrpo": ("none", "batch_std"),
}

# Names under which the plugin registers itself in Tunix's function registry.
POLICY_LOSS_FN_NAME = "maxtext_rl_plugin"
ADVANTAGE_ESTIMATOR_NAMES = {
    (est, norm): f"maxtext_rl_plugin/{est}/{norm}" for est, norms in ESTIMATOR_NORMS.items() for norm in norms
}

_LOG_RATIO_CLAMP = 20.0
_ADV_STD_EPS = 1e-6
# Tunix's `kl_loss_mode` spelling of each estimator (kept consistent on the config for anything reading it).
_TUNIX_KL_MODE = {"k1": "kl", "k3": "low_var_kl"}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def kl_estimate(
    per_token_logps: jax.Array, ref_per_token_logps: jax.Array, estimator: str = "k3", xp: Any = jnp
) -> jax.Array:
  """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (see module docstring).

  `xp=np` evaluates the same formula in NumPy at the inputs' precision (host-side diagnostics in float64)."""
  _check_choice("kl_estimator", estimator, KL_ESTIMATORS)
  d = xp.clip(ref_per_token_logps - per_token_logps, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  if estimator == "k1":
    return -d
  return xp.exp(d) - d - 1.0


def aggregate(per_token: jax.Array, completion_mask: jax.Array, loss_agg_mode: str) -> jax.Array:
  """Reduce a masked [B, T] per-token quantity to a scalar with one of `AGG_MODES` (T = per_token.shape[-1])."""
  _check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
  mask = completion_mask.astype(per_token.dtype)
  masked = jnp.where(mask > 0, per_token, 0.0)
  if loss_agg_mode == "token-mean":
    return masked.sum() / jnp.maximum(mask.sum(), 1.0)
  lengths = mask.sum(axis=-1)
  rows = jnp.maximum((lengths > 0).sum(), 1).astype(per_token.dtype)
  seq_sum = masked.sum(axis=-1)
  if loss_agg_mode == "sequence-mean-token-mean":
    return (seq_sum / jnp.maximum(lengths, 1.0)).sum() / rows
  if loss_agg_mode == TOKEN_SCALE:
    return seq_sum.sum() / (rows * per_token.shape[-1])
  return seq_sum.sum() / rows  # sequence-mean


def _token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.where(mask > 0, x, 0.0).sum() / jnp.maximum(mask.sum(), 1.0)


@functools.partial(
    jax.jit, static_argnames=("loss_algo", "epsilon", "epsilon_high", "beta", "kl_estimator", "loss_agg_mode")
)
def policy_loss(
    per_token_logps: jax.Array,
    old_per_token_logps: jax.Array | None,
    ref_per_token_logps: jax.Array | None,
    advantages: jax.Array,
    completion_mask: jax.Array,
    *,
    loss_algo: str = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg_mode: str = "sequence-mean-token-mean",
    is_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The clipped GRPO / GSPO-token loss (to minimise) and its diagnostics; formulas in the module docstring.

  Args:
    per_token_logps: [B, T] log-probs of the sampled tokens under the policy being trained (differentiated).
    old_per_token_logps: [B, T] log-probs under the sampling policy, or None for on-policy (ratio == 1 in value,
      as Tunix does when num_iterations == 1).
    ref_per_token_logps: [B, T] reference log-probs; unused (may be None) when beta == 0.
    advantages: [B] per-completion advantages ([B, T] per-token advantages are accepted for `grpo`).
    completion_mask: [B, T] 1 for trained tokens (up to and including EOS), 0 for padding.
    loss_algo, epsilon, epsilon_high, beta, kl_estimator, loss_agg_mode: static hyperparameters;
      epsilon_high=None means epsilon (symmetric clip).
    is_weights: [B, T] rollout importance weights (`rollout_is_weights`) multiplying the policy-gradient term, or None.

  Returns:
    (loss, aux): scalar float32 loss and float32 scalars `pg_loss`, `kl_loss`, `kl` (token mean of the KL
    estimate), `ppo_kl` (token mean of lp_old - lp), `ratio_mean/min/max`, `clip_fraction_low/high`,
    `clip_fraction` (tokens whose clipped branch is active, i.e. that get no policy gradient), `pg_clipfrac` (the
    same, under the key Tunix's learner logs) and, for gspo-token, `seq_ratio_mean` and `seq_clip_fraction` over
    non-empty sequences.
  """
  _check_choice("loss_algo", loss_algo, LOSS_ALGOS)
  _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
  _check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
  eps_lo = float(epsilon)
  eps_hi = eps_lo if epsilon_high is None else float(epsilon_high)

  mask = completion_mask.astype(jnp.float32)
  valid = mask > 0
  # Padded positions may hold garbage: replace them *before* any arithmetic so neither values nor gradients see it.
  logp = jnp.where(valid, per_token_logps.astype(jnp.float32), 0.0)
  if old_per_token_logps is None:
    old = jax.lax.stop_gradient(logp)
  else:
    old = jnp.where(valid, jax.lax.stop_gradient(old_per_token_logps).astype(jnp.float32), 0.0)
  adv = jax.lax.stop_gradient(advantages).astype(jnp.float32)
  if adv.ndim == 1:
    adv = adv[:, None]
  elif loss_algo == "gspo-token":
    raise ValueError("gspo-token needs per-sequence advantages of shape [B]; got per-token advantages")

  log_ratio = logp - old
  aux: dict[str, jax.Array] = {"ppo_kl": _token_mean(-log_ratio, mask)}
  if loss_algo == "grpo":
    token_log_ratio = jnp.clip(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  else:
    lengths = mask.sum(axis=-1)
    seq_log_ratio = (log_ratio * mask).sum(axis=-1) / jnp.maximum(lengths, 1.0)
    seq_log_ratio = jnp.clip(jax.lax.stop_gradient(seq_log_ratio), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    token_log_ratio = seq_log_ratio[:, None] + (logp - jax.lax.stop_gradient(logp))
  ratio = jnp.exp(token_log_ratio)
  surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps_lo, 1.0 + eps_hi) * adv)
  per_token_loss = -surrogate
  if is_weights is not None:
    per_token_loss = per_token_loss * jnp.where(valid, jax.lax.stop_gradient(is_weights).astype(jnp.float32), 0.0)
  pg_loss = aggregate(per_token_loss, mask, loss_agg_mode)

  kl_loss = jnp.float32(0.0)
  kl_mean = jnp.float32(0.0)
  if beta != 0.0:
    if ref_per_token_logps is None:
      raise ValueError("beta != 0 needs ref_per_token_logps")
    ref = jnp.where(valid, jax.lax.stop_gradient(ref_per_token_logps).astype(jnp.float32), 0.0)
    kl = kl_estimate(logp, ref, kl_estimator)
    kl_loss = aggregate(kl, mask, loss_agg_mode)
    kl_mean = _token_mean(kl, mask)
    per_token_loss = per_token_loss + beta * kl
  loss = aggregate(per_token_loss, mask, loss_agg_mode)

  r = jax.lax.stop_gradient(ratio)
  a = jnp.broadcast_to(adv, r.shape)
  clipped_low = (a < 0) & (r < 1.0 - eps_lo)
  clipped_high = (a > 0) & (r > 1.0 + eps_hi)
  aux.update(
      {
          "pg_loss": pg_loss,
          "kl_loss": kl_loss,
          "kl": kl_mean,
          "ratio_mean": _token_mean(r, mask),
          "ratio_min": jnp.min(jnp.where(valid, r, jnp.inf)),
          "ratio_max": jnp.max(jnp.where(valid, r, -jnp.inf)),
          "clip_fraction_low": _token_mean(clipped_low.astype(jnp.float32), mask),
          "clip_fraction_high": _token_mean(clipped_high.astype(jnp.float32), mask),
          "clip_fraction": _token_mean((clipped_low | clipped_high).astype(jnp.float32), mask),
      }
  )
  aux["pg_clipfrac"] = aux["clip_fraction"]
  if loss_algo == "gspo-token":
    nonempty = (mask.sum(axis=-1) > 0).astype(jnp.float32)
    n_rows = jnp.maximum(nonempty.sum(), 1.0)
    s = jnp.exp(seq_log_ratio)
    a_seq = adv[:, 0]
    seq_clipped = ((a_seq < 0) & (s < 1.0 - eps_lo)) | ((a_seq > 0) & (s > 1.0 + eps_hi))
    aux["seq_ratio_mean"] = (s * nonempty).sum() / n_rows
    aux["seq_clip_fraction"] = (seq_clipped.astype(jnp.float32) * nonempty).sum() / n_rows
  aux = {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in aux.items()}
  return loss.astype(jnp.float32), aux


ROLLOUT_IS_MODES = ("off", "truncate", "mask")


def rollout_is_weights(
    old_per_token_logps: Any, behaviour_per_token_logps: Any, completion_mask: Any, mode: str, cap: float
) -> tuple[np.ndarray, dict[str, float]]:
  """Rollout importance weights w [B, T] and their metrics (formulas in the module docstring); host NumPy, float32.

  Computed once per rollout batch, outside the differentiated loss (the weights are constants there).
  """
  _check_choice("rollout_is", mode, ROLLOUT_IS_MODES)
  if not cap > 1.0:
    raise ValueError(f"rollout_is_cap must be > 1; got {cap}")
  m = np.asarray(completion_mask).astype(np.float64)
  valid = m > 0
  d = np.where(
      valid, np.asarray(old_per_token_logps, np.float64) - np.asarray(behaviour_per_token_logps, np.float64), 0.0
  )
  d = np.clip(d, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  ratio = np.exp(d)
  n_tok = max(m.sum(), 1.0)
  metrics = {"is_truncated_fraction": float(((ratio > cap) & valid).sum() / n_tok), "is_masked_fraction": 0.0}
  if mode == "off":
    w = np.ones_like(ratio)
  elif mode == "truncate":
    w = np.minimum(ratio, cap)
  else:
    lengths = m.sum(axis=-1)
    seq = np.exp((d * m).sum(axis=-1) / np.maximum(lengths, 1.0))
    keep = (seq >= 1.0 / cap) & (seq <= cap)
    w = np.broadcast_to(keep[:, None], ratio.shape).astype(np.float64)
    nonempty = lengths > 0
    metrics["is_masked_fraction"] = float((~keep & nonempty).sum() / max(nonempty.sum(), 1))
  w = np.where(valid, w, 0.0)
  metrics["is_weight_mean"] = float(w.sum() / n_tok)
  return w.astype(np.float32), metrics


def group_advantages(rewards: Any, num_generations: int, norm: str = "group_std", estimator: str = "grpo") -> Any:
  """Advantages over contiguous groups of `num_generations` completions of the same prompt (module docstring).

  Works on NumPy (host rewards, as Tunix's learner passes them) and on JAX arrays (jit-able); returns the same kind.
  The baselines and GRPO's group scaling are Tunix's own `algo_core` estimators (public, registered in its function
  registry); a group with identical rewards gets all-zero advantages (it carries no learning signal).
  """
  _check_choice("advantage_estimator", estimator, ADVANTAGE_ESTIMATORS)
  _check_choice(f"advantage norm of {estimator}", norm, ESTIMATOR_NORMS[estimator])
  xp = jnp if isinstance(rewards, jax.Array) else np
  r = xp.asarray(rewards)
  if not xp.issubdtype(r.dtype, xp.floating):
    r = r.astype(xp.float32)
  if num_generations < 2 or r.ndim != 1 or r.shape[0] % num_generations:
    raise ValueError(
        f"rewards must be 1-D with a length divisible by num_generations >= 2; got shape {r.shape}, "
        f"num_generations={num_generations}"
    )
  if norm == "group_std":  # grpo only
    return algo_core.compute_advantages(r, num_generations)
  if estimator == "rloo":
    centered = algo_core.compute_rloo_advantages(r, num_generations)
  else:
    centered = algo_core.compute_drgrpo_advantages(r, num_generations)
  if norm == "batch_std":
    centered = centered / (centered.std(ddof=1) + _ADV_STD_EPS)
  return centered


def completion_lengths(completion_ids: Any, pad_id: int) -> np.ndarray:
  """[B] tokens of each right-padded completion (its stop token included)."""
  return (np.asarray(completion_ids) != pad_id).sum(axis=-1)


def truncated_rows(completion_ids: Any, pad_id: int, stop_ids: Any) -> np.ndarray:
  """[B] bool: completions cut by the length limit T = completion_ids.shape[-1] (all T tokens used, the last one not a
  stop token); see the module docstring."""
  ids = np.asarray(completion_ids)
  full = completion_lengths(ids, pad_id) >= ids.shape[-1]
  return full & ~np.isin(ids[:, -1], np.asarray(list(stop_ids), ids.dtype))


def overlong_penalty(token_rows: Sequence[Sequence[int]], max_len: int, buffer_len: int, factor: float) -> np.ndarray:
  """[B] float32 DAPO soft overlong punishment R_len of each completion's token count (module docstring).

  Tunix's `dapo_learner.reward_shaping` computes min(-(n - (L_max - L_c)) / L_c * f, 0) of len(completion); given
  the token sequences, n is the token count. The paper's -f floor beyond L_max is added (unreachable at T).
  """
  if not 0 < buffer_len <= max_len or factor < 0:
    raise ValueError(f"need 0 < buffer_len <= max_len and factor >= 0; got {buffer_len}, {max_len}, {factor}")
  shaped = dapo_learner.reward_shaping(
      prompts=[],
      completions=[list(t) for t in token_rows],
      mode=rl_cluster_lib.Mode.TRAIN,
      overlong_buffer={
          "overlong_buffer_length": int(buffer_len),
          "overlong_buffer_penalty": float(factor),
          "max_response_length": int(max_len),
      },
  )
  return np.maximum(np.asarray(shaped, np.float64), -float(factor)).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------------
# Tunix wiring
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class PluginGrpoConfig(grpo_learner.GRPOConfig):
  """Tunix `GRPOConfig` whose learner computes the loss with this module's `policy_loss` and `group_advantages`.

  `GRPOLearner.__init__` looks the loss up by `policy_loss_fn` in Tunix's function registry and the advantage by
  `advantage_estimator`; the defaults below name the functions `register_with_tunix` registers (done on
  construction, so a config can never name an unregistered function).
  """

  policy_loss_fn: str = POLICY_LOSS_FN_NAME
  advantage_estimator: str = ADVANTAGE_ESTIMATOR_NAMES[("grpo", "group_std")]
  epsilon_high: float | None = None
  kl_estimator: str = "k3"
  kl_loss_mode: str = "low_var_kl"
  loss_agg_mode: str = "sequence-mean-token-mean"
  # Token entropy of the policy (a metric only, no gradient); costs one [B, T, vocab] softmax per step.
  compute_entropy: bool = True

  def __post_init__(self):
    super().__post_init__()
    _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    _check_choice("loss_agg_mode", self.loss_agg_mode, AGG_MODES)
    if self.epsilon_high is None:
      self.epsilon_high = self.epsilon
    if not 0.0 <= self.epsilon <= 1.0 or self.epsilon_high < 0.0:
      raise ValueError(f"need 0 <= epsilon <= 1 and epsilon_high >= 0; got {self.epsilon}, {self.epsilon_high}")
    if self.beta < 0.0:
      raise ValueError(f"beta must be >= 0; got {self.beta}")
    self.kl_loss_mode = _TUNIX_KL_MODE[self.kl_estimator]
    register_with_tunix()


def tunix_policy_loss_fn(
    model: nnx.Module,
    train_example: Any,
    algo_config: PluginGrpoConfig,
    pad_id: int,
    eos_id: int,
    **unused_kwargs: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Tunix policy-loss entry point (registered as `POLICY_LOSS_FN_NAME`): model forward, then `policy_loss`.

  Same contract as Tunix's `grpo_loss_fn`: the learner calls it inside the trainer's jitted, differentiated step
  with the actor model, a `TrainExample` and its algo config.
  """
  compute_entropy = getattr(algo_config, "compute_entropy", True)
  graphdef, state = nnx.split(model)
  # MoE (moe.py): replay the sampler's routing (rl.router_replay) and add MaxText's load-balancing term.
  maxtext_config = getattr(getattr(model, "base", None), "config", None)
  forced = getattr(train_example, "routed_experts", None)
  lb_weight = float(getattr(maxtext_config, "load_balance_loss_weight", 0.0) or 0.0)
  if forced is not None or (lb_weight > 0 and moe.is_moe(maxtext_config)):
    per_token_logps, logits, _, lb_loss = moe.forward_logps(
        graphdef,
        state,
        train_example.prompt_ids,
        train_example.completion_ids,
        pad_id,
        eos_id,
        temperature=getattr(algo_config, "temperature", 1.0),
        forced=forced,
        config=maxtext_config,
    )
  else:
    lb_loss = None
    per_token_logps, logits = tunix_common.compute_per_token_logps(
        graphdef,
        state,
        prompt_tokens=train_example.prompt_ids,
        completion_tokens=train_example.completion_ids,
        pad_id=pad_id,
        eos_id=eos_id,
        stop_gradient=False,
        return_logits=True,
        segment_ids=getattr(train_example, "segment_ids", None),
        segment_positions=getattr(train_example, "segment_positions", None),
        temperature=getattr(algo_config, "temperature", 1.0),
    )
  beta = float(algo_config.beta)
  loss, aux = policy_loss(
      per_token_logps,
      train_example.old_per_token_logps,
      train_example.ref_per_token_logps if beta != 0.0 else None,
      train_example.advantages,
      train_example.completion_mask,
      loss_algo=algo_config.loss_algo,
      epsilon=float(algo_config.epsilon),
      epsilon_high=None if algo_config.epsilon_high is None else float(algo_config.epsilon_high),
      beta=beta,
      kl_estimator=getattr(algo_config, "kl_estimator", "k3"),
      loss_agg_mode=algo_config.loss_agg_mode,
      is_weights=getattr(train_example, "sampler_is_weights", None),
  )
  if lb_loss is not None:  # MaxText's meaning: added to the objective as its pre-training loss adds it
    loss = loss + lb_loss
    aux["moe_lb_loss"] = lb_loss
  if compute_entropy:
    log_probs = jax.nn.log_softmax(jax.lax.stop_gradient(logits).astype(jnp.float32), axis=-1)
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    aux["entropy"] = _token_mean(entropy, train_example.completion_mask.astype(jnp.float32))
  return loss, aux


def _advantage_estimator(estimator: str, norm: str) -> Callable[..., Any]:
  def fn(rewards: Any, num_generations: int, **unused_kwargs: Any) -> Any:
    return group_advantages(rewards, num_generations, norm, estimator)

  fn.__name__ = f"group_advantages_{estimator}_{norm}"
  return fn


_ADVANTAGE_ESTIMATORS = {key: _advantage_estimator(*key) for key in ADVANTAGE_ESTIMATOR_NAMES}


def register_with_tunix() -> None:
  """Register the policy loss and advantage estimators in Tunix's default function registry (idempotent)."""
  registry = function_registry.default_registry
  wanted = [("policy_loss_fn", POLICY_LOSS_FN_NAME, tunix_policy_loss_fn)]
  wanted += [("advantage_estimator", ADVANTAGE_ESTIMATOR_NAMES[n], fn) for n, fn in _ADVANTAGE_ESTIMATORS.items()]
  for category, name, fn in wanted:
    try:
      if registry.get(category, name) is fn:
        continue
    except LookupError:
      pass
    registry.register(category, name)(fn)
    logging.info("Registered %s '%s' with Tunix", category, name)


def rl_metrics_to_log(algo_config: PluginGrpoConfig) -> dict[str, Callable[[Any], Any]]:
  """Aux keys of `tunix_policy_loss_fn` to hand to `actor_trainer.with_rl_metrics_to_log` (the learner logs only
  `kl` and `pg_clipfrac` by default); each is averaged over the steps of a logging window."""
  keys = [
      "kl",
      "pg_clipfrac",
      "pg_loss",
      "kl_loss",
      "ppo_kl",
      "ratio_mean",
      "ratio_min",
      "ratio_max",
      "clip_fraction_low",
      "clip_fraction_high",
  ]
  if algo_config.loss_algo == "gspo-token":
    keys += ["seq_ratio_mean", "seq_clip_fraction"]
  if getattr(algo_config, "compute_entropy", True):
    keys.append("entropy")
  return {k: np.mean for k in keys}


def tunix_algo_config(config: Any, **overrides: Any) -> PluginGrpoConfig:
  """Map the plugin's MaxText config (`config.rl.*`) to the Tunix algo config the learner is built with.

  The clip ranges and beta were refused by `validation.validate` (its RANGES table) when the config was loaded;
  raises `ConfigError` naming the key for a loss aggregation the loss cannot use.
  """
  rl = config.rl
  epsilon = float(rl.grpo_epsilon)
  epsilon_high = None if rl.epsilon_high is None else float(rl.epsilon_high)
  if rl.loss_agg_mode not in LOSS_AGG_MODES:
    raise ConfigError(f"rl.loss_agg_mode={rl.loss_agg_mode!r}: expected one of {', '.join(LOSS_AGG_MODES)}")
  estimator, norm, loss_agg_mode = advantage_config(rl)
  if rl.loss_algo == "gspo-token" and int(rl.num_iterations) == 1:
    logging.warning(
        "loss_algo=gspo-token with num_iterations=1: on-policy ratios are 1, so the gradient is exactly "
        "GRPO's under the same loss_agg_mode (GSPO differs only through its sequence-level clipping)"
    )
  kwargs = {
      "num_generations": int(rl.num_generations),
      "num_iterations": int(rl.num_iterations),
      "beta": float(rl.grpo_beta),
      "epsilon": epsilon,
      "epsilon_high": epsilon_high,
      "loss_algo": rl.loss_algo,
      "loss_agg_mode": loss_agg_mode,
      "kl_estimator": rl.kl_estimator,
      "advantage_estimator": ADVANTAGE_ESTIMATOR_NAMES[(estimator, norm)],
  }
  kwargs.update(overrides)
  return PluginGrpoConfig(**kwargs)


def advantage_config(rl: Any) -> tuple[str, str, str]:
  """(estimator, scaling, loss aggregation) of the `rl:` block: `rl.advantage_norm: null` resolved to the estimator's
  own scaling and Dr. GRPO's aggregation; a combination that makes no sense is a one-line `ConfigError`."""
  estimator = rl.advantage_estimator
  if estimator not in ADVANTAGE_ESTIMATORS:
    raise ConfigError(f"rl.advantage_estimator={estimator!r}: expected one of {', '.join(ADVANTAGE_ESTIMATORS)}")
  allowed = ESTIMATOR_NORMS[estimator]
  norm = allowed[0] if rl.advantage_norm is None else rl.advantage_norm
  if norm not in allowed:
    raise ConfigError(
        f"invalid value for 'rl.advantage_norm'='{norm}' with rl.advantage_estimator={estimator}: expected one of "
        f"{', '.join(allowed)} (a per-group std scale reweights questions by difficulty, which {estimator} avoids)"
    )
  agg = rl.loss_agg_mode
  if estimator == "drgrpo":
    if agg != "sequence-mean-token-mean":
      raise ConfigError(
          f"invalid value for 'rl.loss_agg_mode'='{agg}' with rl.advantage_estimator=drgrpo: Dr. GRPO aggregates with "
          f"its constant length ({TOKEN_SCALE}); leave rl.loss_agg_mode at sequence-mean-token-mean, which it replaces"
      )
    agg = TOKEN_SCALE
  return estimator, norm, agg


def check_config(pc: Any) -> None:
  """Device-free checks of the advantage, overlong and MoE keys (config.validate), one line each."""
  advantage_config(pc.rl)
  moe.check_config(pc)
  budget = int(pc.max_target_length) - int(pc.max_prefill_predict_length)
  if int(pc.rl.overlong_buffer_len) > budget:
    raise ConfigError(
        f"invalid value for 'rl.overlong_buffer_len'={pc.rl.overlong_buffer_len}: must be at most the completion "
        f"budget max_target_length - max_prefill_predict_length = {budget} tokens"
    )
