"""The training-run config: `RunConfig` (with the TTT settings inside), read from a run-config JSON and
overridden by CLI flags.

One validated home for every non-DeepSpeed setting: a run-config JSON (`--run_config FILE`, e.g.
`ds_configs/run_cpu_tiny.json`) overridden by CLI flags, resolved once at launch, logged, and saved
as `run_config.json` beside every checkpoint. The DeepSpeed JSON stays pure DeepSpeed; the trainer
fills in only what comes from the plan (the scheduler's `total_num_steps` / `warmup_num_steps`).

    {"preset": "tiny", "seed": 0, "save_interval": 50,
     "ttt": {"adaptive_layers": 2, "inner_lr": 0.1, "context_policy": "full", "trainable_scope": "prime"}}

The cross-check against the DeepSpeed JSON is ds_ttt/train/deepspeed_config.py, the pipeline layout
ds_ttt/train/layout.py, the schedule plan ds_ttt/train/schedule.py.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from ds_ttt.config import TTTConfig, reject_unknown_keys

@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Everything about a training run that is not DeepSpeed's.

    data / output: manifest path and RUN_DIR (checkpoints, metrics.jsonl, wandb/).
    preset / model: backbone = a preset name (ds_ttt/model/presets.py) or a local Qwen3 directory.
    max_steps: optimizer steps of this stage; fixes the plan at the first launch (None -> epochs).
    epochs: passes over the train split when max_steps is None.
    stop_at_step: end this launch early (after a checkpoint) at this stage step; the plan is unchanged.
    min_lr_ratio: cosine floor as a fraction of the peak lr (the optimizer's lr in the DeepSpeed JSON).
    bucket: micro-batches are right-padded to a multiple of this many tokens.
    partition: optional non-adaptive decoder layers per non-last stage (default: balanced).
    save_interval: checkpoint every N steps (0: only at the end); log_interval: metrics every N steps.
    """

    data: str
    output: str
    preset: str | None = "tiny"
    model: str | None = None
    max_steps: int | None = None
    epochs: int = 1
    stop_at_step: int | None = None
    seed: int = 0
    min_lr_ratio: float = 0.1
    bucket: int = 64
    partition: list[int] | None = None
    save_interval: int = 0
    log_interval: int = 1
    wandb: bool = False
    wandb_project: str = "ds_ttt"
    ttt: TTTConfig = field(default_factory=TTTConfig)

    def validate(self) -> "RunConfig":
        if (self.preset is None) == (self.model is None):
            raise ValueError("set exactly one of `preset` (e.g. 'tiny') and `model` (a local Qwen3 directory); "
                             f"got preset={self.preset!r}, model={self.model!r}")
        for name in ("max_steps", "stop_at_step"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {v}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1] (cosine floor / peak lr), got {self.min_lr_ratio}")
        if self.bucket < 1:
            raise ValueError(f"bucket must be >= 1 token, got {self.bucket}")
        if self.save_interval < 0 or self.log_interval < 1:
            raise ValueError("save_interval must be >= 0 and log_interval >= 1")
        if self.partition is not None and any(n < 1 for n in self.partition):
            raise ValueError(f"partition {self.partition}: every non-last stage needs >= 1 decoder layer")
        self.ttt.validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["ttt"] = self.ttt.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "run config") -> "RunConfig":
        reject_unknown_keys(cls, data, where)
        data = dict(data)
        data["ttt"] = TTTConfig.from_dict(data.get("ttt", {}), where=f"{where}: ttt")
        return cls(**data)


def load_run_config(path: str | None, overrides: dict[str, Any], ttt_overrides: dict[str, Any],
                    base: dict[str, Any] | None = None) -> RunConfig:
    """base (a resumed checkpoint's run config) < file (optional) < CLI overrides (None values are
    ignored); validated."""
    data: dict[str, Any] = dict(base or {})
    if base is not None:
        data["stop_at_step"] = None  # an early stop of the interrupted launch does not carry over
    if path:
        file_data = json.loads(pathlib.Path(path).read_text())
        if base is not None:
            file_data.pop("ttt", None)  # a resume keeps the checkpoint's TTT settings (overrides via --ttt)
        data.update(file_data)
        if "model" in file_data and file_data["model"] is not None:
            data["preset"] = None
    data.update({k: v for k, v in overrides.items() if v is not None})
    if overrides.get("model") is not None:  # --model replaces the file's preset
        data["preset"] = None
    if overrides.get("preset") is not None:
        data["model"] = None
    ttt = dict(data.get("ttt", {}))
    ttt.update(ttt_overrides)
    data["ttt"] = ttt
    for req in ("data", "output"):
        if data.get(req) is None:
            raise ValueError(f"`{req}` is required (--{req} or the run-config file)")
    return RunConfig.from_dict(data, where=path or "run config").validate()


def parse_ttt_overrides(items: list[str] | None) -> dict[str, Any]:
    """`--ttt key=value` (value parsed as JSON, else kept as a string)."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--ttt expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out
