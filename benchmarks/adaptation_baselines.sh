#!/usr/bin/env bash
# TTT against the agent users would otherwise train: the main recipe and every control through the real
# trainer on the same data and steps, over one or more training seeds, scored on held-out sets that can
# tell them apart (the fair comparison, docs/evaluation.md); resumable across sessions.
#
#   bash benchmarks/adaptation_baselines.sh [WORK_DIR]                  # WORK_DIR defaults to runs/baselines
#   SEEDS=0,1,2 bash benchmarks/adaptation_baselines.sh runs/baselines  # three training seeds, pooled report
#   SMOKE=1 bash benchmarks/adaptation_baselines.sh runs/smoke           # CI's minute-scale version (tiny everything)
#
# Resumable: run the same command again after a kill (or at the next session) and it continues. Every
# output is checked before it is made: the shared data, held-out sets and suites (written to a
# `.partial` folder, then renamed), each row's training (complete when its `latest` checkpoint is the
# last step; a run killed midway continues with launch/train.py --resume, losing at most the steps since
# its last checkpoint, save_interval of the run config), each score (.row.json / .tasks.json / sweep
# files, written whole or not at all). What exists is skipped with a line saying so.
#
# Seeds: SEEDS=0,1,2 trains every row once per training seed (SEED=s is SEEDS=s). The training seed
# (launch/train.py --seed) seeds the model's initialisation (the backbone, the prime MLPs) and the
# order the data loader draws the trajectories in. The corpus does NOT change with the training seed: one
# corpus (generated from CORPUS_SEED, default the first of SEEDS, i.e. 0 = the main job's corpus), one
# set of held-out sets (drawn from its test split) and one task suite serve every seed, so the seeds'
# differences are paired on the same tasks and the pooled interval resamples the same kinds for all
# of them; the spread over seeds is the spread of training, not of the data sample.
#
# Rows, per seed in WORK/seed_<s>/<row>, each in the main job's layout (`deepspeed --num_gpus 2
# launch/train.py` with ds_configs/cpu_tiny_pp1_dp2.json: one stage, two data-parallel CPU ranks of one
# thread each; the arrangement measured fastest here, docs/adaptation.md), all from the main recipe's run
# config RUN_CONFIG (ds_configs/run_cpu_tiny.json) with the overrides below:
#   ttt_current   the main recipe, current_round, round address   (the main job's model)
#   ttt_full      the main recipe, full context
#   sft_full      adaptive_layers=0, trainable_scope=all, full context   (the ordinary agent)
#   sft_current   adaptive_layers=0, trainable_scope=all, current_round  (no memory at all: the floor)
#   (full-context and SFT rows: round_address=false, see FULL_CONTEXT below)
# and the controls that could explain TTT's gain:
#   ttt_first_order   ttt_current's recipe with first_order=true: the write is applied in training but not
#                     differentiated (TTT without meta-learning)
#   sft_full_compute  sft_full trained for as many steps as ttt_full's measured training seconds buy
#                     at sft_full's measured seconds per step (equal compute, not equal steps); trained
#                     on the first seed of SEEDS only (the other seeds' reports have no such row, and the
#                     pooled pairs with it rest on that one seed: agent_report pools each pair over the
#                     seeds that have both its rows)
#   dyn_sft_full / dyn_sft_current   dynamic evaluation: sft_full / sft_current take ttt_full's /
#                     ttt_current's inner step at test time on their own last layers' MLPs, never
#                     meta-trained for it (ds_ttt/evaluation/dynamic_eval.py; no training). The inner lr
#                     and clip norm are tuned for each SFT model and seed: every (lr, norm) of
#                     DYN_LRS x DYN_NORMS on the dev split's suite (DEV_PER_KIND per kind), the best dev
#                     success wins, ties to the smaller lr then norm (evals/dynamic_eval_sweep.py); the
#                     chosen setting is then scored on the test suite. The grid spans 30x in lr around
#                     the recipe's 1.0 and both clip norms in use (1, the TTTConfig default; 5, the
#                     recipe's), so the recipe's own setting is one of the candidates.
# Every model is scored under its training policy on the test split's held-out sets (evals/heldout_sets.py:
# 128 memory worlds of the held-out pool, >= 100 memory-check rounds, >= 200 recovery rounds, prompts
# never seen in training); TTT models also with their updates off (labelled ablation); the dynamic-evaluation
# rows there take the recipe's inner step (evals/score_baseline.py has no override).
# Every model also does the closed-loop held-out tasks (evals/agent_tasks.py on the test split's task
# suite, greedy, TTT models also frozen).
# Writes OUT.{json,md,png} per seed (OUT = benchmarks/results/adaptation_baselines, OUT_seed<s> with
# several seeds; SMOKE: WORK_DIR/report) and OUT_TASKS.{json,md,png} (benchmarks/results/agent_tasks)
# over every seed: per-seed rows and pairs, `pooled` (each pair's mean difference over the seeds with a
# 95% interval that resamples the 17 kinds, and the seeds the first row wins) and the sweeps; and
# EPISODES/seed<s>/<row>.<mode>.jsonl (benchmarks/results/agent_tasks_episodes; SMOKE: WORK_DIR/episodes):
# every closed-loop episode's commands, stop and test verdict (evals/agent_episodes.py), to read what
# each agent did.
# Knobs: SEEDS (0), MAX_STEPS (1000), NUM_TRAJ (300), NUM_EXTRA (600), CORPUS_SEED, RUN_CONFIG, DATA
# (reuse a manifest), OUT, OUT_TASKS, MASTER_PORT (29500; another one lets it train beside another job), DYN_LRS ("0.03 0.1 0.3 1.0"), DYN_NORMS ("1 5"), DEV_PER_KIND (4).
# After `bash launch/main.sh` the main job's model IS the ttt_current row of its training seed (same data,
# recipe, layout, steps and seed); reuse it instead of training it again:
#   MAIN=runs/main bash benchmarks/adaptation_baselines.sh      # DATA, sets, suite and ttt_current from runs/main
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) (the sweep) stops the run too
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK="${1:-runs/baselines}"
SMOKE="${SMOKE:-0}"
if [ "$SMOKE" = 1 ]; then
  MAX_STEPS="${MAX_STEPS:-4}" NUM_TRAJ="${NUM_TRAJ:-40}" NUM_EXTRA="${NUM_EXTRA:-20}"
  WORLDS=4 MEMORY=3 RECOVERY=3 OUT="${OUT:-$WORK/report}" OUT_TASKS="${OUT_TASKS:-$WORK/agent_tasks}"
  EPISODES="${EPISODES:-$WORK/episodes}"
  TASKS_PER_KIND=1 TASK_ARGS=(--max-rounds 2 --max-new-tokens 24)
  DYN_LRS="${DYN_LRS:-0.1 1.0}" DYN_NORMS="${DYN_NORMS:-5}" DEV_PER_KIND="${DEV_PER_KIND:-1}"
  DEV_KINDS=(--kinds memory_config explore_count)
