#!/usr/bin/env bash
# Regenerates this fixture: a checkpoint written by the plugin before the actor update accumulated micro-batches
# itself (accumulation.py), i.e. with Tunix's optax.MultiSteps optimizer state (opt_state.{mini_step, gradient_step,
# inner_opt_state, acc_grads}). Provenance: run at commit 2fbc39a (branch main, Nov 28 2026) with that checkout's
# .venv: `git worktree add --detach /tmp/old 2fbc39a && cd /tmp/old && bash scripts/venv.sh && bash <this file>`.
# It keeps step 1's checkpoint (params + MultiSteps optimizer state + meta) and step 2's params (the uninterrupted
# run's result, the reference tests/run/test_accumulation.py resumes towards).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mktemp -d)"
JAX_PLATFORMS=cpu .venv/bin/python -m maxtext_rl_plugin.train_rl $(cat "$here/args.txt") \
  "reward_functions_path=$here/rewards.py" reward_functions=alternating base_output_directory="$out" run_name=legacy_multisteps
rm -rf "$here/checkpoints" && mkdir -p "$here/checkpoints/2"
cp -r "$out/legacy_multisteps/checkpoints/1" "$here/checkpoints/1"
cp -r "$out/legacy_multisteps/checkpoints/2/params" "$here/step2_params"
rm -rf "$here/checkpoints/2" "$out"
