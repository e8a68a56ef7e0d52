"""Checkpoints: the atomic save/load protocol of a RUN_DIR's DeepSpeed checkpoints (every rank calls it).

    from ds_ttt.train.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
    ckpt_dir = save_checkpoint(engine, run_dir, step, client_state, resolved, data_ids, rank=r, barrier=b)
    client_state = load_checkpoint(engine, resolve_checkpoint(run_dir), rank=r)

Layout of RUN_DIR:
    latest                      the tag of the newest *complete* checkpoint (DeepSpeed's format)
    step_00000040/              one DeepSpeed checkpoint (a tag):
        layer_NN-model_states.pt        pipeline layer NN's weights (spec order, see pipeline.py)
        mp_rank_00_model_states.pt      engine state + our client state (data cursor, plan, ...)
        *optim_states.pt                optimizer (ZeRO-1 partitions)
        rng/rank_00000.pt               per-rank RNG states (rng_state.py; weights_only-loadable)
        run_config.json, data_ids.json  the run record (run_record.py)
        COMPLETE                        written last
    step_00000040-resave1/      a re-save of step 40 (a resume that saves the same step again)
    metrics.jsonl, run_config.json (the launch's resolved config), wandb/

Atomicity (save_checkpoint): every rank writes into `.tmp-<tag>/`; after a barrier rank 0 writes the
run record and COMPLETE, fsyncs the folder, renames it to a name no directory has yet (`<tag>/`, or
`<tag>-resaveK/` when a resume re-saves a step that exists), switches `latest` (temp file, fsync,
os.replace) and only then removes the checkpoint it replaces. `latest` names a complete checkpoint at
every instant; a killed save leaves at most a `.tmp-*` folder or a superseded same-step folder, both
removed by the next save. `save_checkpoint(on_phase=...)` is called at each of SAVE_PHASES, so a test
can kill the save there (tests/unit/test_train_checkpoint.py in-process, tests/fault_injection.py
for a whole launch).

Loading is weights_only=True throughout: RNG states are stored as tensors/lists/numbers, and
DeepSpeed's own loader is switched to weights_only=True with its few objects allow-listed
(safe_loading.py). Single-process loading of a checkpoint's weights: reassembly.py.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil

import torch

from ds_ttt.train.atomic_io import fsync_path, fsync_tree, write_json_atomic, write_text_atomic
from ds_ttt.train.rng_state import capture_rng_state, load_rng_state, restore_rng_state, rng_state_file
from ds_ttt.train.run_record import DATA_IDS, RUN_CONFIG
from ds_ttt.train.safe_loading import use_safe_loading

LATEST = "latest"
COMPLETE = "COMPLETE"
RESAVE = "-resave"
TMP_PREFIX = ".tmp-"

# The phases of a save at which `on_phase(phase, path)` is called (rank 0, in this order):
#   engine_saved  every rank wrote its DeepSpeed files and RNG into .tmp-<tag>/ (nothing final yet)
#   complete      run_config.json, data_ids.json and COMPLETE written and flushed inside .tmp-<tag>/
#   renamed       .tmp-<tag>/ renamed to its final, new name; `latest` still names the previous checkpoint
#   latest        `latest` switched to the new checkpoint; the one it replaces (same step) not yet removed
SAVE_PHASES = ("engine_saved", "complete", "renamed", "latest")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory name (`step_00000004` or a re-save `step_00000004-resave1`)."""
    m = re.fullmatch(r"step_(\d{8})(?:" + RESAVE + r"\d+)?", name)
    return int(m.group(1)) if m else None


def resolve_checkpoint(path: str | os.PathLike) -> pathlib.Path:
    """RUN_DIR -> its latest complete checkpoint; a checkpoint directory -> itself (checked complete)."""
    path = pathlib.Path(path)
    if (path / LATEST).is_file():
        tag = (path / LATEST).read_text().strip()
        ckpt = path / tag
        if not (ckpt / COMPLETE).is_file():
            raise FileNotFoundError(f"{path / LATEST} names {tag!r}, but {ckpt} is not a complete checkpoint")
        return ckpt
    if path.is_dir() and path.name.startswith(TMP_PREFIX):  # even with COMPLETE: not renamed, not named by latest
        raise FileNotFoundError(f"{path} is an unfinished checkpoint (the save was interrupted)")
    if (path / COMPLETE).is_file() and (path / RUN_CONFIG).is_file():
        return path
    raise FileNotFoundError(f"{path}: neither a RUN_DIR with a '{LATEST}' file nor a complete checkpoint directory "
                            f"(one with {COMPLETE} and {RUN_CONFIG}); has the run saved a checkpoint yet?")


