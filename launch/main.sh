#!/usr/bin/env bash
# The main job, end to end on the embedded default (tiny Qwen3 on CPU, embedded real-shell data):
#   generate trajectories -> prepare a verified manifest -> meta-train (one pipeline stage, two
#   data-parallel CPU ranks: the fastest layout on 2 cores, docs/adaptation.md) -> evaluate the
#   manifest's held-out split (ttt vs frozen) -> the held-out sets of the fair comparison (128 memory
#   worlds of the held-out pool, >= 100 memory-check and >= 200 recovery rounds from fresh episodes;
#   test seeds) -> export -> closed-loop held-out tasks (checked against the training corpus for contamination;
#   the model acts in sandboxes; each task's own test scores it; ttt vs frozen) -> the report with 95% intervals
#   and the targets.
#
#   bash setup.sh && bash launch/main.sh [WORK_DIR]        # WORK_DIR defaults to runs/main
#
# Independent steps run at once, so that neither core waits: the task suite (built and blind-checked; it
# needs nothing the job makes) from the start, beside the two generator calls and the training; the held-out
# sets, which need the manifest but no model, beside the training; after it, the closed
# loop (export, contamination check, episodes) beside the evaluation and the held-out score. A background
# step that fails fails the job, naming it and showing the end of its log; those logs are printed when the
# step is done (the suite's stays in WORK_DIR/task_suite.log; the others are kept in a temporary directory
# only when the job fails).
# Its duration on a 2-core CPU machine is in the report (minutes) and README.md. Environment knobs:
#   NUM_TRAJ (300)   trajectories of the main corpus; 10% of them (by group hash) are the held-out split
#   NUM_EXTRA (600)  extra memory-family episodes, another seed, added to the train split only
#                    (prepare.py --train-only: the held-out split stays exactly the main corpus's)
#   SEED (0), MAX_STEPS (1000), DS_CONFIG (ds_configs/cpu_tiny_pp1_dp2.json), NUM_RANKS (2),
#   RUN_CONFIG (ds_configs/run_cpu_tiny.json), REPORT (WORK_DIR/adaptation: .json/.md/.png),
#   TASKS_PER_KIND (12)  closed-loop task instances per kind (17 kinds; test seeds), built while training runs
#   GEN_WORKERS (8)  sandboxes each generator call runs at once: an episode mostly waits on its shell (its
#                    commands, a job's sleep), so more than the cores finish sooner; the bytes are the same
#                    for any number (ds_ttt/data/generator.py)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK="${1:-runs/main}"
NUM_TRAJ="${NUM_TRAJ:-300}"
NUM_EXTRA="${NUM_EXTRA:-600}"
SEED="${SEED:-0}"
EXTRA_SEED=$((SEED + 1))
MAX_STEPS="${MAX_STEPS:-1000}"
DS_CONFIG="${DS_CONFIG:-ds_configs/cpu_tiny_pp1_dp2.json}"
NUM_RANKS="${NUM_RANKS:-2}"
RUN_CONFIG="${RUN_CONFIG:-ds_configs/run_cpu_tiny.json}"
REPORT="${REPORT:-$WORK/adaptation}"
TASKS_PER_KIND="${TASKS_PER_KIND:-12}"
GEN_WORKERS="${GEN_WORKERS:-8}"
PY=.venv/bin/python
source launch/same_checkout.sh && require_same_checkout "$PY"
export OMP_NUM_THREADS=1 WANDB_MODE="${WANDB_MODE:-offline}" DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"
mkdir -p "$WORK"
t0=$(date +%s)
load_start=$(cut -d' ' -f1 /proc/loadavg)
step() { echo; echo "=== [$(( $(date +%s) - t0 )) s] $*"; }
# background steps: `bg NAME LOG command...` starts one, `finish NAME` waits for it and fails the job if it failed
LOGS=$(mktemp -d)
declare -A bg_pid bg_log
bg() { local name=$1 log=$2; shift 2; "$@" > "$log" 2>&1 & bg_pid[$name]=$!; bg_log[$name]=$log; }
finish() {
  wait "${bg_pid[$1]}" || { echo "error: $1 failed (its log: ${bg_log[$1]}):"; tail -n 20 "${bg_log[$1]}"; exit 1; }
}
cleanup() {
  local status=$?
  kill $(jobs -p) 2> /dev/null || true  # what still runs in the background when the job fails
  if [ "$status" -eq 0 ]; then rm -rf "$LOGS"; fi
  exit "$status"
}
trap cleanup EXIT

# the closed-loop task suite needs no data and no model: it is built and blind-checked on the side from the start
rm -rf "$WORK/tasks"
bg task_suite "$WORK/task_suite.log" $PY evals/task_suite.py --out "$WORK/tasks" --split test --num-per-kind "$TASKS_PER_KIND"

step "1/8 generate $NUM_TRAJ trajectories (seed $SEED) and $NUM_EXTRA extra memory episodes (seed $EXTRA_SEED) in real bash sandboxes"
bg generate_extra "$LOGS/generate_extra.log" $PY data_prep/generate.py --out "$WORK/raw_extra" --num "$NUM_EXTRA" \
  --seed "$EXTRA_SEED" --family memory --no-token-stats --workers "$GEN_WORKERS"
