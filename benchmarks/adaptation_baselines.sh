#!/usr/bin/env bash
# TTT against the agent users would otherwise train: four models through the real trainer on the same
# data, steps and seed, scored on held-out sets that can tell them apart (the fair comparison, docs/evaluation.md).
#
#   bash benchmarks/adaptation_baselines.sh [WORK_DIR]         # WORK_DIR defaults to runs/baselines
#   SMOKE=1 bash benchmarks/adaptation_baselines.sh runs/smoke  # CI's minute-scale version (tiny everything)
#
# Rows, one after another, each in the main job's layout (`deepspeed --num_gpus 2 launch/train.py` with
# ds_configs/cpu_tiny_pp1_dp2.json: one stage, two data-parallel CPU ranks of one thread each; the
# arrangement measured fastest here, docs/adaptation.md):
#   sft_full      adaptive_layers=0, trainable_scope=all, full context   (the ordinary agent)
#   sft_current   adaptive_layers=0, trainable_scope=all, current_round  (no memory at all: the floor)
#   ttt_full      the main job's TTT recipe, full context
#   ttt_current   the main job's TTT recipe, current_round               (the main job's model)
# and the controls that could explain TTT's gain:
#   ttt_first_order   ttt_current's recipe with first_order=true: the write is applied in training but not
#                     differentiated (TTT without meta-learning)
#   sft_full_compute  sft_full trained for as many steps as ttt_full's measured training seconds buy
#                     at sft_full's measured seconds per step (equal compute, not equal steps)
#   dyn_sft_full / dyn_sft_current   dynamic evaluation: sft_full / sft_current take ttt_full's /
#                     ttt_current's inner step at test time on their own last layers' MLPs, never
#                     meta-trained for it (ds_ttt/evaluation/dynamic_eval.py; no training)
# Every model also does the closed-loop held-out tasks (evals/agent_tasks.py on the test split's task
# suite, greedy, TTT models also frozen): OUT_TASKS.{json,md,png} (benchmarks/results/agent_tasks).
# Every model is scored under its training policy on the test split's held-out sets (evals/heldout_sets.py:
# 128 memory worlds of the held-out pool, >= 100 memory-check rounds, >= 200 recovery rounds, prompts
# never seen in training); TTT models also with their updates off (labelled ablation).
# Writes OUT.{json,md,png} (OUT = benchmarks/results/adaptation_baselines; SMOKE: WORK_DIR/report) with
# the command, seeds and the load average at start and end. Knobs: MAX_STEPS (1000), NUM_TRAJ (300),
# NUM_EXTRA (600), SEED (0), RUN_CONFIG (ds_configs/run_cpu_tiny_no_address.json: the recipe these controls
# were measured with; the round address needs current_round, so the full-context rows cannot take it), DATA
# (reuse a manifest), OUT.
# After `bash launch/main.sh` the main job's model IS the ttt_current row (same data, recipe, layout,
# steps and seed); reuse it instead of training it again:
#   MAIN=runs/main bash benchmarks/adaptation_baselines.sh      # DATA, sets and ttt_current from runs/main
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK="${1:-runs/baselines}"
SMOKE="${SMOKE:-0}"
if [ "$SMOKE" = 1 ]; then
  MAX_STEPS="${MAX_STEPS:-4}" NUM_TRAJ="${NUM_TRAJ:-40}" NUM_EXTRA="${NUM_EXTRA:-20}"
  WORLDS=4 MEMORY=3 RECOVERY=3 OUT="${OUT:-$WORK/report}" OUT_TASKS="${OUT_TASKS:-$WORK/agent_tasks}"
  TASKS_PER_KIND=1 TASK_ARGS=(--max-rounds 2 --max-new-tokens 24)
else
  MAX_STEPS="${MAX_STEPS:-1000}" NUM_TRAJ="${NUM_TRAJ:-300}" NUM_EXTRA="${NUM_EXTRA:-600}"
  WORLDS=128 MEMORY=100 RECOVERY=200 OUT="${OUT:-benchmarks/results/adaptation_baselines}"
  OUT_TASKS="${OUT_TASKS:-benchmarks/results/agent_tasks}" TASKS_PER_KIND=12 TASK_ARGS=()
