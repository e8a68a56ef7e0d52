"""The training run: resolve where it starts, build the pipeline engine, then step, log and checkpoint.

    from ds_ttt.train.engine import Trainer
    Trainer.build(run_cfg, ds_config, resume=None, start_stage_from=None).train()   # after deepspeed.init_distributed

Three ways to start (`resolve_start`; ds_ttt/train/checkpoint.py has the files):
  fresh                 plan fixed from the data (--max_steps or epochs), schedule starts at 0;
  --resume CKPT         same manifest (hash checked), plan and global batch (refused with the key, both
                        values and the fix otherwise: ds_ttt/train/resume_checks.py); weights,
                        optimizer, scheduler, RNG and the saved data cursor (checked against the step)
                        continue exactly (per-step losses equal an uninterrupted run);
  --resume CKPT --output NEW with another layout (stages, partition, dp size, micro x accumulation):
                        a move (ds_ttt/train/layout_move.py): the checkpoint is converted into NEW
                        (DeepSpeed's universal checkpoint + the layer files) and the run continues
                        there with the losses it would have had (to fp32 summation order);
  --start-stage-from C  a new data stage: a new manifest and a new output dir; weights, optimizer and
                        RNG are kept, the data order and the schedule restart (a new plan), the
                        cumulative step count continues; train/test ids must not cross between stages.
At startup every rank checks that RUN_DIR is one shared filesystem (ds_ttt/train/shared_output.py).

`Trainer.build` does everything before the first step (checks first, so a refusal happens before any
collective, on every rank alike); `Trainer.step` runs one optimizer step; `Trainer.train` is the loop
(metrics every step, a checkpoint every `save_interval` steps and at the last step).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import time
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist

from ds_ttt.data.manifest import load_manifest
from ds_ttt.model.hf_adapter import load_hf_weights, load_qwen3_config
from ds_ttt.model.presets import backbone_config
from ds_ttt.train import checkpoint as ckpt
from ds_ttt.train.atomic_io import write_json_atomic
from ds_ttt.train.data_loader import TrajectoryBatches, collate, samples_from_manifest
from ds_ttt.train.deepspeed_config import batch_sizes, ds_dtype, validate_deepspeed
from ds_ttt.train.layout import Layout
from ds_ttt.train.layout_move import (Move, check_movable, check_target_zero, convert_for_move, layout_words,
                                     load_moved, with_universal_load)
from ds_ttt.train.logging import MetricsLogger, peak_memory_bytes
from ds_ttt.train.objective import StepObjective
from ds_ttt.train.pipeline import STAT_KEYS, TTTPipelineModule
from ds_ttt.train.resume_checks import (DATA_ORDER_KEYS, check_fresh_output, check_no_overlap, check_plan_unchanged,
                                        check_reproducible, check_restored_step, check_resume_source,
                                        check_same_model, resume_cursor)
from ds_ttt.train.run_config import RunConfig
from ds_ttt.train.run_record import RUN_CONFIG, RunInfo, manifest_tokenizer, resolved_config
from ds_ttt.train.schedule import Plan, make_plan, resolved_deepspeed, start_schedule
from ds_ttt.train.shared_output import check_shared_output

DATA_SEED_STRIDE = 7919  # data stage s orders its data with seed + DATA_SEED_STRIDE * s


def rank_device() -> str:
    """This rank's device as DeepSpeed's accelerator names it ("cpu" on the CPU accelerator)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0")))


PREFLIGHT_DEVICE_GIB = "DS_TTT_PREFLIGHT_DEVICE_GIB"  # plan for a device of this size (e.g. 80 on a CPU box)