else
  MAX_STEPS="${MAX_STEPS:-1000}" NUM_TRAJ="${NUM_TRAJ:-300}" NUM_EXTRA="${NUM_EXTRA:-600}"
  WORLDS=128 MEMORY=100 RECOVERY=200 OUT="${OUT:-benchmarks/results/adaptation_baselines}"
  OUT_TASKS="${OUT_TASKS:-benchmarks/results/agent_tasks}" TASKS_PER_KIND=12 TASK_ARGS=()
  EPISODES="${EPISODES:-benchmarks/results/agent_tasks_episodes}"
  DYN_LRS="${DYN_LRS:-0.03 0.1 0.3 1.0}" DYN_NORMS="${DYN_NORMS:-1 5}" DEV_PER_KIND="${DEV_PER_KIND:-4}"
  DEV_KINDS=()
fi
SEEDS="${SEEDS:-${SEED:-0}}"
IFS=, read -ra SEED_LIST <<< "$SEEDS"
FIRST_SEED="${SEED_LIST[0]}"  # the seed with every row (sft_full_compute is trained on this seed only)
CORPUS_SEED="${CORPUS_SEED:-${SEED_LIST[0]}}"
RUN_CONFIG="${RUN_CONFIG:-ds_configs/run_cpu_tiny.json}"
MASTER_PORT="${MASTER_PORT:-29500}"
DS_CONFIG="${DS_CONFIG:-ds_configs/cpu_tiny_pp1_dp2.json}"
# The round address pools over the current round, so it needs context_policy=current_round
# (TTTConfig.validate refuses it otherwise): the full-context rows turn it off. The SFT rows turn it off
# too: without prime MLPs it feeds nothing, and a model that says it has one is treated as one (e.g. the
# held-out sets' copy check is skipped for it). The TTT rows on current_round keep the main recipe's.
FULL_CONTEXT=(context_policy=full round_address=false)
NO_PRIME=(adaptive_layers=0 trainable_scope=all round_address=false)
PY=.venv/bin/python
source launch/same_checkout.sh && require_same_checkout "$PY"
export OMP_NUM_THREADS=1 WANDB_MODE="${WANDB_MODE:-offline}" DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"
mkdir -p "$WORK"
load_start=$(cut -d' ' -f1 /proc/loadavg)
t0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - t0 )) s] $*"; }
skip() { echo "[baselines] $*: exists, skipped"; }
json_field() {  # FILE DOTTED.KEY: one field of a JSON file (run.seed: d["run"]["seed"])
  $PY -c 'import functools, json, sys; print(functools.reduce(lambda d, k: d[k], sys.argv[2].split("."), json.load(open(sys.argv[1]))))' "$1" "$2"
}

