"""The DeepSpeed pipeline meta-trainer (launch/train.py is its entry point; docs/training.md the guide).

One concept per module:
  run_config.py       RunConfig: every non-DeepSpeed setting of a run
  deepspeed_config.py the DeepSpeed JSON cross-checked against the run (validate_deepspeed)
  layout.py           which layers sit on which stage; the one local -> Hugging Face name map
  schedule.py         the plan and DeepSpeed's WarmupCosineLR driven by it
  data_loader.py      deterministic, resumable micro-batches
  objective.py        the token-weighted outer objective of one step
  pipeline.py         the TTT Qwen3 as a DeepSpeed PipelineModule
  engine.py           Trainer: build, step, train (the loop)
  memory_budget.py    the busiest rank's memory, estimated before the first step (the pre-flight check)
  resume_checks.py    what --resume and --start-stage-from refuse
  layout_move.py      --resume into another layout: the universal conversion and its load
  checkpoint.py       the atomic save/load protocol of RUN_DIR's checkpoints
  atomic_io.py        durable, atomic file writes
  rng_state.py        per-rank RNG states, weights_only-loadable
  run_record.py       run_config.json / data_ids.json beside every checkpoint (RunInfo)
  safe_loading.py     DeepSpeed's checkpoint loader made weights_only
  reassembly.py       a pipeline checkpoint as one single-process model (evaluation, export)
  shared_output.py    the startup check that RUN_DIR is one shared filesystem
  rendezvous.py       joining the process group: the waiting rank's progress line, one timeout for every group
  logging.py          progress bar, metrics.jsonl, optional wandb
"""
