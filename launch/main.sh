#!/usr/bin/env bash
# The main job, end to end on the embedded default (tiny Qwen3 on CPU, embedded real-shell data):
#   generate trajectories -> prepare a verified manifest -> meta-train with 4 pipeline stages on
#   4 CPU ranks -> evaluate held-out trajectories (ttt vs frozen; current-round and full context)
#   -> memory test (both policies) -> export -> adaptation report (issue 7 targets).
#
#   bash setup.sh && bash launch/main.sh [WORK_DIR]        # WORK_DIR defaults to runs/main
#
# About 35-38 minutes on a 2-core CPU machine (measured 2026-12-01), most of it training (MAX_STEPS). Environment knobs:
#   NUM_TRAJ (300)   trajectories of the main corpus; 10% of them (by group hash) are the held-out split
#   NUM_EXTRA (600)  extra memory-family episodes, another seed, added to the train split only
#                    (prepare.py --train-only: the held-out split stays exactly the main corpus's)
#   SEED (0), MAX_STEPS (1400), DS_CONFIG (ds_configs/cpu_tiny.json), RUN_CONFIG (ds_configs/run_cpu_tiny.json)
#   REPORT (WORK_DIR/adaptation.json)  where the adaptation report goes
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK="${1:-runs/main}"
NUM_TRAJ="${NUM_TRAJ:-300}"
NUM_EXTRA="${NUM_EXTRA:-600}"
SEED="${SEED:-0}"
EXTRA_SEED=$((SEED + 1))
MAX_STEPS="${MAX_STEPS:-1400}"
DS_CONFIG="${DS_CONFIG:-ds_configs/cpu_tiny.json}"
RUN_CONFIG="${RUN_CONFIG:-ds_configs/run_cpu_tiny.json}"
REPORT="${REPORT:-$WORK/adaptation.json}"
PY=.venv/bin/python
export OMP_NUM_THREADS=1 WANDB_MODE="${WANDB_MODE:-offline}" DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"
mkdir -p "$WORK"
t0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - t0 )) s] $*"; }

step "1/8 generate $NUM_TRAJ trajectories (seed $SEED) and $NUM_EXTRA extra memory episodes (seed $EXTRA_SEED) in real bash sandboxes"
$PY data_prep/generate.py --out "$WORK/raw" --num "$NUM_TRAJ" --seed "$SEED"
$PY data_prep/generate.py --out "$WORK/raw_extra" --num "$NUM_EXTRA" --seed "$EXTRA_SEED" --family memory --no-token-stats

step "2/8 prepare the manifest (compact Qwen3 vocabulary, capacity filter, split, hashes; extra episodes train-only)"
$PY data_prep/prepare.py --inputs "$WORK/raw/trajectories.jsonl" --train-only "$WORK/raw_extra/trajectories.jsonl" \
  --out "$WORK/data" --seed "$SEED" --trim-vocab

step "3/8 meta-train: 4 pipeline stages on 4 CPU ranks, $MAX_STEPS steps"
.venv/bin/deepspeed --num_gpus 4 launch/train.py --deepspeed_config "$DS_CONFIG" --run_config "$RUN_CONFIG" \
  --data "$WORK/data/manifest.json" --output "$WORK/run" --max_steps "$MAX_STEPS"

step "4/8 evaluate the held-out split: ttt vs frozen, the trained context policy"
$PY evals/evaluate.py --checkpoint "$WORK/run" --manifest "$WORK/data/manifest.json" --out "$WORK/eval" > /dev/null

step "5/8 evaluate the held-out split again with full context in attention"
$PY evals/evaluate.py --checkpoint "$WORK/run" --manifest "$WORK/data/manifest.json" --out "$WORK/eval_full" \
  --context-policy full > /dev/null

step "6/8 memory test: 32 fresh worlds, trained policy and full context"
$PY evals/memory_test.py --checkpoint "$WORK/run" --out "$WORK/memory" > /dev/null
$PY evals/memory_test.py --checkpoint "$WORK/run" --out "$WORK/memory_full" --context-policy full > /dev/null

step "7/8 export for serving (Hugging Face layout + prime weights)"
$PY launch/export.py --checkpoint "$WORK/run" --out "$WORK/export"

step "8/8 adaptation report"
elapsed=$(( $(date +%s) - t0 ))
setup_s=0
# setup.sh records how long it took; count it when it ran right before this job (the README command)
if [ -f .venv/.setup_seconds ] && [ $(( t0 - $(stat -c %Y .venv/.setup_seconds) )) -lt 60 ]; then
  setup_s=$(cat .venv/.setup_seconds)
fi
minutes=$(awk -v a="$elapsed" -v b="$setup_s" 'BEGIN { printf "%.1f", (a + b) / 60 }')
$PY evals/adaptation_report.py --eval "$WORK/eval" --memory "$WORK/memory" --eval-full "$WORK/eval_full" \
  --memory-full "$WORK/memory_full" --minutes "$minutes" --run-config "$RUN_CONFIG" \
  --seeds "{\"main_corpus\": $SEED, \"extra_memory_episodes\": $EXTRA_SEED, \"num_traj\": $NUM_TRAJ, \"num_extra\": $NUM_EXTRA, \"max_steps\": $MAX_STEPS, \"setup_seconds\": $setup_s, \"main_seconds\": $elapsed}" \
  --command "bash setup.sh && bash launch/main.sh  # NUM_TRAJ=$NUM_TRAJ NUM_EXTRA=$NUM_EXTRA SEED=$SEED MAX_STEPS=$MAX_STEPS" \
  --out "$REPORT" > /dev/null

step "done in $(( $(date +%s) - t0 )) s (with setup: $minutes min)"
echo
cat "$WORK/eval/summary.md" | sed -n '1,20p'
echo
cat "$WORK/memory/summary.md"
echo
cat "${REPORT%.json}.md"
