"""The run record: what a run writes about itself beside every checkpoint, and `RunInfo`, which reads it.

    from ds_ttt.train.run_record import RunInfo
    info = RunInfo.read(ckpt_dir)           # a complete checkpoint directory (checkpoint.resolve_checkpoint)
    info.ttt_config(), info.backbone_config(), info.pipeline_layout(), info.manifest_path, info.step
    info.inference_record()                 # what loading for inference reads of it (ds_ttt/loading.py)

Files (inside each checkpoint directory; RUN_DIR/run_config.json holds the latest launch's copy):
    run_config.json   `resolved_config(...)` + the step: format, run, ttt, backbone, resolved DeepSpeed
                      JSON, plan, pipeline layout, manifest path + sha256, model source, data stage, the
                      step the stage began at, earlier stages, batch layout (`data_order`), tokenizer
    data_ids.json     {"stages": [...]}: train/test ids of every data stage so far (overlap checks)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from ds_ttt.train.layout import Layout

RUN_CONFIG = "run_config.json"
DATA_IDS = "data_ids.json"
RUN_FORMAT = "ds_ttt-run-v1"


@dataclass(frozen=True)
class InferenceRecord:
    """What loading a checkpoint for inference (ds_ttt/loading.py) reads of its run record: the fields
    of its provenance and the tokenizer's record, each named (nothing else of the run travels)."""

    checkpoint: pathlib.Path  # the complete checkpoint directory the weights came from
    step: int  # cumulative optimizer steps
    manifest_path: str  # the training manifest (run_config.json's manifest.path)
    manifest_sha256: str  # its sha256 at training: a changed manifest is refused
    model_source: dict[str, Any]  # {"preset": name} or {"model_dir": path}
    tokenizer: dict[str, Any] | None  # run_config.json's "tokenizer" ({"dir", "sha256"}, manifest_tokenizer);
    #                                   None when the trainer wrote none (the manifest's record is used then)
    tokenizer_dir: str  # RunInfo.tokenizer_dir: where the tokenizer is when the record names no folder


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

    def pipeline_layout(self) -> Layout:
        return Layout.from_dict(self.layout)

    def stage_history(self) -> list[dict]:
        """data_ids.json's stages: {data_stage, manifest, sha256, train ids, test ids} of every stage so far."""
        return json.loads((self.checkpoint / DATA_IDS).read_text())["stages"]

    @property
    def tokenizer_dir(self) -> str | None:
        """The model directory when it holds a tokenizer (--model runs), else the manifest's tokenizer
        folder (the tokenizer the training data was rendered with)."""
        model_dir = self.model_source.get("model_dir")
        if model_dir and (pathlib.Path(model_dir) / "tokenizer.json").is_file():
            return model_dir
        return str(pathlib.Path(self.manifest_path).parent / "tokenizer")

    def inference_record(self) -> InferenceRecord:
        """The fields of this record that loading for inference uses (provenance and tokenizer checks)."""
        return InferenceRecord(checkpoint=self.checkpoint, step=self.step, manifest_path=self.manifest_path,
                               manifest_sha256=self.manifest_sha256, model_source=self.model_source,
                               tokenizer=self.raw.get("tokenizer"), tokenizer_dir=self.tokenizer_dir)

    @classmethod
    def read(cls, ckpt: pathlib.Path) -> "RunInfo":
        """Read ckpt/run_config.json; a record that is not JSON, of another format or without a field
        the trainer always writes is refused with the file and the fields named (no field defaults)."""
        path = ckpt / RUN_CONFIG
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}); the trainer writes it atomically with each "
                             "checkpoint, so resume from another checkpoint of the run") from None
        if not isinstance(d, dict) or d.get("format") != RUN_FORMAT:
            raise ValueError(f"{path}: unknown format {d.get('format') if isinstance(d, dict) else d!r} "
                             f"(expected {RUN_FORMAT!r})")
        missing = record_fields_missing(d)
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}; every checkpoint this trainer writes "
                             f"({RUN_FORMAT}) has them, so resume or export from such a checkpoint, or "
                             "start a new run")
        fill_added_fields(d)
        return cls(checkpoint=ckpt, step=d["step"], backbone=d["backbone"], ttt=d["ttt"], run=d["run"],
                   deepspeed=d["deepspeed"], plan=d["plan"], manifest_path=d["manifest"]["path"],
                   manifest_sha256=d["manifest"]["sha256"], model_source=d["model_source"], layout=d["layout"], raw=d)


RECORD_KEYS = ("step", "backbone", "ttt", "run", "deepspeed", "plan", "manifest", "model_source", "layout")


# Fields added to a record format after runs were written with it: a record without one reads as the
# value every run had before the field existed (no run before it could have had another). Any other
# missing field is refused.
FIELDS_ADDED = {"ttt": {"first_order": False}}


def fill_added_fields(d: dict) -> list[str]:
    """Fill FIELDS_ADDED into run_config.json dict `d` in place; returns the dotted names filled."""
    filled = []
    for key, defaults in FIELDS_ADDED.items():
        if isinstance(d.get(key), dict):
            for f, v in defaults.items():
                if f not in d[key]:
                    d[key][f] = v
                    filled.append(f"{key}.{f}")
    return filled


def record_fields_missing(d: dict) -> list[str]:
    """The fields RunInfo needs that run_config.json dict `d` lacks, as dotted names."""
    from ds_ttt.config import TTTConfig
    missing = [k for k in RECORD_KEYS if k not in d]
    nested = {"manifest": ("path", "sha256"), "layout": Layout.RECORD_FIELDS,
              "ttt": tuple(f.name for f in dataclasses.fields(TTTConfig) if f.name not in FIELDS_ADDED["ttt"])}
    for key, fields in nested.items():
        if isinstance(d.get(key), dict):
            missing += [f"{key}.{f}" for f in fields if f not in d[key]]
        elif key in d:
            missing.append(f"{key} (an object)")
    return missing


def manifest_tokenizer(manifest) -> dict:
    """The record of the tokenizer a run trains with: the manifest's tokenizer folder and the sha256 of
    its tokenizer.json (verified when the manifest was loaded)."""
    tok = manifest.data["tokenizer"]
    return {"dir": str((manifest.dir / tok["dir"]).resolve()), "sha256": tok["hash"]}


def resolved_config(*, run, backbone, ds: dict, plan, layout: Layout, manifest_path: str,
                    manifest_sha256: str, data_stage: int = 0, stage_start_step: int = 0,
                    history: list | None = None, data_order: dict | None = None,
                    tokenizer: dict | None = None) -> dict[str, Any]:
    """The JSON saved beside every checkpoint and as RUN_DIR/run_config.json (RunInfo reads it back).

    `tokenizer` ({"dir", "sha256"}, `manifest_tokenizer`): the tokenizer the training data was rendered
    with; evaluation, serving and export load it from there and refuse it if its tokenizer.json no longer
    has that hash."""
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
