"""The training-run config (`RunConfig`, with the TTT settings inside) and its cross-check against the
DeepSpeed JSON.

One validated home for every non-DeepSpeed setting: a run-config JSON (`--run_config FILE`, e.g.
`ds_configs/run_cpu_tiny.json`) overridden by CLI flags, resolved once at launch, logged, and saved
as `run_config.json` beside every checkpoint. The DeepSpeed JSON stays pure DeepSpeed; the trainer
fills in only what comes from the plan (the scheduler's `total_num_steps` / `warmup_num_steps`).

    {"preset": "tiny", "seed": 0, "save_interval": 50,
     "ttt": {"adaptive_layers": 2, "inner_lr": 0.1, "context_policy": "full", "trainable_scope": "prime"}}

`validate_deepspeed(run, ds, world_size, num_hidden_layers)` raises `ValueError` naming the key and
the fix for: batch arithmetic (train = micro x accumulation x dp), pipeline stages vs layers (and the
optional explicit partition), adaptive layers on the last stage, ZeRO stage > 1, dtype vs attention
backend, clipping without ZeRO (DeepSpeed 0.19.8 bug), optimizer and scheduler (the plan).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

from ds_ttt.config import TTTConfig, reject_unknown_keys

PIPELINE_KEYS = {"stages", "activation_checkpoint_interval", "use_reentrant", "pipe_partitioned", "grad_partitioned"}
SCHEDULER = "WarmupCosineLR"
WARMUP_FRACTION = 0.1


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


# ---------------------------------------------------------------------------------------------
# Pipeline layout
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Which decoder layers go where: non-last stages hold `prefix_per_stage[s]` non-adaptive layers
    (stage 0 also embeds); the last stage holds every adaptive layer + final norm + LM head + losses."""

    num_stages: int
    num_layers: int
    num_adaptive: int
    prefix_per_stage: tuple[int, ...]

    @property
    def first_adaptive(self) -> int:
        return self.num_layers - self.num_adaptive

    def spec_parts(self) -> list[int]:
        """DeepSpeed `parts` over the spec list [embed, prefix_0.., last]: stage s owns parts[s]:parts[s+1]."""
        if self.num_stages == 1:
            return [0, self.first_adaptive + 2]
        parts, n = [0], 1  # the embed spec sits on stage 0
        for k in self.prefix_per_stage:
            n += k
            parts.append(n)
        parts.append(n + 1)
        return parts


def resolve_layout(num_stages: int, num_layers: int, ttt: TTTConfig, partition: list[int] | None = None) -> Layout:
    num_adaptive = ttt.num_adaptive(num_layers)
    num_prefix = num_layers - num_adaptive
    if num_stages == 1:
        return Layout(1, num_layers, num_adaptive, ())
    if num_prefix < num_stages - 1:
        raise ValueError(
            f"pipeline.stages={num_stages} needs at least {num_stages - 1} non-adaptive decoder layers for stages "
            f"0..{num_stages - 2} (the last stage holds exactly the adaptive layers), but the model has "
            f"{num_layers} layers of which {num_adaptive} are adaptive (ttt.adaptive_layers); lower "
            f"pipeline.stages or ttt.adaptive_layers")
    if partition is None:
        base, extra = divmod(num_prefix, num_stages - 1)
        per = tuple(base + (1 if s < extra else 0) for s in range(num_stages - 1))
    else:
        per = tuple(partition)
        if len(per) != num_stages - 1:
            raise ValueError(f"partition has {len(per)} entries; pipeline.stages={num_stages} needs "
                             f"{num_stages - 1} (non-adaptive layers per non-last stage)")
        if sum(per) != num_prefix:
            where = "put adaptive layers on a non-last stage" if sum(per) > num_prefix else \
                "leave non-adaptive layers on the last stage"
            raise ValueError(
                f"partition {list(per)} sums to {sum(per)} but the model has {num_prefix} non-adaptive layers "
                f"(layers 0..{num_prefix - 1}); it would {where}. Every adaptive layer must sit on the last "
                f"stage: make partition sum to {num_prefix}")
    return Layout(num_stages, num_layers, num_adaptive, per)


# ---------------------------------------------------------------------------------------------
# DeepSpeed JSON cross-check
# ---------------------------------------------------------------------------------------------
def ds_dtype(ds: dict) -> str:
    if ds.get("fp16", {}).get("enabled", False):
        return "fp16"
    return "bf16" if ds.get("bf16", {}).get("enabled", False) else "fp32"


