"""Memory per stage: the activation bytes of one micro-batch's forward + backward, measured (CUDA
allocator, or the tracked CPU allocator of torch's profiler), and the bytes of a stage under ZeRO-1
with 1F1B's in-flight micro-batches (pipeline_balance's `memory` table).

Run through `.venv/bin/python benchmarks/pipeline_balance` (the package docstring).
"""

from __future__ import annotations

import json
import pathlib
import tempfile

from .timing import MicroBatch, set_step_objective, stage_inputs

ZERO1_OPTIMIZER_BYTES = 12  # per trainable parameter: fp32 master + exp_avg + exp_avg_sq (DeepSpeedZeroOptimizer)
ZERO1_FP32_GRAD_BYTES = 4  # per trainable parameter: the fp32 flat gradient partition built for the step
GIB = 2**30
USABLE_80GB = 78.0 * GIB  # an 80 GB GPU less the CUDA context and allocator slack
USABLE_141GB = 137.8 * GIB  # the H200's 139.8 GiB (benchmarks/results/gpu/environment.json) less the same 2 GiB


def cpu_allocator_profile(fn) -> dict:
    """Run fn() under torch's profiler with memory tracking; returns the bytes the CPU allocator holds
    (allocated during fn and not yet freed): at the end of the "forward" range and the peak."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    mem = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    marks = [e for e in events if e.get("name") == "stage_forward" and e.get("ph") == "X"]
    fwd_end = marks[0]["ts"] + marks[0]["dur"] if marks else None
    if fwd_end is None:
        raise RuntimeError("the profiler trace has no 'stage_forward' range; cannot split forward from backward")
    before = [a for ts, a in mem if ts <= fwd_end]
    held = before[-1] if before else 0
    return {"held_after_forward_bytes": int(held), "peak_bytes": int(max([a for _, a in mem] or [0])),
            "method": "torch.profiler(profile_memory=True): c10 CPU allocator 'Total Allocated'"}


def measure_stage_memory(module, stage: int, is_last: bool, mb: MicroBatch, device: str) -> dict:
    """Activation bytes of one micro-batch's forward+backward on this stage (above what existed before)."""
    import torch

    if is_last:
        set_step_objective(module, mb)

    def step():
        inputs = stage_inputs(mb, stage)
        with torch.profiler.record_function("stage_forward"):
            out = module(inputs)
            loss = module.loss_fn(out, None) if is_last else None
        state["after_fwd"] = torch.cuda.memory_allocated() if device.startswith("cuda") else None
        if is_last:
            loss.backward()
        else:
            floats = [t for t in out if t.is_floating_point()]
            if floats and all(t.requires_grad for t in floats):
                for i, t in enumerate(floats):
                    t.backward(gradient=torch.full_like(t, 1e-3), retain_graph=i < len(floats) - 1)
        del out, loss, inputs

    state: dict = {}
    for p in module.parameters():
        p.grad = None
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        res = {"held_after_forward_bytes": int(state["after_fwd"] - base),
               "peak_bytes": int(torch.cuda.max_memory_allocated() - base),
               "method": "torch.cuda.memory_allocated / max_memory_allocated above the pre-step allocation"}
    else:
        res = cpu_allocator_profile(step)
    # gradients of trainable parameters are counted separately (grad_bytes); keep activations only
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
    res["peak_includes_grad_bytes"] = int(grad_bytes)
    for p in module.parameters():
        p.grad = None
    return res


def mem_method(device: str) -> str:
    return ("torch.cuda.memory_allocated / max_memory_allocated above the pre-step allocation"
            if device.startswith("cuda") else "torch.profiler(profile_memory=True): c10 CPU allocator 'Total Allocated'")


def stage_memory(params: dict, act: dict, *, stage: int, num_stages: int, num_micro: int, dp: int,
                 mixed_bf16: bool) -> dict:
    """Bytes of one stage under ZeRO-1 with dp replicas and 1F1B's in-flight micro-batches."""
    trainable = params["trainable_params"]
    in_flight = min(num_stages - stage, num_micro)
    held = act["held_after_forward_bytes"]
    peak_one = act["peak_bytes"] - act.get("peak_includes_grad_bytes", 0)
    activations = max(0, in_flight - 1) * held + peak_one
    optimizer = ZERO1_OPTIMIZER_BYTES * trainable / dp
    fp32_grad = ZERO1_FP32_GRAD_BYTES * trainable / dp
    resident = params["weight_bytes"] + params["grad_bytes"] + optimizer
    return {"weights": params["weight_bytes"], "grads": params["grad_bytes"], "optimizer": optimizer,
            "fp32_grad_partition_at_step": fp32_grad, "activations": activations, "in_flight": in_flight,
            "activation_held_per_micro": held, "activation_peak_one_micro": peak_one,
            # the step's fp32 gradient copy exists after the last backward, when activations are freed
            "total": resident + max(activations, fp32_grad), "mixed_bf16": mixed_bf16}
