"""The training run: resolve the run, build the pipeline engine, train, log, checkpoint.

    from ds_ttt.train.engine import train
    train(run_cfg, ds_config, resume=None, start_stage_from=None)     # after deepspeed.init_distributed

Three ways to start (ds_ttt/train/checkpoint.py has the files):
  fresh                 plan fixed from the data (--max_steps or epochs), schedule starts at 0;
  --resume CKPT         same manifest (hash checked), plan, batch layout and pipeline (refused with the
                        key, both values and the fix otherwise: check_reproducible); weights, optimizer,
                        scheduler, RNG and the saved data cursor (checked against the step) continue
                        exactly (per-step losses equal an uninterrupted run);
  --start-stage-from C  a new data stage: a new manifest and a new output dir; weights, optimizer and
                        RNG are kept, the data order and the schedule restart (a new plan), the
                        cumulative step count continues; train/test ids must not cross between stages.
At startup every rank checks that RUN_DIR is one shared filesystem (ds_ttt/train/shared_output.py).
"""

from __future__ import annotations

import pathlib
import time

import deepspeed
import torch
import torch.distributed as dist

from ds_ttt.config import TTTConfig
from ds_ttt.data.manifest import load_manifest
from ds_ttt.model.hf_adapter import load_hf_weights, load_qwen3_config
from ds_ttt.model.presets import backbone_config
from ds_ttt.train import checkpoint as ckpt
from ds_ttt.train.atomic_io import write_json_atomic
from ds_ttt.train.data_loader import TrajectoryBatches, collate, samples_from_manifest
from ds_ttt.train.deepspeed_config import batch_sizes, validate_deepspeed
from ds_ttt.train.logging import MetricsLogger, peak_memory_bytes
from ds_ttt.train.objective import StepObjective
from ds_ttt.train.pipeline import STAT_KEYS, TTTPipelineModule
from ds_ttt.train.run_config import RunConfig
from ds_ttt.train.run_record import RUN_CONFIG, RunInfo, manifest_tokenizer, resolved_config
from ds_ttt.train.schedule import Plan, make_plan, resolved_deepspeed, start_schedule
from ds_ttt.train.shared_output import check_shared_output

# Settings that change the model's structure or meaning: a resume or a new data stage must keep them.
STRUCTURAL_TTT = ("adaptive_layers", "prime_intermediate_size", "trainable_scope", "key_shift")
# DeepSpeed settings that decide the data order (the batches, their split into micro-batches and ranks).
DATA_ORDER_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "data_parallel_size")


