"""Checkpoints: atomic DeepSpeed save/load with client state, and single-process reassembly.

Layout of RUN_DIR:
    latest                      the tag of the newest *complete* checkpoint (DeepSpeed's format)
    step_00000040/              one DeepSpeed checkpoint (a tag):
        layer_NN-model_states.pt        pipeline layer NN's weights (spec order, see pipeline.py)
        mp_rank_00_model_states.pt      engine state + our client state (data cursor, plan, ...)
        *optim_states.pt                optimizer (ZeRO-1 partitions)
        rng/rank_00000.pt               per-rank RNG states (python, numpy, torch; weights_only-loadable)
        run_config.json                 the resolved config: backbone, ttt, run, deepspeed, plan,
                                        manifest path + sha256, step, model source, layout
        data_ids.json                   train/test ids of every data stage so far (overlap checks)
        COMPLETE                        written last
    metrics.jsonl, run_config.json (the launch's resolved config), wandb/

Atomicity (save_checkpoint): every rank writes into `.tmp-<tag>/`; after a barrier rank 0 writes the
metadata and COMPLETE, fsyncs the folder, renames it to a name no directory has yet (`<tag>/`, or
`<tag>-resaveK/` when a resume re-saves a step that exists), switches `latest` (temp file, fsync,
os.replace) and only then removes the checkpoint it replaces. `latest` names a complete checkpoint at
every instant; a killed save leaves at most a `.tmp-*` folder or a superseded same-step folder, both
removed by the next save (tests: kills at every phase, tests/unit/test_train_checkpoint.py).

Loading is weights_only=True throughout: RNG states are stored as tensors/lists/numbers, and
DeepSpeed's own loader is switched to weights_only=True with its few objects allow-listed
(use_safe_loading).

For other tools (no deepspeed.initialize needed):
    from ds_ttt.train.checkpoint import resolve_checkpoint, load_model_from_checkpoint
    model, info = load_model_from_checkpoint("runs/main/run")      # RUN_DIR or a checkpoint dir
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import random
import re
import shutil
import signal
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ds_ttt.train.layout import Layout

LATEST = "latest"
COMPLETE = "COMPLETE"
RUN_CONFIG = "run_config.json"
DATA_IDS = "data_ids.json"
RUN_FORMAT = "ds_ttt-run-v1"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


# ---------------------------------------------------------------------------------------------
# Resolution + single-process loading (used by evals/export)
# ---------------------------------------------------------------------------------------------
def resolve_checkpoint(path: str | os.PathLike) -> pathlib.Path:
    """RUN_DIR -> its latest complete checkpoint; a checkpoint directory -> itself (checked complete)."""
    path = pathlib.Path(path)
    if (path / LATEST).is_file():
        tag = (path / LATEST).read_text().strip()
        ckpt = path / tag
        if not (ckpt / COMPLETE).is_file():
            raise FileNotFoundError(f"{path / LATEST} names {tag!r}, but {ckpt} is not a complete checkpoint")
        return ckpt
    if path.is_dir() and path.name.startswith(".tmp-"):  # even with COMPLETE: not renamed, not named by latest
        raise FileNotFoundError(f"{path} is an unfinished checkpoint (the save was interrupted)")
    if (path / COMPLETE).is_file() and (path / RUN_CONFIG).is_file():
        return path
    raise FileNotFoundError(f"{path}: neither a RUN_DIR with a '{LATEST}' file nor a complete checkpoint directory "
                            f"(one with {COMPLETE} and {RUN_CONFIG}); has the run saved a checkpoint yet?")


@dataclass
class RunInfo:
    """What a checkpoint says about its run (from run_config.json)."""

    checkpoint: pathlib.Path
    step: int  # cumulative optimizer steps
    backbone: dict[str, Any]  # Qwen3Config.to_dict()
    ttt: dict[str, Any]  # TTTConfig.to_dict()
    run: dict[str, Any]  # RunConfig.to_dict()
    deepspeed: dict[str, Any]
    plan: dict[str, Any]
    manifest_path: str
    manifest_sha256: str
    model_source: dict[str, Any]  # {"preset": name} or {"model_dir": path}
    layout: dict[str, Any]
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    def backbone_config(self):
        from transformers import Qwen3Config
        return Qwen3Config.from_dict(self.backbone)

    def ttt_config(self):
        from ds_ttt.config import TTTConfig
        return TTTConfig.from_dict(self.ttt)

    @property
    def tokenizer_dir(self) -> str | None:
        """The model directory when it holds a tokenizer (--model runs), else the manifest's tokenizer
        folder (the tokenizer the training data was rendered with)."""
        model_dir = self.model_source.get("model_dir")
        if model_dir and (pathlib.Path(model_dir) / "tokenizer.json").is_file():
            return model_dir
        return str(pathlib.Path(self.manifest_path).parent / "tokenizer")

    @classmethod
    def read(cls, ckpt: pathlib.Path) -> "RunInfo":
        d = json.loads((ckpt / RUN_CONFIG).read_text())
        if d.get("format") != RUN_FORMAT:
            raise ValueError(f"{ckpt / RUN_CONFIG}: unknown format {d.get('format')!r}")
        return cls(checkpoint=ckpt, step=d["step"], backbone=d["backbone"], ttt=d["ttt"], run=d["run"],
                   deepspeed=d["deepspeed"], plan=d["plan"], manifest_path=d["manifest"]["path"],
                   manifest_sha256=d["manifest"]["sha256"], model_source=d["model_source"], layout=d["layout"], raw=d)


def layout_from_info(info: RunInfo) -> Layout:
    return Layout.from_dict(info.layout)


def resolved_config(*, run, backbone, ds: dict, plan, layout: Layout, manifest_path: str,
                    manifest_sha256: str, data_stage: int = 0, stage_start_step: int = 0,
                    history: list | None = None, data_order: dict | None = None,
                    tokenizer: dict | None = None) -> dict[str, Any]:
    """The JSON saved beside every checkpoint and as RUN_DIR/run_config.json (RunInfo reads it back).

    `tokenizer` ({"dir", "sha256"}): the tokenizer the training data was rendered with; evaluation,
    serving and export load it from there and refuse it if its tokenizer.json no longer has that hash."""
    return {
        "format": RUN_FORMAT,
        "run": run.to_dict(),
        "ttt": run.ttt.to_dict(),
        "backbone": backbone.to_dict(),
        "deepspeed": ds,
        "plan": plan.to_dict() if plan else None,
        "layout": layout.to_dict(),
        "manifest": {"path": str(pathlib.Path(manifest_path).resolve()), "sha256": manifest_sha256},
        "model_source": {"model_dir": str(pathlib.Path(run.model).resolve())} if run.model else {"preset": run.preset},
        "data_stage": data_stage,
        "stage_start_step": stage_start_step,
        "history": history or [],
        "data_order": data_order,  # train/micro batch, gradient accumulation, dp size: resume checks them
        "tokenizer": tokenizer,
        "step": 0,
    }


LEGACY_ANCHOR = "stage_anchor"  # checkpoints written before anchors left the layers hold one per frozen stage


def load_model_from_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Reassemble a pipeline checkpoint into one `TTTQwen3ForCausalLM` (eval mode) + its RunInfo.

    Tied embeddings: the embedding (layer 0) and the last stage's `lm_head.weight` (one Parameter,
    kept equal by DeepSpeed's tied-gradient all-reduce) must hold the same values; the model gets one
    shared matrix."""
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    ckpt = resolve_checkpoint(path)
    info = RunInfo.read(ckpt)
    layout = layout_from_info(info)
    with torch.device("meta"):
        model = TTTQwen3ForCausalLM(info.backbone_config(), info.ttt_config())
    state: dict[str, torch.Tensor] = {}
    for spec_idx in range(layout.last_spec + 1):  # the tied head reference (if any) saves no file
        files = sorted(glob.glob(str(ckpt / f"layer_{spec_idx:02d}-*model_states.pt")))
        if not files:
            raise FileNotFoundError(f"{ckpt}: no weights for pipeline layer {spec_idx} (layer_{spec_idx:02d}-*)")
        for local, tensor in torch.load(files[0], map_location="cpu", weights_only=True).items():
            if local != LEGACY_ANCHOR and not local.endswith(".inv_freq"):
                state[layout.hf_name(spec_idx, local)] = tensor
    expected = set(model.state_dict())  # a tied model lists both names
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise KeyError(f"{ckpt}: checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if model.config.tie_word_embeddings:
        embed, head = state["model.embed_tokens.weight"], state.pop("lm_head.weight")
        if not torch.equal(embed, head):
            raise ValueError(f"{ckpt}: tied embeddings, but layer_00's embed_tokens.weight differs from the last "
                             "stage's lm_head.weight (the tied gradients were not reduced): the checkpoint is corrupt")
    model.load_state_dict(state, assign=True, strict=not model.config.tie_word_embeddings)
    if model.config.tie_word_embeddings:
        model.tie_weights()  # assign=True replaced the Parameter: share it again
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)  # rebuild the RoPE buffer off meta
    model.to(device).eval()
    return model, info