if [ -n "${MAIN:-}" ]; then
  DATA="$MAIN/data/manifest.json"
fi
if [ -n "${DATA:-}" ]; then
  echo "[baselines] data: $DATA"
elif [ -f "$WORK/data/manifest.json" ]; then
  DATA="$WORK/data/manifest.json"
  skip "data ($WORK/data)"
else
  step "data: $NUM_TRAJ trajectories (seed $CORPUS_SEED) + $NUM_EXTRA memory episodes (seed $((CORPUS_SEED + 1))), compact vocabulary"
  rm -rf "$WORK/raw" "$WORK/raw_extra" "$WORK/data.partial"
  $PY data_prep/generate.py --out "$WORK/raw" --num "$NUM_TRAJ" --seed "$CORPUS_SEED" --no-token-stats
  $PY data_prep/generate.py --out "$WORK/raw_extra" --num "$NUM_EXTRA" --seed "$((CORPUS_SEED + 1))" --family memory --no-token-stats
  $PY data_prep/prepare.py --inputs "$WORK/raw/trajectories.jsonl" --train-only "$WORK/raw_extra/trajectories.jsonl" \
    --out "$WORK/data.partial" --seed "$CORPUS_SEED" --trim-vocab > "$WORK/prepare.log"
  mv "$WORK/data.partial" "$WORK/data"
  DATA="$WORK/data/manifest.json"
fi

missing() {  # DIR MARKER DESCRIPTION: true when DIR (complete once DIR/MARKER exists) is still to be made
  if [ -f "$1/$2" ]; then skip "$3 ($1)"; return 1; fi
  step "$3"
  rm -rf "$1.partial" "$1"  # a killed attempt's leftovers; the maker writes DIR.partial, renamed when done
}
if [ -n "${MAIN:-}" ] && [ -f "$MAIN/sets/sets.json" ]; then
  if missing "$WORK/sets" sets.json "held-out sets: the main job's ($MAIN/sets)"; then
    cp -r "$MAIN/sets" "$WORK/sets.partial" && mv "$WORK/sets.partial" "$WORK/sets"
  fi
elif missing "$WORK/sets" sets.json "held-out sets (test split): $WORLDS worlds, >= $MEMORY memory-check rounds, >= $RECOVERY recovery rounds"; then
  $PY evals/heldout_sets.py --manifest "$DATA" --out "$WORK/sets.partial" --split test --worlds "$WORLDS" \
    --memory "$MEMORY" --recovery "$RECOVERY" > /dev/null
  mv "$WORK/sets.partial" "$WORK/sets"
fi
if [ -n "${MAIN:-}" ] && [ -f "$MAIN/tasks/suite.json" ]; then
  if missing "$WORK/tasks" suite.json "task suite: the main job's ($MAIN/tasks)"; then
    cp -r "$MAIN/tasks" "$WORK/tasks.partial" && mv "$WORK/tasks.partial" "$WORK/tasks"
  fi
