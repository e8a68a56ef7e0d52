"""Cross-check of the DeepSpeed JSON against the run config and the backbone, at startup.

    from ds_ttt.train.deepspeed_config import validate_deepspeed, batch_sizes
    layout = validate_deepspeed(run, ds, world_size, num_hidden_layers)

`validate_deepspeed` raises `ValueError` naming the key and the fix for: batch arithmetic (train =
micro x accumulation x dp), unknown `pipeline` keys (DeepSpeed merges that block unchecked), pipeline
stages vs layers (and the optional explicit partition: ds_ttt/train/layout.py), ZeRO stage > 1, fp16,
dtype vs attention backend, clipping without ZeRO (DeepSpeed 0.19.8 bug), optimizer and scheduler
(the trainer fills the scheduler's step counts from the plan: ds_ttt/train/schedule.py).
"""

from __future__ import annotations

from ds_ttt.train.layout import Layout, resolve_layout
from ds_ttt.train.run_config import RunConfig
from ds_ttt.train.schedule import SCHEDULER

PIPELINE_KEYS = {"stages", "activation_checkpoint_interval", "use_reentrant", "pipe_partitioned", "grad_partitioned"}


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


def validate_deepspeed(run: RunConfig, ds: dict, world_size: int, num_hidden_layers: int, *,
                       tied_embeddings: bool = False) -> Layout:
    """Cross-check the DeepSpeed JSON with the run config and the backbone; returns the layout
    (`tied_embeddings` = the backbone's tie_word_embeddings; TTTPipelineModule checks they agree)."""
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
        raise ValueError("ttt.trainable_scope='prime' with ttt.adaptive_layers=0 trains nothing; use 'all' for "
                         "the SFT baseline (the whole backbone; 'suffix' would train only the final norm and LM head)")
    return resolve_layout(stages, num_hidden_layers, run.ttt, run.partition, tied_embeddings=tied_embeddings)