# ---------------------------------------------------------------------------------------------
# Saving / loading with the engine (called on every rank)
# ---------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, lists and numbers only (loadable with weights_only=True)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_rng_file(path: pathlib.Path, rank: int) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: rank {rank}'s RNG state is missing from checkpoint {path.parent.parent} "
                                "(the checkpoint is incomplete or was written by a different number of ranks); "
                                "resume with the world size it was saved with, or from another checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path}: rank {rank}'s RNG state does not load with weights_only=True ({type(e).__name__}); "
                         "it was written by an older ds_ttt that pickled numpy state: resume from a newer "
                         "checkpoint") from e


def fsync_path(path: pathlib.Path) -> None:
    """Flush a file's or a directory's entry to disk (a rename is durable only after its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: pathlib.Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fsync_path(pathlib.Path(dirpath) / name)
        fsync_path(pathlib.Path(dirpath))


def write_json_atomic(path: pathlib.Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str))


def write_text_atomic(path: pathlib.Path, text: str) -> None:
    """temp file + fsync + os.replace + fsync of the directory: readers see the old or the new text."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


# Phases of a save at which a fault-injection test may kill the run (rank 0, in this order):
#   engine_saved  every rank wrote its DeepSpeed files and RNG into .tmp-<tag>/ (nothing final yet)
#   complete      run_config.json, data_ids.json and COMPLETE written and flushed inside .tmp-<tag>/
#   renamed       .tmp-<tag>/ renamed to its final, new name; `latest` still names the previous checkpoint
#   latest        `latest` switched to the new checkpoint; the one it replaces (same step) not yet removed
SAVE_PHASES = ("engine_saved", "complete", "renamed", "latest")
KILL_ENV = "DS_TTT_KILL_AT_SAVE"  # "<phase>" or "<phase>@<step>": SIGKILL the launch there (tests only)
RESAVE = "-resave"