elif missing "$WORK/tasks" suite.json "task suite (test split): $TASKS_PER_KIND per kind, every test checked against its solution and doing nothing"; then
  $PY evals/task_suite.py --out "$WORK/tasks.partial" --split test --num-per-kind "$TASKS_PER_KIND" 2> /dev/null
  mv "$WORK/tasks.partial" "$WORK/tasks"
fi
if missing "$WORK/tasks_dev" suite.json "dev task suite (dynamic evaluation's sweep): $DEV_PER_KIND per kind ${DEV_KINDS[*]}"; then
  $PY evals/task_suite.py --out "$WORK/tasks_dev.partial" --split dev --num-per-kind "$DEV_PER_KIND" "${DEV_KINDS[@]}" 2> /dev/null
  mv "$WORK/tasks_dev.partial" "$WORK/tasks_dev"
fi

trained() {  # RUN_DIR STEPS: its `latest` names the checkpoint of the last step
  [ -f "$1/latest" ] && [ "$(sed 's/-resave[0-9]*$//' "$1/latest")" = "$(printf 'step_%08d' "$2")" ]
}

train_row() {  # SEED NAME TTT_OVERRIDE... (ROW_STEPS: this row's steps, default MAX_STEPS)
  local seed=$1 name=$2; shift 2
  local out="$WORK/seed_$seed/$name" steps="${ROW_STEPS:-$MAX_STEPS}" overrides=() resume=()
  for kv in "$@"; do overrides+=(--ttt "$kv"); done
  if trained "$out" "$steps"; then skip "seed $seed $name (trained, $steps steps)"; return 0; fi
  if [ -f "$out/latest" ]; then
    resume=(--resume "$out")
    step "seed $seed: resume $name from $(cat "$out/latest") to $steps steps: $*"
  else  # never checkpointed (or never started): from the beginning
    rm -rf "$out"
    : > "$out.train.log"
    step "seed $seed: train $name ($steps steps): $*"
  fi
  .venv/bin/deepspeed --num_gpus 2 --master_port "$MASTER_PORT" launch/train.py --deepspeed_config "$DS_CONFIG" \
    --run_config "$RUN_CONFIG" --data "$DATA" --output "$out" --max_steps "$steps" --seed "$seed" \
    "${overrides[@]}" "${resume[@]}" >> "$out.train.log" 2>&1 \
    || { echo "[baselines] seed $seed $name failed: see $out.train.log"; tail -n 20 "$out.train.log"; return 1; }
  trained "$out" "$steps" || { echo "[baselines] seed $seed $name: no step-$steps checkpoint after training"; return 1; }
  echo "[baselines] seed $seed $name trained ($(( $(date +%s) - t0 )) s)"
}

model_of() {  # SEED NAME: the run a row is scored from (a dynamic-evaluation row: its SFT model)
  case "$2" in dyn_*) echo "$WORK/seed_$1/${2#dyn_}" ;; *) echo "$WORK/seed_$1/$2" ;; esac
}

score() {  # SEED NAME [score_baseline options]
  local seed=$1 name=$2; shift 2
  local dest="$WORK/seed_$seed/$name.row.json" partial="$WORK/seed_$seed/.$name.row.partial.json"
  if [ -f "$dest" ]; then skip "seed $seed $name (held-out sets scored)"; return 0; fi
  $PY evals/score_baseline.py --checkpoint "$(model_of "$seed" "$name")" --sets "$WORK/sets" --label "$name" \
    --out "$partial" "$@" 2> "$WORK/seed_$seed/$name.score.log"
  mv "$partial" "$dest"
}

tasks() {  # SEED NAME [agent_tasks options]
  local seed=$1 name=$2; shift 2
  local dest="$WORK/seed_$seed/$name.tasks.json"
  if [ -f "$dest" ]; then skip "seed $seed $name (closed-loop tasks scored)"; return 0; fi
  $PY evals/agent_tasks.py --model "$(model_of "$seed" "$name")" --tasks "$WORK/tasks" --label "$name" --out "$dest" \
    --train-seed "$seed" "${TASK_ARGS[@]}" "$@" 2> "$WORK/seed_$seed/$name.tasks.log" | tail -n 2
}