def final_name(run_dir: pathlib.Path, tag: str) -> str:
    """A name no directory has yet: the tag itself, else tag-resaveK (a re-save of a step never touches
    the directory `latest` may name until the new one is complete and named by `latest`)."""
    if not (run_dir / tag).exists():
        return tag
    k = 1
    while (run_dir / f"{tag}{RESAVE}{k}").exists():
        k += 1
    return f"{tag}{RESAVE}{k}"


def remove_superseded(run_dir: pathlib.Path) -> None:
    """Remove leftovers of interrupted saves (`.tmp-*`) and every checkpoint of the step `latest` names
    that `latest` does not name (a re-save replaced it)."""
    for stale in run_dir.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    if not (run_dir / LATEST).is_file():
        return
    named = (run_dir / LATEST).read_text().strip()
    step = step_of(named)
    if step is None:
        return
    for d in run_dir.iterdir():
        if d.is_dir() and d.name != named and step_of(d.name) == step:
            shutil.rmtree(d)


def save_checkpoint(engine, run_dir: pathlib.Path, step: int, client_state: dict, resolved: dict,
                    data_ids: dict, *, rank: int, barrier, on_phase=None) -> pathlib.Path:
    """Save atomically; `barrier()` synchronises all ranks; returns the new checkpoint directory.

    Every rank writes into `.tmp-<tag>/`; rank 0 then writes the run record and COMPLETE, flushes the
    folder, renames it to a name no directory has (the tag, or tag-resaveK when the step exists, as on
    a resume that re-saves the step `latest` names), switches `latest` atomically, and only then
    removes the checkpoint of the same step it replaces. `latest` names a complete checkpoint at every
    instant. `on_phase(phase, path)` is called on rank 0 at each of SAVE_PHASES (fault injection)."""
    run_dir = pathlib.Path(run_dir)
    tag = tag_for(step)
    tmp_tag = TMP_PREFIX + tag
    tmp = run_dir / tmp_tag
    on_phase = on_phase or (lambda phase, path: None)
    if rank == 0:
        remove_superseded(run_dir)  # the previous save may have been killed before its cleanup
    barrier()
    engine.save_checkpoint(str(run_dir), tag=tmp_tag, client_state=client_state, save_latest=False)
    rng_file = rng_state_file(tmp, rank)
    rng_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(capture_rng_state(), rng_file)
    fsync_path(rng_file)
    barrier()
    final = None
    if rank == 0:
        on_phase("engine_saved", tmp)
        write_json_atomic(tmp / RUN_CONFIG, {**resolved, "step": step})
        write_json_atomic(tmp / DATA_IDS, data_ids)
        write_text_atomic(tmp / COMPLETE, tag + "\n")
        fsync_tree(tmp)
        on_phase("complete", tmp)
        final = run_dir / final_name(run_dir, tag)
        os.rename(tmp, final)
        fsync_path(run_dir)
        on_phase("renamed", final)
        write_text_atomic(run_dir / LATEST, final.name)
        on_phase("latest", final)
        remove_superseded(run_dir)
    barrier()
    return final if final is not None else resolve_checkpoint(run_dir)


def load_checkpoint(engine, ckpt: pathlib.Path, *, rank: int, load_optimizer: bool = True,
                    load_scheduler: bool = True) -> dict:
    """Load weights (+ optimizer, scheduler) and this rank's RNG (weights_only=True throughout);
    returns the client state."""
    use_safe_loading(engine)
    rng = load_rng_state(rng_state_file(ckpt, rank), rank)  # before DeepSpeed: fail fast
    _, client = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name, load_optimizer_states=load_optimizer,
                                       load_lr_scheduler_states=load_scheduler)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load {ckpt}")
    restore_rng_state(rng)
    return client
