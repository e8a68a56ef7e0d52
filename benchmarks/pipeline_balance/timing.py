"""Stage probes: one layout's stages built the way the pipeline builds them, all in this process, fed
the inputs they really receive and timed (pipeline_balance's `stages` table).

    stages = [build_stage(config, ttt, layout, s, dtype=torch.float32, device="cpu") for s in range(4)]
    times = time_stages({"PP4xDP1": stages}, layout_inputs(...), repeats, "cpu")

Run through `.venv/bin/python benchmarks/pipeline_balance` (the package docstring). Shape letters:
B batch, T tokens, C hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import socket
import statistics
import time
from dataclasses import dataclass

LAYOUTS = ((4, 1), (2, 2), (1, 4))  # (pipeline stages, data-parallel replicas) on 4 devices


def init_single_process_group() -> None:
    """A world of one gloo rank, so DeepSpeed's PipelineModule can be built here (no collectives run)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        os.environ[key] = value
    if not torch.cuda.is_available():  # as launch/train.py: no /dev/shm all-reduce buffers on CPU
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def build_stage(config, ttt, layout, stage: int, *, dtype, device: str, seed: int = 0,
                activation_checkpoint_interval: int = 1):
    """Stage `stage` of `layout`: the real TTTPipelineModule with its explicit partition, on one rank.

    The only difference from a pipeline rank is which stage's specs get built (chosen here instead of
    from the rank's coordinate). Then what DeepSpeed's engine does to it: non-reentrant checkpointing
    (`use_reentrant: false`), parameters (not buffers) cast to the training dtype, moved to the device.
    """
    import torch
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from ds_ttt.train.pipeline import TTTPipelineModule

    class StageModule(TTTPipelineModule):
        def _partition_layers(self, method="explicit"):
            self.parts = self.layout.spec_parts()
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    torch.manual_seed(seed)
    # Built where it runs: a Qwen3-8B stage initialised on the CPU first takes minutes (fp32 random init of
    # ~2.4B parameters per stage), on the GPU seconds.
    with torch.device(device), contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints topology, seeds
        module = StageModule(config, ttt, layout, seed=seed,
                             activation_checkpoint_interval=activation_checkpoint_interval,
                             topology=PipeDataParallelTopology(num_pp=1, num_dp=1))
    module.probe_ttt = ttt
    module.activation_checkpoint_func = ds_checkpointing.non_reentrant_checkpoint
    if module.activation_checkpoint_interval > 0:
        module._precompute_checkpointable_values()
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    module.to(device)
    module.train()
    return module


def stage_params(module) -> dict:
    """Parameter counts and bytes of one stage (the anchor counts as trainable)."""
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    return {"params": sum(p.numel() for p in params), "weight_bytes": sum(p.numel() * p.element_size() for p in params),
            "trainable_params": sum(p.numel() for p in trainable),
            "grad_bytes": sum(p.numel() * p.element_size() for p in trainable)}


@dataclass
class MicroBatch:
    """One micro-batch as stage 0 loads it, plus the hidden states every later stage receives."""

    ids_BT: object
    kinds_BT: object
    rounds_BT: object
    num_tokens: int  # non-pad tokens (what the trainer's tokens/s counts)
    received: dict  # stage -> hidden_BTC entering it (detached)


def stage_inputs(mb: MicroBatch, stage: int):
    """What DeepSpeed hands stage `stage`'s forward: stage 0 the loaded integer tensors; later stages the
    received tuple, whose float tensor requires grad (engine._exec_recv_activations)."""
    if stage == 0:
        return (mb.ids_BT.clone(), mb.kinds_BT.clone(), mb.rounds_BT.clone())
    hidden = mb.received[stage].clone().detach()
    hidden.requires_grad_(hidden.is_floating_point())  # a grad-free boundary arrives as integers
    return (hidden, mb.ids_BT.clone(), mb.kinds_BT.clone(), mb.rounds_BT.clone())


def chain_inputs(stages: list, mb: MicroBatch) -> None:
    """Fill mb.received by running the stages' forwards once without grad (real values, not noise)."""
    import torch

    with torch.no_grad():
        x = stage_inputs(mb, 0)
        for s, module in enumerate(stages[:-1]):
            x = module(x)
            mb.received[s + 1] = x[0].detach()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def set_step_objective(module, mb: MicroBatch) -> None:
    """What the trainer does before each optimizer step on the last stage: the token-weighted objective's
    normalisers (ds_ttt/train/objective.py), here for a step of this one micro-batch."""
    from ds_ttt.train.objective import StepObjective

    last = module.last_stage_layer()
    last.set_objective(StepObjective.for_step([(mb.ids_BT, mb.kinds_BT, mb.rounds_BT)], module.probe_ttt,
                                              loss_scale=1.0))