sweep_inner() {  # SEED NAME TTT_RUN: the dev sweep of dynamic evaluation's inner step; prints the chosen --inner args
  local seed=$1 name=$2 from=$3 files=()
  local dir="$WORK/seed_$seed/sweep"
  mkdir -p "$dir"
  for lr in $DYN_LRS; do
    for norm in $DYN_NORMS; do
      local f="$dir/$name.lr${lr}_norm${norm}.tasks.json"
      files+=("$f")
      if [ -f "$f" ]; then skip "seed $seed $name sweep lr $lr norm $norm" >&2; continue; fi
      $PY evals/agent_tasks.py --model "$(model_of "$seed" "$name")" --tasks "$WORK/tasks_dev" --label "$name" \
        --out "$f" --train-seed "$seed" --dynamic-eval-from "$from" --modes ttt \
        --inner "inner_lr=$lr" --inner "inner_max_norm=$norm" "${TASK_ARGS[@]}" 2> "${f%.json}.log" | tail -n 1 >&2
    done
  done
  $PY evals/dynamic_eval_sweep.py --scored "${files[@]}" --label "$name" --train-seed "$seed" \
    --out "$WORK/seed_$seed/$name.sweep.json"
}

if [ -n "${MAIN:-}" ]; then
  MAIN_SEED=$(json_field "$MAIN/run/run_config.json" run.seed)
fi
for seed in "${SEED_LIST[@]}"; do
  SD="$WORK/seed_$seed"
  mkdir -p "$SD"
  if [ -n "${MAIN:-}" ] && [ "$seed" = "$MAIN_SEED" ]; then
    [ -e "$SD/ttt_current" ] || ln -s "$(realpath "$MAIN/run")" "$SD/ttt_current"
    skip "seed $seed ttt_current (the main job's model, $MAIN/run)"
  else
    train_row "$seed" ttt_current
  fi
  train_row "$seed" ttt_full "${FULL_CONTEXT[@]}"
  train_row "$seed" sft_full "${NO_PRIME[@]}" "${FULL_CONTEXT[@]}"
  train_row "$seed" sft_current "${NO_PRIME[@]}"
  train_row "$seed" ttt_first_order first_order=true
  # equal compute: ttt_full's summed training step seconds at sft_full's mean seconds per step (measured
  # once and kept, so a resumed session trains the same number of steps); the first seed only
  if [ "$seed" = "$FIRST_SEED" ]; then
    if [ ! -f "$SD/sft_full_compute.steps" ]; then
      $PY -c '
import json, sys
secs = lambda run: [json.loads(l)["step_time_s"] for l in open(f"{run}/metrics.jsonl")]
ttt, sft = secs(sys.argv[1]), secs(sys.argv[2])
print(max(1, round(sum(ttt) / (sum(sft) / len(sft)))))' "$SD/ttt_full" "$SD/sft_full" > "$SD/.sft_full_compute.steps.partial"
      mv "$SD/.sft_full_compute.steps.partial" "$SD/sft_full_compute.steps"
    fi
    ROW_STEPS=$(cat "$SD/sft_full_compute.steps") train_row "$seed" sft_full_compute "${NO_PRIME[@]}" "${FULL_CONTEXT[@]}"
  fi

  step "seed $seed: score every model on the held-out sets (two at a time)"
  score "$seed" ttt_current & a=$!
  score "$seed" ttt_full & b=$!
  wait $a && wait $b
  score "$seed" sft_full & a=$!
  score "$seed" sft_current & b=$!
  wait $a && wait $b
  if [ "$seed" = "$FIRST_SEED" ]; then
    score "$seed" ttt_first_order & a=$!
    score "$seed" sft_full_compute & b=$!
    wait $a && wait $b
  else
    score "$seed" ttt_first_order
  fi
  score "$seed" dyn_sft_full --dynamic-eval-from "$SD/ttt_full" & a=$!
  score "$seed" dyn_sft_current --dynamic-eval-from "$SD/ttt_current" & b=$!
  wait $a && wait $b

  step "seed $seed: dynamic evaluation's inner step on the dev suite (lr in {$DYN_LRS} x norm in {$DYN_NORMS})"
  inner_full=$(sweep_inner "$seed" dyn_sft_full "$SD/ttt_full")
  inner_current=$(sweep_inner "$seed" dyn_sft_current "$SD/ttt_current")
  echo "[baselines] seed $seed chosen: dyn_sft_full $inner_full; dyn_sft_current $inner_current"

  step "seed $seed: closed-loop held-out tasks: every model on the suite (greedy; TTT models also frozen)"
  tasks "$seed" ttt_current
  tasks "$seed" ttt_full
  tasks "$seed" sft_full
  tasks "$seed" sft_current
  tasks "$seed" ttt_first_order
  [ "$seed" = "$FIRST_SEED" ] && tasks "$seed" sft_full_compute
  read -ra kv <<< "$inner_full"
  tasks "$seed" dyn_sft_full --dynamic-eval-from "$SD/ttt_full" --modes ttt "${kv[@]/#/--inner=}"
  read -ra kv <<< "$inner_current"
  tasks "$seed" dyn_sft_current --dynamic-eval-from "$SD/ttt_current" --modes ttt "${kv[@]/#/--inner=}"