fi
SEED="${SEED:-0}"
RUN_CONFIG="${RUN_CONFIG:-ds_configs/run_cpu_tiny_no_address.json}"
DS_CONFIG="${DS_CONFIG:-ds_configs/cpu_tiny_pp1_dp2.json}"
PY=.venv/bin/python
source launch/same_checkout.sh && require_same_checkout "$PY"
export OMP_NUM_THREADS=1 WANDB_MODE="${WANDB_MODE:-offline}" DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"
mkdir -p "$WORK"
load_start=$(cut -d' ' -f1 /proc/loadavg)
t0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - t0 )) s] $*"; }

if [ -n "${MAIN:-}" ]; then
  DATA="$MAIN/data/manifest.json"
fi
if [ -z "${DATA:-}" ]; then
  step "data: $NUM_TRAJ trajectories (seed $SEED) + $NUM_EXTRA memory episodes (seed $((SEED + 1))), compact vocabulary"
  $PY data_prep/generate.py --out "$WORK/raw" --num "$NUM_TRAJ" --seed "$SEED" --no-token-stats
  $PY data_prep/generate.py --out "$WORK/raw_extra" --num "$NUM_EXTRA" --seed "$((SEED + 1))" --family memory --no-token-stats
  $PY data_prep/prepare.py --inputs "$WORK/raw/trajectories.jsonl" --train-only "$WORK/raw_extra/trajectories.jsonl" \
    --out "$WORK/data" --seed "$SEED" --trim-vocab > "$WORK/prepare.log"
  DATA="$WORK/data/manifest.json"
fi

if [ -n "${MAIN:-}" ] && [ -f "$MAIN/sets/sets.json" ]; then
  step "held-out sets: the main job's ($MAIN/sets)"
  rm -rf "$WORK/sets" && cp -r "$MAIN/sets" "$WORK/sets"
else
  step "held-out sets (test split): $WORLDS worlds, >= $MEMORY memory-check rounds, >= $RECOVERY recovery rounds"
  $PY evals/heldout_sets.py --manifest "$DATA" --out "$WORK/sets" --split test --worlds "$WORLDS" \
    --memory "$MEMORY" --recovery "$RECOVERY" > /dev/null
fi

if [ -n "${MAIN:-}" ] && [ -f "$MAIN/tasks/suite.json" ]; then
  step "task suite: the main job's ($MAIN/tasks)"
  rm -rf "$WORK/tasks" && cp -r "$MAIN/tasks" "$WORK/tasks"
else
  step "task suite (test split): $TASKS_PER_KIND per kind, every test checked against its solution and doing nothing"
  rm -rf "$WORK/tasks"
  $PY evals/task_suite.py --out "$WORK/tasks" --split test --num-per-kind "$TASKS_PER_KIND" 2> /dev/null
fi

train_row() {  # NAME TTT_OVERRIDE... (MAX_STEPS may be set per call: ROW_STEPS)
  local name=$1
  shift
  local overrides=()
  for kv in "$@"; do overrides+=(--ttt "$kv"); done
  local steps="${ROW_STEPS:-$MAX_STEPS}"
  step "train $name ($steps steps): $*"
  .venv/bin/deepspeed --num_gpus 2 launch/train.py --deepspeed_config "$DS_CONFIG" \
    --run_config "$RUN_CONFIG" --data "$DATA" --output "$WORK/$name" --max_steps "$steps" --seed "$SEED" \
    "${overrides[@]}" > "$WORK/$name.train.log" 2>&1 || { echo "[baselines] $name failed: see $WORK/$name.train.log"; tail -n 20 "$WORK/$name.train.log"; return 1; }
  echo "[baselines] $name trained ($(( $(date +%s) - t0 )) s)"
}

if [ -n "${MAIN:-}" ]; then
  step "ttt_current: the main job's model ($MAIN/run)"
  rm -rf "$WORK/ttt_current" && ln -s "$(realpath "$MAIN/run")" "$WORK/ttt_current"
else
  train_row ttt_current context_policy=current_round
