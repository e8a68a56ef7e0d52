"""Moving a run to another machine shape: `--resume RUN --deepspeed_config OTHER.json --output NEW_RUN`.

    from ds_ttt.train.layout_move import check_movable, convert_for_move, load_moved, with_universal_load
    check_movable(run, info, data_order)                             # refusals, before anything is built
    moved = convert_for_move(move, run_dir, rank=r, share=broadcast)  # rank 0 converts; all wait
    engine = deepspeed.initialize(..., config=with_universal_load(ds))
    client = load_moved(engine, moved, move, rank=r)                 # layer files, universal state, RNG

What may change: the number of pipeline stages (and the partition), the data-parallel size and the
micro-batch / accumulation split. What must not: the global batch (train_batch_size), the model
(backbone, every TTT setting that enters the computation) and the data seed; each is refused naming
the field. Why the losses carry over: the trajectories of global step k depend on the global batch
only (ds_ttt/train/data_loader.py; it has been so since the first trainer), the objective is
normalised by the global batch's token counts (ds_ttt/train/objective.py), and every pipeline layer
file and every optimizer tensor is named by its spec index, which no layout changes (layout.py). A
new layout adds the micro-batch losses and gradients in another order, so the losses agree to fp32
summation-order error, not bit for bit (tests/e2e/test_layout_move.py derives the bound).

How the state is carried (`convert_for_move`, rank 0, into NEW_RUN; the source run is only read):
  * DeepSpeed's universal checkpoint (`deepspeed.checkpoint.ds_to_universal`) turns the ZeRO
    partitions of every stage and rank into one folder per optimizer-held parameter
    (zero/<name>/{fp32, exp_avg, exp_avg_sq, step}.pt); the new engine loads it with
    `checkpoint.load_universal` and re-slices it for its own stages and ranks: the trained weights,
    the AdamW moments and step. The mp_rank files it copies carry the LR schedule, the global step and
    our client state (the data cursor). It reads a view of the source without the pipeline layer
    files (`link_conversion_input`: its Megatron-shaped layer map divides by zero when a source has
    fewer decoder layer files than stages), so every preset and stage count converts alike.
  * ds_ttt's reassembly by spec index (layout.py): the pipeline layer files are copied as they are
    and every stage loads its layers from them before the universal load, so parameters the
    optimizer does not hold (frozen by ttt.trainable_scope) carry over too; a `stage_anchor` (the
    placeholder of a stage with nothing to train, pipeline.py) is written as zeros where the new
    layout has one.
  * RNG: new rank r takes old rank r mod (old world size)'s states. The trainer draws no random
    numbers during a step, so this changes no loss; per-rank streams have no meaning across layouts.
The converted checkpoint is written into NEW_RUN/.tmp-moved-<tag>/, flushed and renamed to
NEW_RUN/moved-<tag>/ (atomic_io.py); it is removed once every rank has loaded it. A kill during the
conversion leaves the source run untouched and NEW_RUN without a `latest`: rerun the same command.

Loading: every file of the source is first checked to load with weights_only=True (DeepSpeed's few
objects allow-listed, safe_loading.py), because ds_to_universal and DeepSpeed's universal loader call
torch.load(weights_only=False); the converted files they then read were written by this launch.

The source must hold ZeRO partitions (zero_optimization.stage 1, every shipped config); a stage-0
run is refused (DeepSpeed's universal conversion reads ZeRO files only). Tests:
tests/unit/test_resume_checks.py (the refusals), tests/unit/test_layout_move_parts.py (the pieces, and
the conversion of every preset x every accepted stage count), tests/e2e/test_layout_move.py (four moves,
the main recipe's among them, against uninterrupted runs, an exact resume after each, a kill during the
conversion).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pathlib
import shutil
from dataclasses import dataclass

import torch

from ds_ttt.train.atomic_io import fsync_path, fsync_tree
from ds_ttt.train.checkpoint import COMPLETE
from ds_ttt.train.pipeline import ANCHOR
from ds_ttt.train.rng_state import RNG_DIR, load_rng_state, restore_rng_state, rng_state_file
from ds_ttt.train.run_record import DATA_IDS, RUN_CONFIG, RunInfo
from ds_ttt.train.safe_loading import deepspeed_safe_globals, use_safe_loading

MOVED_PREFIX = "moved-"  # NEW_RUN/moved-<source tag>/: the converted checkpoint a move loads
TMP_MOVED_PREFIX = ".tmp-" + MOVED_PREFIX
UNIVERSAL_DIR = "zero"  # ds_to_universal's per-parameter folder inside a converted checkpoint
LAYER_FILES = "layer_*-model_states.pt"  # pipeline layer files: one per spec index, copied, not converted
CONVERSION_INPUT = ".conversion-input"  # the view of the source that DeepSpeed's converter reads
# TTT settings that choose an implementation, not the computation: a move may change them.
IMPLEMENTATION_TTT = ("attention_backend", "checkpoint_events")


@dataclass(frozen=True)
class Move:
    """A resume into another layout: where the source state is, and the two layouts in words."""

    source: pathlib.Path  # the source checkpoint directory (only read)
    source_world: int  # its number of ranks (RNG files)
    old: str
    new: str

    def describe(self) -> str:
        return f"{self.old} -> {self.new}"


def layout_words(num_stages: int, order: dict) -> str:
    return (f"{num_stages} stages x {order['data_parallel_size']} dp (micro {order['train_micro_batch_size_per_gpu']}"
            f" x accumulation {order['gradient_accumulation_steps']})")


def check_movable(run, info: RunInfo, data_order: dict) -> None:
    """A move keeps the computation: every TTT setting but the implementation choices, the data seed,
    and a ZeRO-partitioned source (train_batch_size and the backbone are checked by resume_checks)."""
    where = info.checkpoint / RUN_CONFIG
    for key, saved in info.ttt.items():
        if key not in IMPLEMENTATION_TTT and getattr(run.ttt, key) != saved:
            raise ValueError(f"--resume into another layout: ttt.{key}={getattr(run.ttt, key)!r} but {where} has "
                             f"{saved!r}; a move continues the same run: keep ttt.{key}={saved!r}, or begin a new "
                             "data stage with --start-stage-from")
    if run.seed != info.run["seed"]:
        raise ValueError(f"--resume into another layout: seed={run.seed} but {where} has {info.run['seed']} (the seed "
                         f"orders the data); keep seed={info.run['seed']}")
    zero = info.deepspeed.get("zero_optimization", {}).get("stage", 0)
    if zero < 1:
        raise ValueError(f"--resume into another layout: {where} was trained with zero_optimization.stage={zero}; "
                         "a move converts the ZeRO optimizer partitions (DeepSpeed's universal checkpoint), which "
                         "a stage-0 run does not write: continue it in its own layout")


def check_target_zero(ds: dict) -> None:
    """The new layout loads the universal checkpoint through the ZeRO optimizer."""
    zero = ds.get("zero_optimization", {}).get("stage", 0)
    if zero < 1:
        raise ValueError(f"--resume into another layout: zero_optimization.stage={zero} in the DeepSpeed config; "
                         "the universal checkpoint is loaded by the ZeRO optimizer: set zero_optimization.stage=1")


def with_universal_load(ds: dict) -> dict:
    """The DeepSpeed dict for the engine of a move: `checkpoint.load_universal` on (DeepSpeed's switch
    that makes engine.load_checkpoint read a universal checkpoint), the rest as given."""
    return {**ds, "checkpoint": {**ds.get("checkpoint", {}), "load_universal": True}}


def moved_dir(run_dir: pathlib.Path, source: pathlib.Path) -> pathlib.Path:
    return run_dir / (MOVED_PREFIX + source.name)


def check_source_loads_safely(source: pathlib.Path) -> None:
    """Every DeepSpeed file of the source loads with weights_only=True (DeepSpeed's few objects
    allow-listed, safe_loading.py): ds_to_universal itself unpickles them with weights_only=False."""
    allowed = deepspeed_safe_globals()
    for path in sorted(source.glob("*.pt")):
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling error means: not a file this trainer wrote
            raise ValueError(f"{path} does not load with weights_only=True ({type(e).__name__}); a move converts "
                             "only checkpoints this trainer wrote: move from another checkpoint") from e


def link_conversion_input(source: pathlib.Path, view: pathlib.Path) -> list[str]:
    """`view/`: a symlink to every DeepSpeed file of `source` except the pipeline layer files, i.e.
    the mp_rank model-state files and the ZeRO optimizer partitions: all that the universal conversion
    converts. Returns the linked names.

    Why not the layer files: DeepSpeed's `DeepSpeedCheckpoint` (built by ds_to_universal before it
    converts anything) assumes Megatron's layout, layer files 1..-2 being transformer layers spread
    evenly over the stages: `layers_per_pp = (number of layer files - 2) // pp_degree`, then
    `key_index // layers_per_pp`. Our spec list has P + 2 layer files (embed, the P non-adaptive
    layers, the last stage), so a source with P < stages (the largest stage count, P = stages - 1, as
    the main job's 4-stage tiny-mem) divides by zero. The map is never used for a ZeRO-1/2 conversion
    (the stages come from the model-state files' checkpoint_parallel_dimensions, the parameters from
    the optimizer files), and the layer files are carried by spec index instead (convert_for_move).
    Without them, the conversion no longer depends on how the layers are partitioned."""
    view.mkdir(parents=True)
    names = []
    for path in sorted(source.glob("*.pt")):
        if not path.match(LAYER_FILES):
            (view / path.name).symlink_to(path.resolve())
            names.append(path.name)
    return names


def run_ds_to_universal(source: pathlib.Path, out: pathlib.Path) -> str:
    """DeepSpeed's universal conversion of checkpoint `source` into `out` (in this process, no
    worker pool); returns its console output. It reads `source` through `link_conversion_input`'s
    view (out/.conversion-input/, removed afterwards; the source is only read). `inject_missing_state`:
    our engine never writes the optional universal_checkpoint_info (it only tags Megatron-style tensor
    slicing, which we lack). ds_to_universal also writes `latest_universal` beside `out`; that file is
    removed (we load by tag)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    view = out / CONVERSION_INPUT
    link_conversion_input(source, view)
    args = argparse.Namespace(input_folder=str(view), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        ds_to_universal(args)
    shutil.rmtree(view)  # symlinks only: the source files stay
    (out.parent / "latest_universal").unlink(missing_ok=True)
    return buf.getvalue()


def write_anchor(zero_dir: pathlib.Path) -> None:
    """zero/stage_anchor: zeros (its value is never used, its gradient never set), at the AdamW step
    of the other parameters, so any stage of the new layout that needs an anchor finds one."""
    steps = sorted(zero_dir.glob("*/step.pt"))
    if not steps:
        raise FileNotFoundError(f"{zero_dir}: the universal conversion wrote no parameter (no */step.pt)")
    step = torch.load(steps[0], weights_only=True)
    anchor = zero_dir / ANCHOR
    shutil.rmtree(anchor, ignore_errors=True)  # a source with several anchor stages merged theirs
    anchor.mkdir()
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        torch.save({"cat_dim": 0, "param": torch.zeros(1)}, anchor / f"{key}.pt")
    torch.save(step, anchor / "step.pt")


def convert_for_move(move: Move, run_dir: pathlib.Path, *, rank: int, share=lambda verdict: verdict) -> pathlib.Path:
    """Rank 0 writes the converted checkpoint of `move.source` into run_dir/moved-<tag>/ (a temp folder,
    flushed, then renamed); `share(verdict)` hands rank 0's verdict (None or the error) to every rank
    (a broadcast; the identity in one process), so all ranks raise alike. The source is only read."""
    final = moved_dir(run_dir, move.source)
    error = None
    if rank == 0:
        for stale in list(run_dir.glob(TMP_MOVED_PREFIX + "*")) + list(run_dir.glob(MOVED_PREFIX + "*")):
            shutil.rmtree(stale)  # a conversion or a load that was killed: start over from the source
        tmp = run_dir / (TMP_MOVED_PREFIX + move.source.name)
        try:
            check_source_loads_safely(move.source)
            try:
                run_ds_to_universal(move.source, tmp)
            except Exception as e:  # noqa: BLE001 - DeepSpeed raises AssertionError and others: say where
                raise ValueError(f"--resume into another layout: DeepSpeed's universal conversion of {move.source} "
                                 f"failed ({type(e).__name__}: {e}); the source run is unchanged") from e
            write_anchor(tmp / UNIVERSAL_DIR)
            for layer_file in sorted(move.source.glob(LAYER_FILES)):
                shutil.copy2(layer_file, tmp / layer_file.name)
            shutil.copytree(move.source / RNG_DIR, tmp / RNG_DIR)
            for name in (RUN_CONFIG, DATA_IDS, COMPLETE):
                shutil.copy2(move.source / name, tmp / name)
            fsync_tree(tmp)
            os.rename(tmp, final)
            fsync_path(run_dir)
        except (ValueError, FileNotFoundError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = str(e)
    error = share(error)
    if error is not None:
        raise ValueError(error)
    return final


def load_moved(engine, moved: pathlib.Path, move: Move, *, rank: int) -> dict:
    """Load a converted checkpoint into an engine built with `with_universal_load`: every layer of this
    stage from the copied layer files (frozen parameters included), then the universal state
    (optimizer-held weights, AdamW moments, LR schedule, global step, client state), then the RNG of
    old rank rank mod source_world. Returns the client state."""
    use_safe_loading(engine)
    rng = load_rng_state(rng_state_file(moved, rank % move.source_world), rank % move.source_world)
    engine.module.load_state_dir(str(moved), checkpoint_engine=engine.checkpoint_engine, strict=True)
    _, client = engine.load_checkpoint(str(moved.parent), tag=moved.name, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load the converted checkpoint {moved}")
    restore_rng_state(rng)
    return client