done

load_end=$(cut -d' ' -f1 /proc/loadavg)
elapsed=$(( $(date +%s) - t0 ))
MODELS=(ttt_current ttt_full sft_full sft_current ttt_first_order sft_full_compute dyn_sft_full dyn_sft_current)
COMMAND="MAIN=${MAIN:-} SMOKE=$SMOKE SEEDS=$SEEDS MAX_STEPS=$MAX_STEPS NUM_TRAJ=$NUM_TRAJ NUM_EXTRA=$NUM_EXTRA CORPUS_SEED=$CORPUS_SEED RUN_CONFIG=$RUN_CONFIG bash benchmarks/adaptation_baselines.sh $WORK"
SCORED=() SWEEPS=()
for seed in "${SEED_LIST[@]}"; do
  SD="$WORK/seed_$seed"
  out="$OUT"
  [ "${#SEED_LIST[@]}" -gt 1 ] && out="${OUT}_seed$seed"
  step "seed $seed: report -> $out.{json,md,png}"
  ROWS=() EXTRA="{\"seconds\": $elapsed, \"run_config\": \"$RUN_CONFIG\"}"
  for m in "${MODELS[@]}"; do
    [ "$m" = sft_full_compute ] && [ "$seed" != "$FIRST_SEED" ] && continue
    ROWS+=("$SD/$m.row.json"); SCORED+=("$SD/$m.tasks.json")
  done
  [ "$seed" = "$FIRST_SEED" ] && EXTRA="${EXTRA%\}}, \"sft_full_compute_steps\": $(cat "$SD/sft_full_compute.steps")}"
  SWEEPS+=("$SD/dyn_sft_full.sweep.json" "$SD/dyn_sft_current.sweep.json")
  $PY evals/baselines_report.py --rows "${ROWS[@]}" --out "$out" --command "$COMMAND" \
    --seeds "{\"main_corpus\": $CORPUS_SEED, \"extra_memory_episodes\": $((CORPUS_SEED + 1)), \"train\": $seed, \"max_steps\": $MAX_STEPS}" \
    --load-start "$load_start" --load-end "$load_end" --extra "$EXTRA"
done
step "closed-loop report over seeds $SEEDS -> $OUT_TASKS.{json,md,png}"
$PY evals/agent_tasks_report.py --scored "${SCORED[@]}" --sweeps "${SWEEPS[@]}" --out "$OUT_TASKS" \
  --pair ttt_full/ttt dyn_sft_full/ttt --pair ttt_current/ttt ttt_first_order/ttt --pair ttt_full/ttt sft_full_compute/sft \
  --command "$COMMAND" \
  --seeds "{\"train\": [${SEEDS}], \"main_corpus\": $CORPUS_SEED, \"task_seed_base\": $(json_field "$WORK/tasks/suite.json" seed_base), \"dev_task_seed_base\": $(json_field "$WORK/tasks_dev/suite.json" seed_base), \"max_steps\": $MAX_STEPS}" \
  --load-start "$load_start" --load-end "$load_end" --extra "{\"seconds\": $elapsed, \"run_config\": \"$RUN_CONFIG\"}" > /dev/null
step "what every model ran, episode by episode -> $EPISODES/seed<s>/<row>.<mode>.jsonl"
$PY evals/agent_episodes.py --scored "${SCORED[@]}" --out "$EPISODES" | tail -n 1
step "done in $(( $(date +%s) - t0 )) s"