fi
train_row ttt_full context_policy=full
train_row sft_full adaptive_layers=0 trainable_scope=all context_policy=full
train_row sft_current adaptive_layers=0 trainable_scope=all context_policy=current_round
train_row ttt_first_order context_policy=current_round first_order=true
# equal compute: ttt_full's summed training step seconds at sft_full's mean seconds per step
COMPUTE_STEPS=$($PY -c '
import json, sys
secs = lambda run: [json.loads(l)["step_time_s"] for l in open(f"{run}/metrics.jsonl")]
ttt, sft = secs(sys.argv[1]), secs(sys.argv[2])
print(max(1, round(sum(ttt) / (sum(sft) / len(sft)))))' "$WORK/ttt_full" "$WORK/sft_full")
ROW_STEPS=$COMPUTE_STEPS train_row sft_full_compute adaptive_layers=0 trainable_scope=all context_policy=full

step "score every model on the held-out sets (two at a time)"
score() {  # NAME [--dynamic-eval-from RUN]
  local name=$1; shift
  local run="$WORK/$name"
  case "$name" in dyn_*) run="$WORK/${name#dyn_}" ;; esac
  $PY evals/score_baseline.py --checkpoint "$run" --sets "$WORK/sets" --label "$name" --out "$WORK/$name.row.json" "$@" \
    2> "$WORK/$name.score.log"
}
score ttt_current & a=$!
score ttt_full & b=$!
wait $a && wait $b
score sft_full & a=$!
score sft_current & b=$!
wait $a && wait $b
score ttt_first_order & a=$!
score sft_full_compute & b=$!
wait $a && wait $b
score dyn_sft_full --dynamic-eval-from "$WORK/ttt_full" & a=$!
score dyn_sft_current --dynamic-eval-from "$WORK/ttt_current" & b=$!
wait $a && wait $b

step "closed-loop held-out tasks: every model on the suite (greedy; TTT models also frozen)"
tasks() {  # NAME [agent_tasks options]
  local name=$1; shift
  local run="$WORK/$name"
  case "$name" in dyn_*) run="$WORK/${name#dyn_}" ;; esac
  $PY evals/agent_tasks.py --model "$run" --tasks "$WORK/tasks" --label "$name" --out "$WORK/$name.tasks.json" \
    "${TASK_ARGS[@]}" "$@" 2> "$WORK/$name.tasks.log" | tail -n 2
}
tasks ttt_current
tasks ttt_full
tasks sft_full
tasks sft_current
tasks ttt_first_order
tasks sft_full_compute
tasks dyn_sft_full --dynamic-eval-from "$WORK/ttt_full" --modes ttt
tasks dyn_sft_current --dynamic-eval-from "$WORK/ttt_current" --modes ttt

load_end=$(cut -d' ' -f1 /proc/loadavg)
elapsed=$(( $(date +%s) - t0 ))
step "report -> $OUT.{json,md,png}"
MODELS=(ttt_current ttt_full sft_full sft_current ttt_first_order sft_full_compute dyn_sft_full dyn_sft_current)
ROWS=() SCORED=()
for m in "${MODELS[@]}"; do ROWS+=("$WORK/$m.row.json"); SCORED+=("$WORK/$m.tasks.json"); done
$PY evals/baselines_report.py --rows "${ROWS[@]}" --out "$OUT" \
  --command "MAIN=${MAIN:-} SMOKE=$SMOKE MAX_STEPS=$MAX_STEPS NUM_TRAJ=$NUM_TRAJ NUM_EXTRA=$NUM_EXTRA SEED=$SEED RUN_CONFIG=$RUN_CONFIG bash benchmarks/adaptation_baselines.sh $WORK" \
  --seeds "{\"main_corpus\": $SEED, \"extra_memory_episodes\": $((SEED + 1)), \"train\": $SEED, \"max_steps\": $MAX_STEPS}" \
  --load-start "$load_start" --load-end "$load_end" --extra "{\"seconds\": $elapsed, \"run_config\": \"$RUN_CONFIG\", \"sft_full_compute_steps\": $COMPUTE_STEPS}"
$PY evals/agent_tasks_report.py --scored "${SCORED[@]}" --out "$OUT_TASKS" \
  --pair ttt_full/ttt dyn_sft_full/ttt --pair ttt_current/ttt ttt_first_order/ttt --pair ttt_full/ttt sft_full_compute/sft \
  --command "MAIN=${MAIN:-} SMOKE=$SMOKE MAX_STEPS=$MAX_STEPS SEED=$SEED bash benchmarks/adaptation_baselines.sh $WORK" \
  --seeds "{\"train\": $SEED, \"task_seed_base\": $($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['seed_base'])" "$WORK/tasks/suite.json"), \"max_steps\": $MAX_STEPS}" \
  --load-start "$load_start" --load-end "$load_end" --extra "{\"seconds\": $elapsed}" > /dev/null
step "done in $(( $(date +%s) - t0 )) s"
