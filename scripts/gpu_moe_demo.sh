#!/usr/bin/env bash
# The MoE demo (configs/cpu_demo_moe.yml) in bfloat16 on a GPU, with and without router replay, SEEDS
# (docs/moe.md, "The MoE demo with a bf16 sampler"): the learning comparison the 2-core host could not fit. Per seed one
# warm start, copied into the replay run's directory as docs/cpu_demo.md's recipe does, so both runs start from the
# same weights; the seeds run side by side on the one GPU. The parity gate runs every 10 steps, so the
# sampler-trainer mismatch is logged along the way. Results (metrics.jsonl, summary.json, log per run) land in
# $OUT/moe_demo.tgz.
#   bash scripts/gpu_moe_demo.sh            (on the device machine: run(carry=[".whl"]))
# BUDGET_S (default 540) bounds it: runs still going then are stopped, and what they wrote comes back. DEMO_ARGS adds
# key=value overrides to every run (a smoke run: DEMO_ARGS="sft_warmup_steps=5 num_batches=2"); WARM must then match.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu_out}"
BUDGET_S="${BUDGET_S:-540}"
SEEDS="${SEEDS:-0 1}"  # one lane per seed, side by side (measured: 0 1, then 2 3)
WARM="${WARM:-300}"  # the config's sft_warmup_steps: the replay run waits for that checkpoint
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
if [ -z "${NO_SITE:-}" ]; then  # NO_SITE=1: use the python3 and PYTHONPATH already set (a CPU check of this script)
  # shellcheck source=scripts/gpu_site.sh
  source "$ROOT/scripts/gpu_site.sh"
fi
SITE="${SITE:-/tmp/site}"

RUNS="${RUNS:-/tmp/moe_runs}"
mkdir -p "$RUNS"
# Four processes share the GPU; each reserves a slice instead of XLA's default 75%.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.2
# Deterministic GPU reductions, so 'replay' against 'off' differs by replay alone (checked: the flag is known).
if XLA_FLAGS=--xla_gpu_deterministic_ops=true python3 -c 'import jax; jax.numpy.ones(2).block_until_ready()' 2>/dev/null; then
  export XLA_FLAGS="--xla_gpu_deterministic_ops=true"
fi
echo "XLA_FLAGS=${XLA_FLAGS:-}"

run() {  # run NAME SEED [key=value ...]
  local name=$1 s=$2; shift 2
  python3 -m maxtext_rl_plugin.train_rl "$CONFIG" dtype=bfloat16 \
    base_output_directory="$RUNS" run_name="$name" init_weights_seed="$s" rollout_seed="$s" \
    synthetic_seed=$((1234 + s)) rl.parity_check=every_n rl.parity_check_every=10 ${DEMO_ARGS:-} "$@" > "$RUNS/$name.log" 2>&1
  echo "$name rc=$? at ${SECONDS}s"
}

lane() {  # one seed: the free run; once its warm start is on disk, the replay run from a copy of it
  local s=$1 sft="$RUNS/moe_bf16_s$1/checkpoints/sft"
  run "moe_bf16_s$s" "$s" &
  local free=$!
  until [ -d "$sft/$WARM" ] || ! kill -0 "$free" 2>/dev/null; do sleep 2; done
  sleep 2
  mkdir -p "$RUNS/moe_bf16_s${s}_replay/checkpoints" && cp -r "$sft" "$RUNS/moe_bf16_s${s}_replay/checkpoints/"
  run "moe_bf16_s${s}_replay" "$s" rl.router_replay=true
  wait "$free"
}

CONFIG="${CONFIG:-$(python3 -c 'import maxtext_rl_plugin, os; print(os.path.join(os.path.dirname(maxtext_rl_plugin.__file__), "configs", "cpu_demo_moe.yml"))')}"
lanes=()
for s in $SEEDS; do
  lane "$s" &
  lanes+=($!)
done
( sleep $((BUDGET_S - SECONDS)); echo "budget reached at ${SECONDS}s: stopping the runs"; pkill -f maxtext_rl_plugin.train_rl ) &
watchdog=$!
wait "${lanes[@]}"
kill "$watchdog" 2>/dev/null
# One archive: the device tool brings back a bounded number of files.
for d in "$RUNS"/moe_bf16_*/; do cp "$RUNS/$(basename "$d").log" "$d/log.txt" 2>/dev/null; done
(cd "$RUNS" && tar czf "$OUT/moe_demo.tgz" moe_bf16_*/metrics.jsonl moe_bf16_*/summary.json moe_bf16_*/log.txt)
echo "done at ${SECONDS}s"
