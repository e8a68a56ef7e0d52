"""What a launch that continues from a checkpoint must keep: the refusals of `--resume` and
`--start-stage-from`. Each raises ValueError in one line naming the key, both values and the fix.

    from ds_ttt.train.resume_checks import check_reproducible, resume_cursor

--resume continues exactly or not at all: the same model (backbone, STRUCTURAL_TTT), manifest
(sha256), plan and global batch (train_batch_size); the saved data cursor must agree with the saved
step. In the checkpoint's own layout (DATA_ORDER_KEYS and the pipeline's stages and partition all as
recorded) it continues in the checkpoint's RUN_DIR, bit for bit. In another layout (`check_reproducible`
returns True) it is a move: a new RUN_DIR, and the further refusals of ds_ttt/train/layout_move.py.
--start-stage-from keeps the model and needs a fresh RUN_DIR whose train/test ids do not cross an
earlier stage's. Tests: tests/unit/test_resume_checks.py, tests/unit/test_train_config.py (stage overlap).
"""

from __future__ import annotations

import pathlib

from ds_ttt.train.checkpoint import LATEST
from ds_ttt.train.run_config import RunConfig
from ds_ttt.train.run_record import RUN_CONFIG, RunInfo

# Settings that change the model's structure or meaning: a resume or a new data stage must keep them.
STRUCTURAL_TTT = ("adaptive_layers", "prime_intermediate_size", "trainable_scope", "key_shift", "round_address",
                  "write_rate")
# DeepSpeed settings that decide the data order (the batches, their split into micro-batches and ranks).
DATA_ORDER_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "data_parallel_size")


def check_same_model(run: RunConfig, info: RunInfo, backbone) -> None:
    """The backbone config and the structural TTT settings are the checkpoint's."""
    if backbone.to_dict() != info.backbone_config().to_dict():
        raise ValueError(f"{info.checkpoint}: the backbone differs from this launch's (--preset/--model); "
                         f"use the checkpoint's model source {info.model_source}")
    for key in STRUCTURAL_TTT:
        saved = info.ttt[key]  # RunInfo.read refuses a record without every TTTConfig field
        if getattr(run.ttt, key) != saved:
            raise ValueError(f"ttt.{key}={getattr(run.ttt, key)!r} but {info.checkpoint} was trained with "
                             f"{saved!r}; keep it the same to continue from that checkpoint")


def check_resume_source(run: RunConfig, info: RunInfo, manifest, *, moving: bool = False) -> None:
    """--resume reads the checkpoint's manifest and writes into the checkpoint's RUN_DIR; a move
    (`moving`: another layout) writes into a new RUN_DIR and never into the source run."""
    if manifest.sha256 != info.manifest_sha256:
        raise ValueError(f"--resume: {run.data} (sha256 {manifest.sha256[:12]}…) is not the manifest of "
                         f"{info.checkpoint} ({info.manifest_path}, {info.manifest_sha256[:12]}…); resume with the "
                         "same data, or begin a new data stage with --start-stage-from")
    run_dir = pathlib.Path(run.output)
    if moving:
        if run_dir.resolve() == info.checkpoint.parent.resolve():
            raise ValueError(f"--resume into another layout writes a new RUN_DIR and leaves the source run "
                             f"{run_dir} as it is: pass --output NEW_RUN_DIR")
        check_fresh_output(run_dir)
        return
    if run_dir.resolve() != info.checkpoint.parent.resolve():
        raise ValueError(f"--resume continues in the checkpoint's RUN_DIR {info.checkpoint.parent}; "
                         f"--output {run_dir} differs (omit --output or pass that directory)")


def check_plan_unchanged(run: RunConfig, planned_steps: int, info: RunInfo) -> None:
    """--max_steps, when given on --resume, is the plan fixed at the stage's first launch."""
    if run.max_steps is not None and run.max_steps != planned_steps:
        raise ValueError(f"--max_steps {run.max_steps} differs from the plan fixed at the first launch "
                         f"({planned_steps} steps, {info.checkpoint / RUN_CONFIG}); the plan never "
                         "changes on resume: omit --max_steps or pass the same value")


def saved_data_order(info: RunInfo) -> dict:
    """The batch layout a checkpoint was trained with (run_config.json's `data_order`)."""
    order = info.raw.get("data_order")
    if not order:
        raise ValueError(f"{info.checkpoint / RUN_CONFIG} records no batch layout (data_order), so a resume cannot "
                         "be checked to reproduce the run: begin a new data stage with --start-stage-from instead")
    return order


def check_reproducible(info: RunInfo, data_order: dict, layout) -> bool:
    """--resume continues exactly or not at all. The global batch (train_batch_size) decides which
    trajectories every step trains on, so it must be the checkpoint's. Returns whether the layout
    (micro-batch / accumulation split, data-parallel size, pipeline stages or partition) differs from
    the checkpoint's: False = an exact resume in place, True = a move (ds_ttt/train/layout_move.py)."""
    saved = saved_data_order(info)
    where = info.checkpoint / RUN_CONFIG
    key = "train_batch_size"
    if saved[key] != data_order[key]:
        raise ValueError(f"--resume: {key} is {data_order[key]} now but {saved[key]} in {where}; the global batch "
                         f"decides the data order, so the run cannot continue with another: set {key}={saved[key]} "
                         "in the DeepSpeed config, or begin a new data stage with --start-stage-from")
    saved_layout = info.pipeline_layout()
    return (any(saved[k] != data_order[k] for k in DATA_ORDER_KEYS)
            or saved_layout.num_stages != layout.num_stages
            or tuple(saved_layout.prefix_per_stage) != tuple(layout.prefix_per_stage))


def check_fresh_output(run_dir: pathlib.Path) -> None:
    """A fresh launch or a new data stage writes into a RUN_DIR that holds no run yet."""
    if (run_dir / LATEST).exists():
        raise ValueError(f"{run_dir} already holds a run; continue it with --resume {run_dir}, or pass a new --output")


def check_no_overlap(history: list[dict], manifest, manifest_path: str) -> None:
    """A new data stage's train ids are in no earlier stage's test split, and its test ids in no
    earlier stage's train split."""
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


def check_restored_step(global_steps: int, stage_start_step: int, stage_step: int, source) -> None:
    """DeepSpeed's restored global step = the stage's first step + the data cursor's stage step
    (`source`: the checkpoint it was restored from)."""
    if global_steps != stage_start_step + stage_step:
        raise ValueError(f"{source}: DeepSpeed restored global step {global_steps}, but the data "
                         f"cursor says stage step {stage_step} of a stage that began at step {stage_start_step}; "
                         "the checkpoint is inconsistent: resume from another checkpoint")