def batch_sizes(ds: dict, dp: int) -> tuple[int, int, int]:
    """(train_batch_size, micro, gas) after the arithmetic check."""
    micro = ds.get("train_micro_batch_size_per_gpu")
    train = ds.get("train_batch_size")
    gas = ds.get("gradient_accumulation_steps")
    if micro is None or train is None:
        raise ValueError("the DeepSpeed config must set train_batch_size and train_micro_batch_size_per_gpu "
                         "(gradient_accumulation_steps is derived when absent)")
    if gas is None:
        if train % (micro * dp):
            raise ValueError(f"train_batch_size={train} is not divisible by train_micro_batch_size_per_gpu={micro} "
                             f"x data-parallel size {dp}; set train_batch_size to a multiple of {micro * dp}")
        gas = train // (micro * dp)
    if train != micro * gas * dp:
        raise ValueError(
            f"train_batch_size={train} != train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={gas} "
            f"x data-parallel size {dp} (= world size / pipeline.stages) = {micro * gas * dp}; "
            f"set train_batch_size to {micro * gas * dp} or adjust the other two")
    return train, micro, gas


def validate_deepspeed(run: RunConfig, ds: dict, world_size: int, num_hidden_layers: int) -> Layout:
    """Cross-check the DeepSpeed JSON with the run config and the backbone; returns the layout."""
    pipe = ds.get("pipeline")
    if not isinstance(pipe, dict) or not isinstance(pipe.get("stages"), int) or isinstance(pipe.get("stages"), bool):
        raise ValueError('the DeepSpeed config needs "pipeline": {"stages": N} with an integer N (4 by default)')
    unknown = sorted(set(pipe) - PIPELINE_KEYS)
    if unknown:  # DeepSpeed merges this block unchecked: a typo would be silently ignored
        raise ValueError(f"pipeline: unknown key(s) {unknown}; allowed keys are {sorted(PIPELINE_KEYS)} "
                         "(the partition lives in the run config: `partition`)")
    stages = pipe["stages"]
    if stages < 1 or world_size % stages:
        raise ValueError(f"pipeline.stages={stages} must be >= 1 and divide the world size {world_size} "
                         f"(launch with a multiple of {stages} ranks, e.g. --num_gpus {stages})")
    if pipe.get("use_reentrant", True) and pipe.get("activation_checkpoint_interval", 0) > 0:
        raise ValueError("pipeline.activation_checkpoint_interval > 0 needs pipeline.use_reentrant=false "
                         "(reentrant checkpointing breaks on frozen stages and inside the inner loop)")
    dp = world_size // stages
    batch_sizes(ds, dp)
    zero = ds.get("zero_optimization", {}).get("stage", 0)
    if zero > 1:
        raise ValueError(f"zero_optimization.stage={zero}: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 "
                         "only; set zero_optimization.stage to 1")
    dtype = ds_dtype(ds)
    if dtype == "fp16":
        raise ValueError("fp16.enabled: fp16 is not supported (the second-order inner loop overflows); "
                         "use bf16.enabled=true on GPU or fp32")
    backend = run.ttt.attention_backend
    if dtype == "bf16" and backend == "cpu":
        raise ValueError("bf16.enabled=true with ttt.attention_backend='cpu': the FlashBoB CPU kernels are "
                         "float32/float64 only; use attention_backend 'cuda' (GPU), 'auto' or 'reference', "
                         "or disable bf16")
    if dtype == "fp32" and backend == "cuda":
        raise ValueError("ttt.attention_backend='cuda' needs bf16 (the CUDA kernels are bf16/fp16); set "
                         "bf16.enabled=true or use attention_backend 'auto'/'reference'")
    clip = ds.get("gradient_clipping", 1.0)  # DeepSpeed's default is 1.0
    if clip and clip > 0 and zero == 0 and dtype == "fp32" and stages > 1:
        raise ValueError(
            f"gradient_clipping={clip} with zero_optimization.stage=0 in an fp32 pipeline: DeepSpeed 0.19.8 "
            "computes the clip norm from stage 0's gradients only (every gradient scaled wrongly); set "
            "zero_optimization.stage=1 or gradient_clipping=0")
    opt = ds.get("optimizer", {})
    if opt.get("type", "").lower() != "adamw":
        raise ValueError(f'optimizer.type={opt.get("type")!r}: the outer optimizer is AdamW; set "type": "AdamW"')
    sched = ds.get("scheduler", {})
    if sched.get("type") != SCHEDULER:
        raise ValueError(f"scheduler.type={sched.get('type')!r}: set scheduler.type to {SCHEDULER!r} "
                         "(warmup from 0 over 10% of the plan, cosine to the floor at its last step)")
    params = sched.get("params", {})
    if params.get("warmup_min_ratio", 0.0) != 0.0 or params.get("warmup_type", "linear") != "linear":
        raise ValueError("scheduler.params: warmup starts at 0 and is linear; set warmup_min_ratio=0 and "
                         "warmup_type='linear' (or remove them)")
    if "cos_min_ratio" in params:
        raise ValueError("scheduler.params.cos_min_ratio: the floor comes from the run config's min_lr_ratio; "
                         "remove it from the DeepSpeed config")
    for key in ("total_num_steps", "warmup_num_steps"):
        if key in params:
            raise ValueError(f"scheduler.params.{key}: the trainer fills it from the plan fixed at the first launch "
                             "(--max_steps or epochs); remove it from the DeepSpeed config")
    run.ttt.validate(num_hidden_layers)
    if run.ttt.num_adaptive(num_hidden_layers) == 0 and run.ttt.trainable_scope == "prime":
        raise ValueError("ttt.trainable_scope='prime' with ttt.adaptive_layers=0 trains nothing; use 'suffix' "
                         "or 'all' for the SFT baseline")
    return resolve_layout(stages, num_hidden_layers, run.ttt, run.partition)


