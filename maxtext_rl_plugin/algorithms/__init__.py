r"""The RL math: policy loss, advantage estimators, length shaping, KL and importance sampling; Tunix wiring.

Each concern is a room of its own; import the room that owns the piece (no names are re-exported here):
    loss.py           the policy-loss contract and the objective around a loss: aggregation modes, KL, IS weights
    policy_losses.py  the built-in losses, GRPO and GSPO-token (entry points, as a third party's: docs/extending.md)
    forward.py        the trainer's forward: the log-probs a loss reads (padded, packed, replayed MoE routing)
    advantages.py     the estimator contract, group advantages (GRPO, RLOO, Dr. GRPO) and their scalings
    settings.py       what the math reads of the config, built from it in one place
    shaping.py        completion lengths, truncation, DAPO's overlong penalty
    divergence.py     KL estimators and rollout importance weights (shared by the loss and the experience)
    tunix_wiring.py   the Tunix algo config, registry entries and the learner's loss entry point
    packing.py        max_seq_token_per_tpu: the forwards on packed rows, log-probs gathered to the batch layout
    common.py         the choice check and the numerical guard they share

Notation: B completions, T completion positions, m_{i,t} in {0,1} the completion mask, n_i = sum_t m_{i,t},
lp = log pi_theta(o_{i,t} | q, o_{i,<t}) (`per_token_logps`), lp_old (the sampling policy), lp_ref (the
frozen reference), A_i the (sequence-level) advantage, eps_lo = `epsilon`, eps_hi = `epsilon_high`.

EOS policy: the completion mask the trainer passes covers the tokens *up to and including* the first EOS/stop token
(the plugin trains the stop token, so the policy learns when to stop); everything after it is padding. Padded
positions get exactly zero gradient and may hold any value (even NaN/-inf), as they are replaced before any
arithmetic. Note that Tunix's learner builds the mask as `completion_ids != pad_id`, so the rollout engine must keep
the EOS token in the completion and `pad_id` must differ from `eos_id`.

Numerical guards (no effect in any sane regime): log-ratios and KL log-differences are clamped to +-20 (ratios
within [2e-9, 4.9e8]) so one runaway token cannot overflow exp() and poison the step with inf/NaN.

Every formula is in the docstring of the module that computes it; tests/algorithms/test_algorithms.py checks each
against a NumPy re-derivation.
"""