def kill_launch() -> None:
    """SIGKILL this node's whole launch at once, as a crash would: the process groups of every rank
    (the children of this rank's launcher; torchrun starts each in its own session) and of the
    launcher, this process last. Linux only (reads /proc). Without a launcher (no LOCAL_RANK) only
    this process dies: its parent and group are not ours to kill."""
    parent, me = os.getppid(), os.getpid()
    if "LOCAL_RANK" not in os.environ:
        os.kill(me, signal.SIGKILL)
    ranks = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:  # field 4: the parent pid
                ranks.append(int(entry))
    groups = []
    for pid in ranks + [parent]:
        try:
            groups.append(os.getpgid(pid))
        except ProcessLookupError:
            pass
    own = os.getpgrp()
    for group in dict.fromkeys(groups):
        if group != own:
            os.killpg(group, signal.SIGKILL)
    os.killpg(own, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def kill_point_from_env(step: int):
    """The fault-injection hook named by DS_TTT_KILL_AT_SAVE, or None. Used by tests/e2e/test_pipeline_train.py
    to SIGKILL a real launch (every rank and the launcher at once) at one phase."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return None
    phase, _, at = spec.partition("@")
    if phase not in SAVE_PHASES:
        raise ValueError(f"{KILL_ENV}={spec!r}: unknown phase {phase!r}; one of {', '.join(SAVE_PHASES)}")
    if at and int(at) != step:
        return None

    def kill(now: str, path: pathlib.Path) -> None:
        if now == phase:
            kill_launch()
    return kill


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory name (`step_00000004` or a re-save `step_00000004-resave1`)."""
    m = re.fullmatch(r"step_(\d{8})(?:" + RESAVE + r"\d+)?", name)
    return int(m.group(1)) if m else None


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
    for stale in run_dir.glob(".tmp-*"):
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

    Every rank writes into `.tmp-<tag>/`; rank 0 then writes the metadata and COMPLETE, flushes the
    folder, renames it to a name no directory has (the tag, or tag-resaveK when the step exists, as on
    a resume that re-saves the step `latest` names), switches `latest` atomically, and only then
    removes the checkpoint of the same step it replaces. `latest` names a complete checkpoint at every
    instant. `on_phase(phase, path)` (rank 0, at each of SAVE_PHASES) is a fault-injection hook; by
    default DS_TTT_KILL_AT_SAVE selects one."""
    run_dir = pathlib.Path(run_dir)
    tag = tag_for(step)
    tmp_tag = f".tmp-{tag}"
    tmp = run_dir / tmp_tag
    on_phase = on_phase or kill_point_from_env(step) or (lambda phase, path: None)
    if rank == 0:
        remove_superseded(run_dir)  # the previous save may have been killed before its cleanup
    barrier()
    engine.save_checkpoint(str(run_dir), tag=tmp_tag, client_state=client_state, save_latest=False)
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    rng_file = tmp / "rng" / f"rank_{rank:05d}.pt"
    torch.save(rng_state(), rng_file)
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


def deepspeed_safe_globals() -> list:
    """The DeepSpeed objects inside its checkpoint files, besides tensors and containers (read off the
    pickles' globals of a ZeRO-1 pipeline checkpoint, DeepSpeed 0.19.8): the ZeRO optimizer's loss
    scaler, its stage enum and its parameter-fragment addresses."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def use_safe_loading(engine) -> None:
    """Make `engine.load_checkpoint` load every file with weights_only=True.

    DeepSpeed 0.19.8's TorchCheckpointEngine.load calls torch.load(..., weights_only=False) for every
    file of `engine.load_checkpoint` (model states, pipeline layer files, ZeRO optimizer partitions).
    This swaps in a subclass whose load is torch.load(weights_only=True) with only
    deepspeed_safe_globals() allow-listed: a file holding any other object fails to load."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise ValueError(f"the DeepSpeed config selects the checkpoint engine {type(engine.checkpoint_engine).__name__}; "
                         "ds_ttt loads checkpoints only through the torch engine with weights_only=True: remove "
                         "the checkpoint-engine setting (nebula / fast / decoupled) from the DeepSpeed config")
    allowed = deepspeed_safe_globals()

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)

    engine.checkpoint_engine = SafeTorchCheckpointEngine(engine._config)


def load_checkpoint(engine, ckpt: pathlib.Path, *, rank: int, load_optimizer: bool = True,
                    load_scheduler: bool = True) -> dict:
    """Load weights (+ optimizer, scheduler) and this rank's RNG (weights_only=True throughout);
    returns the client state."""
    use_safe_loading(engine)
    rng = load_rng_file(ckpt / "rng" / f"rank_{rank:05d}.pt", rank)  # before DeepSpeed: fail fast
    _, client = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name, load_optimizer_states=load_optimizer,
                                       load_lr_scheduler_states=load_scheduler)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load {ckpt}")
    set_rng_state(rng)
    return client