def run_stage(module, stage: int, is_last: bool, mb: MicroBatch, device: str, *, grad_seed: int = 0) -> tuple:
    """One forward and one backward exactly as the engine runs them; returns (fwd_s, bwd_s, ran_backward)."""
    import torch

    if is_last:
        set_step_objective(module, mb)
    inputs = stage_inputs(mb, stage)
    _sync(device)
    t0 = time.perf_counter()
    out = module(inputs)
    if is_last:
        loss = module.loss_fn(out, None)
    _sync(device)
    t1 = time.perf_counter()
    ran_backward = True
    if is_last:
        loss.backward()
    else:
        floats = [t for t in out if t.is_floating_point()]
        if floats and all(t.requires_grad for t in floats):  # the engine backpropagates the received gradients
            g = torch.Generator(device=floats[0].device).manual_seed(grad_seed)
            for i, t in enumerate(floats):
                t.backward(gradient=torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype) * 1e-3,
                           retain_graph=i < len(floats) - 1)
        else:  # nothing to backpropagate into (a forward-only stage)
            ran_backward = False
    _sync(device)
    t2 = time.perf_counter()
    for p in module.parameters():
        p.grad = None
    return t1 - t0, t2 - t1, ran_backward


def synthetic_micro_batch(config, num_tokens: int, *, device: str, seed: int = 0, prompt: int | None = None,
                          action: int | None = None, observation: int | None = None) -> MicroBatch:
    """One trajectory of exactly `num_tokens` tokens with the structure of the GPU check's last-stage
    benchmark (ds_ttt.data.synthetic's default round): a prompt, then rounds of (2 header, action, 1,
    observation, 1) tokens, the last round cut at T. Defaults scale with the length (prompt T/16,
    action T/32, observation 3T/32: at T = 8192 exactly the recorded H200 last-stage trajectory, 9 events)."""
    from ds_ttt.data.synthetic import synthetic_trajectory

    prompt = max(1, num_tokens // 16) if prompt is None else prompt
    action = max(1, num_tokens // 32) if action is None else action
    observation = max(1, 3 * num_tokens // 32) if observation is None else observation
    ids_T, kinds_T, rounds_T = synthetic_trajectory(num_tokens, vocab_size=config.vocab_size, seed=seed,
                                                    prompt=prompt, action=action, observation=observation)
    return MicroBatch(ids_T[None].to(device), kinds_T[None].to(device), rounds_T[None].to(device), num_tokens, {})


def micro_batch_from_rows(rows, *, bucket: int, capacity: int, device: str) -> MicroBatch:
    from ds_ttt.data.token_kind import TokenKind
    from ds_ttt.train.data_loader import collate

    ids, kinds, rounds = collate(rows, bucket=bucket, capacity=capacity)
    return MicroBatch(ids.to(device), kinds.to(device), rounds.to(device), int((kinds != TokenKind.PAD).sum()), {})


def layout_name(stages: int, dp: int) -> str:
    return f"PP{stages}xDP{dp}"


def resolve_layouts(config, ttt, layouts=LAYOUTS) -> dict:
    from ds_ttt.train.layout import resolve_layout

    return {layout_name(s, d): (s, d, resolve_layout(s, config.num_hidden_layers, ttt,
                                                  tied_embeddings=bool(config.tie_word_embeddings)))
            for s, d in layouts}


def time_stages(built: dict, inputs: dict, repeats: int, device: str, *, warmup: int = 1) -> dict:
    """Forward / backward seconds of every (layout, stage, micro-batch): {(layout, stage, i): ([fwd], [bwd])}
    and {(layout, stage): backward ran}. Each repeat visits every cell once (after `warmup` untimed
    rounds), so a slow phase of a shared machine hits all of them alike instead of one stage."""
    times, ran = {}, {}
    for rep in range(warmup + repeats):
        for name, stages in built.items():
            for s, module in enumerate(stages):
                for i, mb in enumerate(inputs[name]):
                    f, b, did = run_stage(module, s, s == len(stages) - 1, mb, device, grad_seed=rep)
                    ran[(name, s)] = did
                    if rep >= warmup:
                        cell = times.setdefault((name, s, i), ([], []))
                        cell[0].append(f)
                        cell[1].append(b)
    return {"times": times, "backward_ran": ran}


def layout_inputs(built: dict, micro_batches: list[MicroBatch]) -> dict:
    """Per layout, a copy of each micro-batch with the hidden states that layout's stages receive."""
    out = {}
    for name, stages in built.items():
        out[name] = []
        for mb in micro_batches:
            x = dataclasses.replace(mb, received={})
            chain_inputs(stages, x)
            out[name].append(x)
    return out


def summarize(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