def memory_preflight(run: RunConfig, ds: dict, backbone, layout: Layout, world: int, samples0, *, rank: int,
                     device: str) -> None:
    """Estimate the busiest rank's peak before anything is built (ds_ttt/train/memory_budget.py) and print
    it; refuse, naming the context, the estimate and what would fit, when the device is smaller. The
    data's shape (longest trajectory and round) is read from rank 0's rendered train split. CPU ranks
    report and go on, unless DS_TTT_PREFLIGHT_DEVICE_GIB names a device to plan for."""
    from ds_ttt.train import memory_budget

    shape = memory_budget.data_shape(samples0) if rank == 0 else None
    tokens, round_tokens = broadcast_from_rank0(shape)
    stages = layout.num_stages
    plan = memory_budget.layout_of(ds, stages, world // stages)
    device_bytes = None
    if os.environ.get(PREFLIGHT_DEVICE_GIB):
        device_bytes = int(float(os.environ[PREFLIGHT_DEVICE_GIB]) * memory_budget.GIB)
    elif device.startswith("cuda"):
        device_bytes = torch.cuda.get_device_properties(torch.device(device)).total_memory
    rows = int(ds.get("train_micro_batch_size_per_gpu", 1))
    est, refusal = memory_budget.preflight(backbone, run.ttt, tokens=max(tokens, 1), round_tokens=max(round_tokens, 1),
                                           layout=plan, device_bytes=device_bytes, world=world, rows=rows,
                                           dtype_bytes=4 if ds_dtype(ds) == "fp32" else 2)
    if rank == 0:
        where = (f"device {device_bytes / memory_budget.GIB:.1f} GiB" if device_bytes is not None
                 else "CPU ranks: reported, not enforced")
        print(f"[ds_ttt] memory pre-flight: longest trajectory {tokens} tokens, longest round {round_tokens}, "
              f"{rows} row(s) per micro-batch, {plan.describe()}: busiest rank ~"
              f"{memory_budget.gib_text(est.total_gib)} ({est.table()}); {where}", flush=True)
    if refusal is not None:
        raise ValueError(refusal)


def resolved_deepspeed_batch(ds: dict, data_order: dict) -> dict:
    """The DeepSpeed config with its micro-batch size resolved (the config may leave it to DeepSpeed)."""
    return dict(ds, train_micro_batch_size_per_gpu=data_order["train_micro_batch_size_per_gpu"])


def build_module(backbone, ttt, layout: Layout, *, seed: int, device: str) -> TTTPipelineModule:
    """This rank's pipeline module, its parameters created on `device` (where DeepSpeed moves them anyway):
    a Qwen3-8B-sized random init on the CPU first takes minutes, on a GPU seconds. On the CPU accelerator
    it is the same module as before, bit for bit."""
    with torch.device(device):
        return TTTPipelineModule(backbone, ttt, layout, seed=seed)


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


def broadcast_from_rank0(obj):
    """Rank 0's `obj` on every rank (a collective: every rank calls it)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_stats(module: TTTPipelineModule, peak: int) -> dict:
    """The last stage's per-step statistics summed over the data-parallel replicas, and the peak
    memory (max over every rank)."""
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


@dataclass(frozen=True)
class StageStart:
    """Where a launch starts: the checkpoint it continues (None when fresh), the data stage's plan and
    number, the cumulative step the stage began at, and every stage's held-out record, this one last."""

    info: RunInfo | None
    plan: Plan
    data_stage: int
    stage_start_step: int
    history: list[dict]
    move: Move | None = None  # --resume into another layout


def resolve_start(run: RunConfig, manifest, backbone, layout: Layout, data_order: dict, *, resume: str | None,
                  start_stage_from: str | None) -> StageStart:
    """Read the checkpoint a launch continues from (if any), run the checks its kind of start needs
    (ds_ttt/train/resume_checks.py) and fix the plan: the saved one on --resume, a new one otherwise."""
    num_train = len(manifest.ids("train"))
    source = resume or start_stage_from
    info = RunInfo.read(ckpt.resolve_checkpoint(source)) if source else None
    history: list[dict] = []
    data_stage, stage_start_step = 0, 0
    if info is not None:
        check_same_model(run, info, backbone)
        history = info.stage_history()
    move = None
    if resume:
        moving = check_reproducible(info, data_order, layout)
        check_resume_source(run, info, manifest, moving=moving)
        plan = Plan(**info.plan)
        check_plan_unchanged(run, plan.planned_steps, info)
        if moving:
            check_movable(run, info, data_order)
            saved_layout, saved_order = info.pipeline_layout(), info.raw["data_order"]
            move = Move(source=info.checkpoint,
                        source_world=saved_layout.num_stages * saved_order["data_parallel_size"],
                        old=layout_words(saved_layout.num_stages, saved_order),
                        new=layout_words(layout.num_stages, data_order))
        data_stage, stage_start_step = info.raw["data_stage"], info.raw["stage_start_step"]
        history = history[:-1]  # this stage's own entry is re-added below
    else:
        check_fresh_output(pathlib.Path(run.output))
        if info is not None:
            check_no_overlap(history, manifest, run.data)
            data_stage, stage_start_step = info.raw["data_stage"] + 1, info.step
        plan = make_plan(run, num_train, sum(manifest.retained_rounds("train").values()),
                         data_order["train_batch_size"])
    if run.stop_at_step is not None and run.stop_at_step > plan.planned_steps:
        raise ValueError(f"stop_at_step={run.stop_at_step} is beyond the plan ({plan.planned_steps} steps)")
    history = history + [{"data_stage": data_stage, "manifest": str(pathlib.Path(run.data).resolve()),
                          "sha256": manifest.sha256, "train": sorted(manifest.ids("train")),
                          "test": sorted(manifest.ids("test"))}]
    return StageStart(info, plan, data_stage, stage_start_step, history, move)


def restore(engine, start: StageStart, batches: TrajectoryBatches, *, resume: bool, rank: int,
            moved: pathlib.Path | None = None) -> int:
    """Load the checkpoint a launch continues from (`moved`: its conversion for this layout), or start
    the schedule of a new stage; returns the stage step to start at (checked against DeepSpeed's
    restored global step)."""
    if resume:
        if moved is not None:
            client = load_moved(engine, moved, start.move, rank=rank)
        else:
            client = ckpt.load_checkpoint(engine, start.info.checkpoint, rank=rank)
        stage_step = resume_cursor(client, start.info, batches.steps_per_epoch, batches.global_batch)
    elif start.info is not None:  # --start-stage-from: weights, optimizer, RNG; a new schedule
        ckpt.load_checkpoint(engine, start.info.checkpoint, rank=rank, load_scheduler=False)
        start_schedule(engine)
        stage_step = 0
    else:
        start_schedule(engine)
        stage_step = 0
    check_restored_step(engine.global_steps, start.stage_start_step, stage_step,
                        start.info.checkpoint if start.info is not None else "the fresh engine")
    return stage_step


class Trainer:
    """One launch of the trainer on the current process group (every rank builds one)."""

    def __init__(self, run: RunConfig, *, engine, module: TTTPipelineModule, batches: TrajectoryBatches,
                 start: StageStart, resolved: dict, layout: Layout, data_order: dict, manifest_sha256: str,
                 stage_step: int, resume: bool, on_save_phase=None, move_note: str | None = None):
        self.run, self.engine, self.module, self.batches = run, engine, module, batches
        self.plan, self.data_stage, self.stage_start_step = start.plan, start.data_stage, start.stage_start_step
        self.history, self.resolved, self.layout, self.data_order = start.history, resolved, layout, data_order
        self.manifest_sha256, self.stage_step, self.resume = manifest_sha256, stage_step, resume
        self.on_save_phase = on_save_phase
        self.move_note = move_note  # what a move did (logged at the start of train())
        self.rank = dist.get_rank()
        self.run_dir = pathlib.Path(run.output)
        self.last = module.last_stage_layer()  # None off the last stage
        loads_data = engine.is_first_stage() or engine.is_last_stage()
        self.data_iter = batches.iterate(stage_step) if loads_data else None
        self.target = run.stop_at_step or self.plan.planned_steps

    @classmethod
    def build(cls, run: RunConfig, ds: dict, *, resume: str | None = None, start_stage_from: str | None = None,
              on_save_phase=None) -> "Trainer":
        """Resolve and check the start, build the pipeline module and the DeepSpeed engine, restore the
        checkpoint (or start the schedule) and write RUN_DIR/run_config.json. `on_save_phase(phase,
        path)`: called at each phase of every save (fault injection, ds_ttt/train/checkpoint.py)."""
        if resume and start_stage_from:
            raise ValueError("--resume and --start-stage-from are exclusive (resume continues a stage; "
                             "--start-stage-from begins a new one)")
        rank, world = dist.get_rank(), dist.get_world_size()
        manifest = load_manifest(run.data)
        backbone = load_backbone(run, manifest)
        layout = validate_deepspeed(run, ds, world, backbone.num_hidden_layers,
                                    tied_embeddings=bool(backbone.tie_word_embeddings))
        dp = world // layout.num_stages
        data_order = dict(zip(DATA_ORDER_KEYS, (*batch_sizes(ds, dp), dp)))
        # rank 0 is the first stage and always loads data: render its split once, for the check and the batches
        samples0 = samples_from_manifest(manifest, "train") if rank == 0 else None
        memory_preflight(run, resolved_deepspeed_batch(ds, data_order), backbone, layout, world, samples0, rank=rank,
                         device=rank_device())
        start = resolve_start(run, manifest, backbone, layout, data_order, resume=resume,
                              start_stage_from=start_stage_from)
        if start.move is not None:
            check_target_zero(ds)
        ds_resolved = resolved_deepspeed(ds, start.plan)
        resolved = resolved_config(run=run, backbone=backbone, ds=ds_resolved, plan=start.plan, layout=layout,
                                   manifest_path=run.data, manifest_sha256=manifest.sha256,
                                   data_stage=start.data_stage, stage_start_step=start.stage_start_step,
                                   history=[{k: h[k] for k in ("data_stage", "manifest", "sha256")}
                                            for h in start.history],
                                   data_order=data_order, tokenizer=manifest_tokenizer(manifest))

        run_dir = pathlib.Path(run.output)
        ds_engine, moved = ds_resolved, None
        check_shared_output(run_dir)  # every rank writes into the checkpoint folders rank 0 renames
        if start.move is not None:  # the source run is only read; the converted state goes into RUN_DIR
            moved = convert_for_move(start.move, run_dir, rank=rank, share=broadcast_from_rank0)
            ds_engine = with_universal_load(ds_resolved)  # this launch's load only; the record keeps ds_resolved
        torch.manual_seed(run.seed)
        module = build_module(backbone, run.ttt, layout, seed=run.seed, device=rank_device())
        if run.model and start.info is None:
            load_hf_weights({hf: p for _, _, hf, p in module.local_hf_named_parameters()}, run.model, backbone)
        params = [p for p in module.parameters() if p.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=params, config=ds_engine)
        loads_data = engine.is_first_stage() or engine.is_last_stage()
        samples = samples0 if samples0 is not None else samples_from_manifest(manifest, "train") if loads_data else None
        batches = TrajectoryBatches(samples if loads_data else None,
                                    num_samples=len(manifest.ids("train")),
                                    train_batch_size=data_order["train_batch_size"],
                                    micro_batch_size=data_order["train_micro_batch_size_per_gpu"],
                                    gradient_accumulation_steps=data_order["gradient_accumulation_steps"],
                                    dp_rank=engine.grid.data_parallel_id, dp_size=dp,
                                    seed=run.seed + DATA_SEED_STRIDE * start.data_stage, bucket=run.bucket,
                                    capacity=manifest.capacity)
        stage_step = restore(engine, start, batches, resume=bool(resume), rank=rank, moved=moved)

        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(run_dir / RUN_CONFIG, resolved)
        dist.barrier()
        move_note = None
        if moved is not None:
            if rank == 0:
                shutil.rmtree(moved)  # every rank has loaded it (barrier above); the source still holds the state
            move_note = (f"[ds_ttt] moved {start.move.source} ({start.move.describe()}): DeepSpeed universal "
                         "checkpoint (ds_to_universal + load_universal: optimizer-held weights, AdamW moments, LR "
                         "schedule, step, data cursor) + ds_ttt reassembly of the layer files by spec index "
                         "(frozen weights); RNG of old rank r mod " + str(start.move.source_world))
        return cls(run, engine=engine, module=module, batches=batches, start=start, resolved=resolved, layout=layout,
                   data_order=data_order, manifest_sha256=manifest.sha256, stage_step=stage_step,
                   resume=bool(resume), on_save_phase=on_save_phase, move_note=move_note)

    def step(self) -> dict:
        """One optimizer step (stage step k -> k + 1): set the step's objective on the last stage, run
        DeepSpeed's train_batch, gather the statistics (collectives). Returns the step's metrics record."""
        if self.last is not None:
            self.last.reset_stats()
            set_step_objective(self.last, self.engine, self.batches, self.stage_step, self.run.ttt)
        lr = self.engine.get_lr()[0]
        t0 = time.perf_counter()
        loss = self.engine.train_batch(data_iter=self.data_iter)
        dt = time.perf_counter() - t0
        self.stage_step += 1
        st = gather_stats(self.module, peak_memory_bytes())
        return {
            "step": self.engine.global_steps, "stage_step": self.stage_step, "data_stage": self.data_stage,
            "epoch": (self.stage_step - 1) // self.batches.steps_per_epoch, "loss": float(loss),
            "action_loss": st["action_nll_sum"] / max(st["num_action_tokens"], 1),
            "obs_loss": st["obs_nll_sum"] / max(st["num_obs_tokens"], 1),
            "inner_updates": int(st["num_updates"]), "inner_skipped": int(st["num_skipped"]),
            "tokens": int(st["num_tokens"]), "tokens_per_s": st["num_tokens"] / dt, "step_time_s": dt,
            "peak_mem_gb": st["peak_mem"] / 2**30, "lr": lr, "inner_lr": self.run.ttt.inner_lr}

    def save(self) -> None:
        """Checkpoint the current stage step (every rank): weights, optimizer, scheduler, RNG, the data
        cursor and the run record."""
        epoch, pos = divmod(self.stage_step, self.batches.steps_per_epoch)
        train_bs = self.data_order["train_batch_size"]
        client = {"stage_step": self.stage_step, "data_stage": self.data_stage, "stage_start_step": self.stage_start_step,
                  "cursor": {"epoch": epoch, "batch": pos, "samples": self.stage_step * train_bs},
                  "plan": self.plan.to_dict(), "manifest_sha256": self.manifest_sha256}
        ckpt.save_checkpoint(self.engine, self.run_dir, self.engine.global_steps, client, self.resolved,
                             {"stages": self.history}, rank=self.rank, barrier=dist.barrier, on_phase=self.on_save_phase)

    def train(self) -> pathlib.Path:
        """Step until the stop step (`stop_at_step`, else the plan's last step): the progress bar
        advances every step, metrics are written every `log_interval` steps and at the end, a checkpoint
        every `save_interval` steps and at the end. Returns RUN_DIR."""
        run, plan, order = self.run, self.plan, self.data_order
        logger = MetricsLogger(self.run_dir, enabled=self.rank == 0, total=plan.planned_steps, initial=self.stage_step,
                               resume_step=self.engine.global_steps,  # drops leftover lines of steps this launch redoes
                               wandb_config=self.resolved if run.wandb else None, wandb_project=run.wandb_project,
                               resume=self.resume)
        logger.message(f"[ds_ttt] {self.layout.num_stages} stages x {order['data_parallel_size']} dp, spec parts "
                       f"{self.layout.spec_parts()}, plan {plan.planned_steps} steps (warmup {plan.warmup_steps}), "
                       f"{self.batches.num_samples} train trajectories, global batch {order['train_batch_size']} = "
                       f"{order['train_micro_batch_size_per_gpu']} x {order['gradient_accumulation_steps']} x "
                       f"{order['data_parallel_size']}; starting at stage step {self.stage_step}")
        if self.move_note:
            logger.message(self.move_note)
        try:
            while self.stage_step < self.target:
                record = self.step()
                logged = self.stage_step % run.log_interval == 0 or self.stage_step == self.target
                logger.step(record if logged else None, loss=record["loss"])  # the bar advances every step
                if (run.save_interval and self.stage_step % run.save_interval == 0) or self.stage_step == self.target:
                    self.save()
        finally:
            logger.close()
        return self.run_dir
