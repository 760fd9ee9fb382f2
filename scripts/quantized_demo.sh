#!/usr/bin/env bash
# The CPU demo with a quantized sampler beside the float32 one (docs/cpu_demo.md, "A low-precision sampler"):
#   bash scripts/quantized_demo.sh OUT [SEED]
# One shared 300-step SFT warm start, then 100 GRPO steps each: float32 sampler, fp8 sampler, fp8 sampler with
# truncated rollout importance sampling (rl.rollout_is=truncate), and fp8 with only the key IS needs
# (rl.use_rollout_logps=false), which separates IS from that key. The trainer is float32 in all three; only the
# sampler's weights differ (rollout_quantization). Prints eval accuracy @0/@100, the train reward of the first and
# last 10 steps and the parity gate's figures of step 1 per run. Runs niced; a finished run is not run again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: scripts/quantized_demo.sh OUT [SEED]}"
SEED="${2:-0}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"
mkdir -p "$OUT"

run() {  # name, overrides...
  local name="$1"; shift
  if [[ -f "$OUT/$name.done" ]]; then return; fi
  if [[ "$name" != f32 && -d "$OUT/runs/f32/checkpoints/sft" && ! -d "$OUT/runs/$name/checkpoints/sft" ]]; then
    mkdir -p "$OUT/runs/$name/checkpoints" && cp -r "$OUT/runs/f32/checkpoints/sft" "$OUT/runs/$name/checkpoints/"
  fi
  nice -n 10 "$PY" -m maxtext_rl_plugin.train_rl configs/cpu_demo.yml base_output_directory="$OUT/runs" \
    run_name="$name" rollout_seed="$SEED" data_shuffle_seed="$SEED" rl.parity_check=every_n rl.parity_check_every=25 \
    rl.parity_logp_tolerance_mean=10 rl.parity_logp_tolerance_max=100 "$@" > "$OUT/$name.log" 2>&1
  touch "$OUT/$name.done"
}

run f32
run fp8 rollout_quantization=fp8
run fp8_is rollout_quantization=fp8 rl.rollout_is=truncate rl.use_rollout_logps=false
run fp8_nolp rollout_quantization=fp8 rl.use_rollout_logps=false  # isolates the key IS needs from IS itself

"$PY" - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| sampler | eval acc. @0 | @100 | reward steps 1-10 | 91-100 | parity mean / max |d| (step 1) |")
print("| --- | ---: | ---: | ---: | ---: | --- |")
for name, label in (("f32", "float32"), ("fp8", "fp8"), ("fp8_is", "fp8 + rl.rollout_is=truncate"),
                    ("fp8_nolp", "fp8 + rl.use_rollout_logps=false")):
  path = out / "runs" / name / "metrics.jsonl"
  if not path.exists():
    print(f"| {label} | not run yet | | | | |")
    continue
  recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  evals = [r for r in recs if "eval/accuracy" in r]
  rewards = [r["reward/mean"] for r in recs if "reward/mean" in r]
  parity = [r for r in recs if "parity/logp_abs_diff_mean" in r]
  first = f"{100 * evals[0]['eval/accuracy']:.1f}%" if evals else "-"
  last = f"{100 * evals[-1]['eval/accuracy']:.1f}%" if len(evals) > 1 else "-"
  r0 = f"{sum(rewards[:10]) / max(len(rewards[:10]), 1):.3f}" if rewards else "-"
  r1 = f"{sum(rewards[-10:]) / 10:.3f}" if len(rewards) >= 100 else f"({len(rewards)} steps)"
  p = f"{parity[0]['parity/logp_abs_diff_mean']:.2g} / {parity[0]['parity/logp_abs_diff_max']:.2g}" if parity else "-"
  print(f"| {label} | {first} | {last} | {r0} | {r1} | {p} |")
EOF
