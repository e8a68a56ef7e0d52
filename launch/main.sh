#!/usr/bin/env bash
# The main job, end to end on the embedded default (tiny Qwen3 on CPU, embedded real-shell data):
#   generate trajectories -> prepare a verified manifest -> meta-train with 4 pipeline stages on
#   4 CPU ranks -> evaluate held-out trajectories (ttt vs frozen) -> memory test -> export.
#
#   bash setup.sh && bash launch/main.sh [WORK_DIR]        # WORK_DIR defaults to runs/main
#
# Environment knobs: NUM_TRAJ (default 300), SEED (0), MAX_STEPS (default 200), NUM_STAGES via the
# ds_config, DS_CONFIG (ds_configs/cpu_tiny.json), RUN_CONFIG (ds_configs/run_cpu_tiny.json if present).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK="${1:-runs/main}"
NUM_TRAJ="${NUM_TRAJ:-300}"
SEED="${SEED:-0}"
MAX_STEPS="${MAX_STEPS:-200}"
DS_CONFIG="${DS_CONFIG:-ds_configs/cpu_tiny.json}"
RUN_CONFIG="${RUN_CONFIG:-ds_configs/run_cpu_tiny.json}"
PY=.venv/bin/python
export OMP_NUM_THREADS=1 WANDB_MODE="${WANDB_MODE:-offline}" DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"
mkdir -p "$WORK"
t0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - t0 )) s] $*"; }
need() { [ -f "$1" ] || { echo "main job stopped: $1 does not exist yet ($2)"; exit 3; }; }

step "1/6 generate $NUM_TRAJ trajectories in real bash sandboxes (seed $SEED)"
$PY data_prep/generate.py --out "$WORK/raw" --num "$NUM_TRAJ" --seed "$SEED"

step "2/6 prepare the manifest (tokenize with a compact Qwen3 vocabulary, capacity filter, split, hashes)"
$PY data_prep/prepare.py --inputs "$WORK/raw/trajectories.jsonl" --out "$WORK/data" --seed "$SEED" --trim-vocab

step "3/6 meta-train: 4 pipeline stages on 4 CPU ranks"
need launch/train.py "the pipeline trainer, issue 5"
extra=()
[ -f "$RUN_CONFIG" ] && extra+=(--run_config "$RUN_CONFIG")
.venv/bin/deepspeed --num_gpus 4 launch/train.py --deepspeed_config "$DS_CONFIG" \
  --data "$WORK/data/manifest.json" --output "$WORK/run" --max_steps "$MAX_STEPS" "${extra[@]}"

step "4/6 evaluate the held-out split: ttt vs frozen"
need evals/evaluate.py "held-out evaluation, issue 6"
$PY evals/evaluate.py --checkpoint "$WORK/run" --manifest "$WORK/data/manifest.json" --out "$WORK/eval"

step "5/6 memory test: 32 fresh worlds"
need evals/memory_test.py "memory test, issue 6"
$PY evals/memory_test.py --checkpoint "$WORK/run" --out "$WORK/memory"

step "6/6 export for serving (Hugging Face layout + prime weights)"
need launch/export.py "safetensors export, issue 6"
$PY launch/export.py --checkpoint "$WORK/run" --out "$WORK/export"

step "done in $(( $(date +%s) - t0 )) s"
[ -f "$WORK/eval/summary.md" ] && cat "$WORK/eval/summary.md"
[ -f "$WORK/memory/summary.md" ] && cat "$WORK/memory/summary.md"
exit 0