$PY data_prep/generate.py --out "$WORK/raw" --num "$NUM_TRAJ" --seed "$SEED" --workers "$GEN_WORKERS"
finish generate_extra
cat "$LOGS/generate_extra.log"

step "2/8 prepare the manifest (compact Qwen3 vocabulary, capacity filter, split, hashes; extra episodes train-only)"
$PY data_prep/prepare.py --inputs "$WORK/raw/trajectories.jsonl" --train-only "$WORK/raw_extra/trajectories.jsonl" \
  --out "$WORK/data" --seed "$SEED" --trim-vocab

# the held-out sets need the manifest (its train split's prompts are excluded) but not the model: they are
# built on the side while training runs
bg heldout_sets "$LOGS/heldout_sets.log" $PY evals/heldout_sets.py --manifest "$WORK/data/manifest.json" --out "$WORK/sets" --split test

step "3/8 meta-train: $NUM_RANKS CPU ranks ($DS_CONFIG), $MAX_STEPS steps"
.venv/bin/deepspeed --num_gpus "$NUM_RANKS" launch/train.py --deepspeed_config "$DS_CONFIG" --run_config "$RUN_CONFIG" \
  --data "$WORK/data/manifest.json" --output "$WORK/run" --max_steps "$MAX_STEPS"

finish task_suite  # long done by now: it takes about half the training's time
tail -n 1 "$WORK/task_suite.log"
# steps 6 and 7 (export, closed loop) need only the trained checkpoint and the suite: they run beside steps 4 and 5
closed_loop() {
  step "6/8 export for serving (Hugging Face layout + prime weights)"
  $PY launch/export.py --checkpoint "$WORK/run" --out "$WORK/export"
  step "7/8 closed-loop held-out tasks: the model acts in a sandbox, each task's test scores it (ttt, frozen)"
  # refuses (exit 1, naming them) tasks whose instruction and setup equal a training episode's; reports overlap per kind
  $PY evals/contamination.py --suite "$WORK/tasks" --training "$WORK/data/manifest.json" --out "$WORK/tasks_contamination.json" \
    | tail -n 3
  $PY evals/agent_tasks.py --model "$WORK/run" --tasks "$WORK/tasks" --label ttt_current --out "$WORK/agent_tasks_scored.json" \
    2> "$WORK/agent_tasks.log"
}
bg closed_loop "$LOGS/closed_loop.log" closed_loop

step "4/8 evaluate the manifest's held-out split: ttt vs frozen, the trained context policy"
$PY evals/evaluate.py --checkpoint "$WORK/run" --manifest "$WORK/data/manifest.json" --out "$WORK/eval" > /dev/null

step "5/8 the model's score on the held-out sets (test seeds, prompts never seen in training; built beside the training)"
finish heldout_sets
$PY evals/score_baseline.py --checkpoint "$WORK/run" --sets "$WORK/sets" --label ttt_current --out "$WORK/heldout_row.json"

step "6/8 and 7/8: export and the closed loop (beside steps 4 and 5)"
finish closed_loop
cat "$LOGS/closed_loop.log"

step "8/8 report"
elapsed=$(( $(date +%s) - t0 ))
setup_s=0
# setup.sh records how long it took; count it when it ran right before this job (the README command)
if [ -f .venv/.setup_seconds ] && [ $(( t0 - $(stat -c %Y .venv/.setup_seconds) )) -lt 60 ]; then
  setup_s=$(cat .venv/.setup_seconds)
fi
minutes=$(awk -v a="$elapsed" -v b="$setup_s" 'BEGIN { printf "%.1f", (a + b) / 60 }')
load_end=$(cut -d' ' -f1 /proc/loadavg)
$PY evals/baselines_report.py --rows "$WORK/heldout_row.json" --out "$REPORT" \
  --command "bash setup.sh && bash launch/main.sh  # NUM_TRAJ=$NUM_TRAJ NUM_EXTRA=$NUM_EXTRA SEED=$SEED MAX_STEPS=$MAX_STEPS" \
  --seeds "{\"main_corpus\": $SEED, \"extra_memory_episodes\": $EXTRA_SEED, \"num_traj\": $NUM_TRAJ, \"num_extra\": $NUM_EXTRA, \"max_steps\": $MAX_STEPS}" \
  --load-start "$load_start" --load-end "$load_end" \
  --extra "{\"minutes\": $minutes, \"setup_seconds\": $setup_s, \"main_seconds\": $elapsed, \"run_config\": \"$RUN_CONFIG\", \"ds_config\": \"$DS_CONFIG\"}" > /dev/null
$PY evals/agent_tasks_report.py --scored "$WORK/agent_tasks_scored.json" --out "$WORK/agent_tasks" \
  --command "bash launch/main.sh  # TASKS_PER_KIND=$TASKS_PER_KIND SEED=$SEED MAX_STEPS=$MAX_STEPS" \
  --seeds "{\"train\": $SEED, \"task_seed_base\": $($PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["seed_base"])' "$WORK/tasks/suite.json")}" \
  --load-start "$load_start" --load-end "$load_end" > /dev/null

step "done in $(( $(date +%s) - t0 )) s (with setup: $minutes min)"
echo
sed -n '1,20p' "$WORK/eval/summary.md"
echo
cat "$REPORT.md"
echo
cat "$WORK/agent_tasks.md"