def load_backbone(run: RunConfig, manifest=None):
    """The backbone config; a preset adopts a manifest's compact vocabulary (prepare.py --trim-vocab)."""
    if run.model:
        cfg = load_qwen3_config(run.model)
        if manifest is not None and manifest.data["tokenizer"].get("trimmed"):
            raise ValueError(f"{run.data}: the manifest has a trimmed vocabulary but --model {run.model} uses "
                             "Qwen3's full vocabulary; prepare the data without --trim-vocab")
        return cfg
    cfg = backbone_config(run.preset)
    if manifest is not None and manifest.data["tokenizer"].get("trimmed"):
        cfg.vocab_size = -(-manifest.data["tokenizer"]["vocab_size"] // 64) * 64  # padded like Qwen3's table
    return cfg


def check_same_model(run: RunConfig, info: RunInfo, backbone) -> None:
    if backbone.to_dict() != info.backbone_config().to_dict():
        raise ValueError(f"{info.checkpoint}: the backbone differs from this launch's (--preset/--model); "
                         f"use the checkpoint's model source {info.model_source}")
    for key in STRUCTURAL_TTT:
        saved = info.ttt.get(key, TTTConfig().to_dict()[key])  # a field newer than the checkpoint: its default
        if getattr(run.ttt, key) != saved:
            raise ValueError(f"ttt.{key}={getattr(run.ttt, key)!r} but {info.checkpoint} was trained with "
                             f"{saved!r}; keep it the same to continue from that checkpoint")


def saved_data_order(info: RunInfo) -> dict:
    """The batch layout a checkpoint was trained with (older checkpoints: from their DeepSpeed config)."""
    if info.raw.get("data_order"):
        return info.raw["data_order"]
    ds = info.deepspeed
    train, micro, gas = (ds.get(k) for k in DATA_ORDER_KEYS[:3])
    if None in (train, micro, gas):
        raise ValueError(f"{info.checkpoint / RUN_CONFIG} records no complete batch layout (train_batch_size, "
                         "train_micro_batch_size_per_gpu, gradient_accumulation_steps), so a resume cannot be "
                         "checked to reproduce the run: begin a new data stage with --start-stage-from instead")
    return {"train_batch_size": train, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "data_parallel_size": train // (micro * gas)}


def check_reproducible(info: RunInfo, data_order: dict, layout) -> None:
    """--resume continues exactly or not at all: the batch layout (which trajectories form each
    micro-batch and each rank's share) and the pipeline (stages, partition) must be the checkpoint's."""
    saved = saved_data_order(info)
    where = info.checkpoint / RUN_CONFIG
    for key in DATA_ORDER_KEYS:
        if saved[key] != data_order[key]:
            what = ("launch with world size = pipeline.stages x " + str(saved[key])) if key == "data_parallel_size" \
                else f"set {key}={saved[key]} in the DeepSpeed config"
            raise ValueError(f"--resume: {key} is {data_order[key]} now but {saved[key]} in {where}; it changes the "
                             f"data order, so the run cannot continue exactly: {what}, or begin a new data stage "
                             "with --start-stage-from")
    saved_layout = info.pipeline_layout()
    for key, old, new in (("pipeline.stages", saved_layout.num_stages, layout.num_stages),
                          ("partition", list(saved_layout.prefix_per_stage), list(layout.prefix_per_stage))):
        if old != new:
            fix = f"set pipeline.stages={old} in the DeepSpeed config" if key == "pipeline.stages" \
                else f"set partition={old} in the run config"
            raise ValueError(f"--resume: {key} is {new} now but {old} in {where}; the checkpoint's layer files "
                             f"belong to that layout: {fix}, or begin a new data stage with --start-stage-from")


def resume_cursor(client: dict, info: RunInfo, steps_per_epoch: int, train_batch_size: int) -> int:
    """The stage step to continue from, read from the saved sample cursor and checked against the
    step counts (a cursor that disagrees means the checkpoint cannot be continued exactly)."""
    cursor, stage_step = client.get("cursor"), client["stage_step"]
    if not cursor:
        raise ValueError(f"{info.checkpoint}: the client state has no data cursor; resume from a checkpoint "
                         "written by this trainer, or begin a new data stage with --start-stage-from")
    start = cursor["epoch"] * steps_per_epoch + cursor["batch"]
    samples = cursor.get("samples", start * train_batch_size)
    if not (start == stage_step == info.step - info.raw["stage_start_step"]) or samples != start * train_batch_size:
        raise ValueError(f"{info.checkpoint}: the saved data cursor (epoch {cursor['epoch']}, batch {cursor['batch']}, "
                         f"{samples} samples at {steps_per_epoch} steps per epoch = stage step {start}) disagrees "
                         f"with the saved stage step {stage_step} / step {info.step}; the checkpoint is inconsistent: "
                         "resume from another checkpoint")
    return start


def check_no_overlap(history: list[dict], manifest, manifest_path: str) -> None:
    train, test = manifest.ids("train"), manifest.ids("test")
    for prev in history:
        for a_name, a, b_name, b in (("train", train, "test", set(prev["test"])),
                                     ("test", test, "train", set(prev["train"]))):
            both = sorted(a & b)
            if both:
                raise ValueError(
                    f"{manifest_path}: {len(both)} {a_name} trajectories (e.g. {both[:3]}) are in the {b_name} split "
                    f"of data stage {prev['data_stage']} ({prev['manifest']}); held-out data must stay held out "
                    "across stages: re-split the new data")


def set_step_objective(last, engine, batches: TrajectoryBatches, step: int, ttt) -> StepObjective:
    """Before optimizer step `step` (0-based stage step), on the last stage: count the action and
    observation labels of the global batch (this rank's micro-batches on the host, summed over the
    data-parallel ranks) and hand the normalisers to LastStagePipe (ds_ttt/train/objective.py)."""
    objective = StepObjective.for_step(
        [collate(rows, bucket=batches.bucket, capacity=batches.capacity) for rows in batches.rank_micro_batches(step)],
        ttt, loss_scale=engine.gradient_accumulation_steps() * engine.grid.data_parallel_size,
        dp_group=engine.grid.get_data_parallel_group())
    last.set_objective(objective)
    return objective


def gather_stats(module: TTTPipelineModule, peak: int) -> dict:
    last = module.last_stage_layer()
    vals = [float(last.stats[k]) if last is not None else 0.0 for k in STAT_KEYS]
    t = torch.tensor(vals, dtype=torch.float64)
    mem = torch.tensor([float(peak)], dtype=torch.float64)
    if torch.cuda.is_available():
        t, mem = t.cuda(), mem.cuda()
    dist.all_reduce(t)  # only the last stage's ranks (one per dp replica) contribute
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    out = dict(zip(STAT_KEYS, t.tolist()))
    out["peak_mem"] = mem.item()
    return out


def train(run: RunConfig, ds: dict, *, resume: str | None = None, start_stage_from: str | None = None,
          on_save_phase=None) -> pathlib.Path:
    """Train on the current process group (deepspeed.init_distributed already called). Returns RUN_DIR.
    `on_save_phase(phase, path)`: called at each phase of every save (fault injection, ds_ttt/train/checkpoint.py)."""
    if resume and start_stage_from:
        raise ValueError("--resume and --start-stage-from are exclusive (resume continues a stage; "
                         "--start-stage-from begins a new one)")
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = load_manifest(run.data)
    backbone = load_backbone(run, manifest)
    layout = validate_deepspeed(run, ds, world, backbone.num_hidden_layers,
                                tied_embeddings=bool(backbone.tie_word_embeddings))
    dp = world // layout.num_stages
    train_bs, micro, gas = batch_sizes(ds, dp)
    data_order = dict(zip(DATA_ORDER_KEYS, (train_bs, micro, gas, dp)))
    num_train = len(manifest.ids("train"))
    retained = sum(manifest.retained_rounds("train").values())
    run_dir = pathlib.Path(run.output)
    source = resume or start_stage_from
    info = RunInfo.read(ckpt.resolve_checkpoint(source)) if source else None
    history: list[dict] = []
    data_stage, stage_start_step = 0, 0
    if info is not None:
        check_same_model(run, info, backbone)
        history = info.stage_history()
    if resume:
        if manifest.sha256 != info.manifest_sha256:
            raise ValueError(f"--resume: {run.data} (sha256 {manifest.sha256[:12]}…) is not the manifest of "
                             f"{info.checkpoint} ({info.manifest_path}, {info.manifest_sha256[:12]}…); resume with the "
                             "same data, or begin a new data stage with --start-stage-from")
        if run_dir.resolve() != info.checkpoint.parent.resolve():
            raise ValueError(f"--resume continues in the checkpoint's RUN_DIR {info.checkpoint.parent}; "
                             f"--output {run_dir} differs (omit --output or pass that directory)")
        plan = Plan(**info.plan)
        if run.max_steps is not None and run.max_steps != plan.planned_steps:
            raise ValueError(f"--max_steps {run.max_steps} differs from the plan fixed at the first launch "
                             f"({plan.planned_steps} steps, {info.checkpoint / RUN_CONFIG}); the plan never "
                             "changes on resume: omit --max_steps or pass the same value")
        check_reproducible(info, data_order, layout)
        data_stage, stage_start_step = info.raw["data_stage"], info.raw["stage_start_step"]
        history = history[:-1]  # this stage's own entry is re-added below
    else:
        if (run_dir / ckpt.LATEST).exists():
            raise ValueError(f"{run_dir} already holds a run; continue it with --resume {run_dir}, or pass a new --output")
        if info is not None:
            check_no_overlap(history, manifest, run.data)
            data_stage, stage_start_step = info.raw["data_stage"] + 1, info.step
        plan = make_plan(run, num_train, retained, train_bs)
    if run.stop_at_step is not None and run.stop_at_step > plan.planned_steps:
        raise ValueError(f"stop_at_step={run.stop_at_step} is beyond the plan ({plan.planned_steps} steps)")
    history = history + [{"data_stage": data_stage, "manifest": str(pathlib.Path(run.data).resolve()),
                          "sha256": manifest.sha256, "train": sorted(manifest.ids("train")),
                          "test": sorted(manifest.ids("test"))}]
    ds_resolved = resolved_deepspeed(ds, plan)
    resolved = resolved_config(run=run, backbone=backbone, ds=ds_resolved, plan=plan, layout=layout,
                               manifest_path=run.data, manifest_sha256=manifest.sha256, data_stage=data_stage,
                               stage_start_step=stage_start_step, history=[
                                   {k: h[k] for k in ("data_stage", "manifest", "sha256")} for h in history],
                               data_order=data_order, tokenizer=manifest_tokenizer(manifest))

    check_shared_output(run_dir)  # every rank writes into the checkpoint folders rank 0 renames
    torch.manual_seed(run.seed)
    module = TTTPipelineModule(backbone, run.ttt, layout, seed=run.seed)
    if run.model and info is None:
        load_hf_weights({hf: p for _, _, hf, p in module.local_hf_named_parameters()}, run.model, backbone)
    params = [p for p in module.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=params, config=ds_resolved)
    loads_data = engine.is_first_stage() or engine.is_last_stage()
    batches = TrajectoryBatches(samples_from_manifest(manifest, "train") if loads_data else None,
                                num_samples=num_train, train_batch_size=train_bs, micro_batch_size=micro,
                                gradient_accumulation_steps=gas, dp_rank=engine.grid.data_parallel_id, dp_size=dp,
                                seed=run.seed + 7919 * data_stage, bucket=run.bucket, capacity=manifest.capacity)
    if resume:
        client = ckpt.load_checkpoint(engine, info.checkpoint, rank=rank)
        stage_step = resume_cursor(client, info, batches.steps_per_epoch, train_bs)
    elif start_stage_from:
        ckpt.load_checkpoint(engine, info.checkpoint, rank=rank, load_scheduler=False)
        start_schedule(engine)
        stage_step = 0
    else:
        start_schedule(engine)
        stage_step = 0
    if engine.global_steps != stage_start_step + stage_step:
        raise ValueError(f"{info.checkpoint}: DeepSpeed restored global step {engine.global_steps}, but the data "
                         f"cursor says stage step {stage_step} of a stage that began at step {stage_start_step}; "
                         "the checkpoint is inconsistent: resume from another checkpoint")

    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_dir / RUN_CONFIG, resolved)
    dist.barrier()
    data_iter = batches.iterate(stage_step) if loads_data else None
    target = run.stop_at_step or plan.planned_steps
    logger = MetricsLogger(run_dir, enabled=rank == 0, total=plan.planned_steps, initial=stage_step,
                           resume_step=engine.global_steps,  # drops leftover lines of steps this launch redoes
                           wandb_config=resolved if run.wandb else None, wandb_project=run.wandb_project,
                           resume=bool(resume))
    logger.message(f"[ds_ttt] {layout.num_stages} stages x {dp} dp, spec parts {layout.spec_parts()}, "
                   f"plan {plan.planned_steps} steps (warmup {plan.warmup_steps}), {num_train} train "
                   f"trajectories, global batch {train_bs} = {micro} x {gas} x {dp}; starting at stage step {stage_step}")
    last = module.last_stage_layer()

    def save(step_now: int) -> None:
        epoch, pos = divmod(step_now, batches.steps_per_epoch)
        client = {"stage_step": step_now, "data_stage": data_stage, "stage_start_step": stage_start_step,
                  "cursor": {"epoch": epoch, "batch": pos, "samples": step_now * train_bs},
                  "plan": plan.to_dict(), "manifest_sha256": manifest.sha256}
        ckpt.save_checkpoint(engine, run_dir, engine.global_steps, client, resolved, {"stages": history},
                             rank=rank, barrier=dist.barrier, on_phase=on_save_phase)

    try:
        while stage_step < target:
            if last is not None:
                last.reset_stats()
                set_step_objective(last, engine, batches, stage_step, run.ttt)
            lr = engine.get_lr()[0]
            t0 = time.perf_counter()
            loss = engine.train_batch(data_iter=data_iter)
            dt = time.perf_counter() - t0
            stage_step += 1
            st = gather_stats(module, peak_memory_bytes())
            record = None
            if stage_step % run.log_interval == 0 or stage_step == target:
                record = {
                    "step": engine.global_steps, "stage_step": stage_step, "data_stage": data_stage,
                    "epoch": (stage_step - 1) // batches.steps_per_epoch, "loss": float(loss),
                    "action_loss": st["action_nll_sum"] / max(st["num_action_tokens"], 1),
                    "obs_loss": st["obs_nll_sum"] / max(st["num_obs_tokens"], 1),
                    "inner_updates": int(st["num_updates"]), "inner_skipped": int(st["num_skipped"]),
                    "tokens": int(st["num_tokens"]), "tokens_per_s": st["num_tokens"] / dt, "step_time_s": dt,
                    "peak_mem_gb": st["peak_mem"] / 2**30, "lr": lr, "inner_lr": run.ttt.inner_lr}
            logger.step(record, loss=float(loss))  # the bar advances every step, whatever log_interval is
            if (run.save_interval and stage_step % run.save_interval == 0) or stage_step == target:
                save(stage_step)
    finally:
        logger.close()
    return run_dir

