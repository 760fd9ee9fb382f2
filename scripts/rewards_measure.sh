#!/bin/bash
# Issue 63's CPU measurements (docs/rewards.md "Several rewards" and "Reward models"), 3 seeds each:
#   bash scripts/rewards_measure.sh [OUT]      (SEEDS="0 1 2" PARTS="rm rl_rm twoobj" PY=.venv/bin/python by default)
# Seed s = init_weights_seed=s rollout_seed=s synthetic_seed=1234+s (as docs/cpu_demo.md). Each RL run is the CPU
# demo (configs/cpu_demo.yml: its 300-step warm start on the flawed teacher, then RL) shortened to 40 RL steps.
#   rm:     1000 preference pairs from the demo's train split (true solution vs the flawed teacher's), a reward model
#           of the demo's size trained on 800 of them (every 5th held out), 150 steps of 16 pairs.
#   rl_rm:  RL against the reward model alone (check_answer kept at weight 0: logged, no signal), eval every 10 steps.
#   twoobj: check_answer (0/1) + brevity (0..0.1, 10x narrower), rl.reward_aggregation=sum and =gdpo.
# Then: python scripts/rewards_measure.py summary OUT/*   (one JSON line per run)
set -u
OUT=${1:-runs/rewards_measure}
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-"0 1 2"}
PARTS=${PARTS:-"rm rl_rm twoobj"}
mkdir -p "$OUT"
seed_keys() { echo "init_weights_seed=$1 rollout_seed=$1 synthetic_seed=$((1234 + $1))"; }
for s in $SEEDS; do
  if [[ " $PARTS " == *" rm "* ]]; then
    $PY scripts/rewards_measure.py pairs "$OUT/pairs_s$s.jsonl" 1000 $(seed_keys "$s")
    $PY -m maxtext_rl_plugin.train_rm configs/cpu_demo.yml $(seed_keys "$s") data_shuffle_seed="$s" \
      train_data_path="$OUT/pairs_s$s.jsonl" base_output_directory="$OUT" run_name="rm_s$s" \
      batch_size=16 num_batches=150 learning_rate=1e-3 eval_interval=50 log_period=25 checkpoint_period=150
  fi
  if [[ " $PARTS " == *" rl_rm "* ]]; then
    $PY -m maxtext_rl_plugin.train_rl configs/cpu_demo.yml $(seed_keys "$s") base_output_directory="$OUT" \
      run_name="rl_rm_s$s" num_batches=40 eval_interval=10 checkpoint_period=40 \
      reward_functions=check_answer "rl.reward_weights=[0]" rl.reward_model_path="$OUT/rm_s$s"
  fi
  if [[ " $PARTS " == *" twoobj "* ]]; then
    for agg in sum gdpo; do
      $PY -m maxtext_rl_plugin.train_rl configs/cpu_demo.yml $(seed_keys "$s") base_output_directory="$OUT" \
        run_name="twoobj_${agg}_s$s" num_batches=40 eval_interval=20 checkpoint_period=40 \
        reward_functions=check_answer,brevity reward_functions_path=scripts/rewards_measure.py \
        rl.reward_aggregation="$agg"
    done
  fi
done
$PY scripts/rewards_measure.py summary "$OUT"/rm_s* "$OUT"/rl_rm_s* "$OUT"/twoobj_*