@dataclass(frozen=True)
class Plan:
    """The schedule plan, fixed at the first launch of a stage and saved in every checkpoint."""

    planned_steps: int
    warmup_steps: int
    steps_per_epoch: int
    num_train: int
    retained_rounds: int
    train_batch_size: int
    min_lr_ratio: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_plan(run: RunConfig, num_train: int, retained_rounds: int, train_batch_size: int) -> Plan:
    steps_per_epoch = num_train // train_batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"the train split has {num_train} trajectories, fewer than train_batch_size="
                         f"{train_batch_size}: lower train_batch_size or add data")
    planned = run.max_steps if run.max_steps is not None else run.epochs * steps_per_epoch
    warmup = max(2, math.ceil(WARMUP_FRACTION * planned))  # DeepSpeed's WarmupCosineLR warms up >= 2 steps
    if planned < 3:
        raise ValueError(f"the plan has {planned} step(s); warmup (>= 2 steps) + cosine needs at least 3: "
                         "raise --max_steps or epochs")
    return Plan(planned, warmup, steps_per_epoch, num_train, retained_rounds, train_batch_size, run.min_lr_ratio)


def resolved_deepspeed(ds: dict, plan: Plan) -> dict:
    """The DeepSpeed dict the engine gets: the scheduler's step counts filled from the plan."""
    ds = json.loads(json.dumps(ds))
    params = ds["scheduler"].setdefault("params", {})
    # The engine steps the scheduler once at the start of a stage (schedule.start_schedule), so optimizer
    # step s (1-based) runs at ratio(s - 1): step 1 at 0, step warmup+1 at the peak, step `planned` at
    # the floor (WarmupCosineLR's progress (s - warmup) / (total - warmup) reaches 1 there).
    params.update(total_num_steps=plan.planned_steps, warmup_num_steps=plan.warmup_steps,
                  warmup_min_ratio=0.0, warmup_type="linear", cos_min_ratio=plan.min_lr_ratio)
    return ds


def resolved_config(*, run: RunConfig, backbone, ds: dict, plan: Plan | None, layout: Layout, manifest_path: str,
                    manifest_sha256: str, data_stage: int = 0, stage_start_step: int = 0,
                    history: list | None = None) -> dict[str, Any]:
    """The JSON saved beside every checkpoint (checkpoint.RunInfo reads it back)."""
    from ds_ttt.train.checkpoint import RUN_FORMAT

    return {
        "format": RUN_FORMAT,
        "run": run.to_dict(),
        "ttt": run.ttt.to_dict(),
        "backbone": backbone.to_dict(),
        "deepspeed": ds,
        "plan": plan.to_dict() if plan else None,
        "layout": {"num_stages": layout.num_stages, "num_layers": layout.num_layers,
                   "num_adaptive": layout.num_adaptive, "prefix_per_stage": list(layout.prefix_per_stage),
                   "spec_parts": layout.spec_parts()},
        "manifest": {"path": str(pathlib.Path(manifest_path).resolve()), "sha256": manifest_sha256},
        "model_source": {"model_dir": str(pathlib.Path(run.model).resolve())} if run.model else {"preset": run.preset},
        "data_stage": data_stage,
        "stage_start_step": stage_start_step,
        "history": history or [],
        "step": 0,
    }
