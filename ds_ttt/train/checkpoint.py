"""Checkpoints: atomic DeepSpeed save/load with client state, and single-process reassembly.

Layout of RUN_DIR:
    latest                      the tag of the newest *complete* checkpoint (DeepSpeed's format)
    step_00000040/              one DeepSpeed checkpoint (a tag):
        layer_NN-model_states.pt        pipeline layer NN's weights (spec order, see pipeline.py)
        mp_rank_00_model_states.pt      engine state + our client state (data cursor, plan, ...)
        *optim_states.pt                optimizer (ZeRO-1 partitions)
        rng/rank_00000.pt               per-rank RNG states (python, numpy, torch)
        run_config.json                 the resolved config: backbone, ttt, run, deepspeed, plan,
                                        manifest path + sha256, step, model source, layout
        data_ids.json                   train/test ids of every data stage so far (overlap checks)
        COMPLETE                        written last
    metrics.jsonl, run_config.json (the launch's resolved config), wandb/

Atomicity: every rank writes into `.tmp-<tag>/`; after a barrier rank 0 writes COMPLETE, renames the
folder to `<tag>/` (one atomic rename) and then replaces `latest` (write a temp file, os.replace).
A run killed at any point leaves `latest` naming the previous complete checkpoint; leftovers of
`.tmp-*` are removed at the next save.

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
import shutil
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
    if (path / COMPLETE).is_file() and (path / RUN_CONFIG).is_file():
        return path
    if path.is_dir() and path.name.startswith(".tmp-"):
        raise FileNotFoundError(f"{path} is an unfinished checkpoint (the save was interrupted)")
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
                    history: list | None = None) -> dict[str, Any]:
    """The JSON saved beside every checkpoint and as RUN_DIR/run_config.json (RunInfo reads it back)."""
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
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_json_atomic(path: pathlib.Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


def save_checkpoint(engine, run_dir: pathlib.Path, step: int, client_state: dict, resolved: dict,
                    data_ids: dict, *, rank: int, barrier, after_engine_save=None) -> pathlib.Path:
    """Save atomically (see module docstring). `barrier()` synchronises all ranks.

    `after_engine_save` is a test hook called on rank 0 between the DeepSpeed save and the rename.
    """
    run_dir = pathlib.Path(run_dir)
    tag = tag_for(step)
    tmp_tag = f".tmp-{tag}"
    tmp = run_dir / tmp_tag
    if rank == 0:
        for stale in run_dir.glob(".tmp-*"):  # leftovers of a killed save
            shutil.rmtree(stale, ignore_errors=True)
        if (run_dir / tag).exists():  # re-saving the same step (e.g. end after an interval save)
            shutil.rmtree(run_dir / tag)
    barrier()
    engine.save_checkpoint(str(run_dir), tag=tmp_tag, client_state=client_state, save_latest=False)
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    barrier()
    if rank == 0:
        write_json_atomic(tmp / RUN_CONFIG, {**resolved, "step": step})
        write_json_atomic(tmp / DATA_IDS, data_ids)
        if after_engine_save is not None:
            after_engine_save(tmp)
        (tmp / COMPLETE).write_text(tag + "\n")
        os.rename(tmp, run_dir / tag)
        latest_tmp = run_dir / f".{LATEST}.tmp"
        latest_tmp.write_text(tag)
        os.replace(latest_tmp, run_dir / LATEST)
    barrier()
    return run_dir / tag


def load_checkpoint(engine, ckpt: pathlib.Path, *, rank: int, load_optimizer: bool = True,
                    load_scheduler: bool = True) -> dict:
    """Load weights (+ optimizer, scheduler) and this rank's RNG; returns the client state."""
    _, client = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name, load_optimizer_states=load_optimizer,
                                       load_lr_scheduler_states=load_scheduler)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load {ckpt}")
    rng_file = ckpt / "rng" / f"rank_{rank:05d}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client
