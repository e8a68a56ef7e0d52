"""Qwen3-8B on GPUs: every layout's step and busiest rank from the recorded H200 last stage
(benchmarks/results/gpu/) plus a FLOP estimate of the frozen stages, and the fp32 fast weights'
bytes per inner update measured on CPU (pipeline_balance's `8B` section).

Run through `.venv/bin/python benchmarks/pipeline_balance` (--no-qwen3-estimate skips it).
"""

from __future__ import annotations

import json
import pathlib
import subprocess

from . import ROOT
from .memory import GIB, USABLE_80GB, ZERO1_FP32_GRAD_BYTES, ZERO1_OPTIMIZER_BYTES, measure_stage_memory, mem_method
from .simulate import simulate_train_schedule
from .timing import MicroBatch, build_stage, layout_inputs, resolve_layouts, set_step_objective, synthetic_micro_batch

GPU_RESULTS = ROOT / "benchmarks" / "results" / "gpu"
FP32_FAST_WEIGHTS_COMMIT = "8a7fc85"  # the first commit whose event loop keeps the fast weights in fp32


def recorded_with_fp32_fast_weights(commit: str | None) -> bool:
    """Was a GPU recording made at `commit` with fp32 fast weights (FP32_FAST_WEIGHTS_COMMIT is its ancestor)?
    Asks git; a commit git does not know is an error naming it (a shallow clone: fetch the history)."""
    if not commit:
        raise ValueError("benchmarks/results/gpu/environment.json has no git_commit: cannot tell whether the "
                         "recording's fast weights were bf16 or fp32")
    known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
    if known.returncode != 0:
        raise ValueError(f"benchmarks/results/gpu/environment.json: git_commit {commit} is not in this clone's "
                         "history (a shallow clone? run `git fetch --unshallow`)")
    return subprocess.run(["git", "merge-base", "--is-ancestor", FP32_FAST_WEIGHTS_COMMIT, commit], cwd=ROOT,
                          capture_output=True).returncode == 0


def decoder_layer_flops(config, num_tokens: int) -> dict:
    """Forward FLOPs of one Qwen3 decoder layer over T tokens (causal full attention, GQA)."""
    c, f, h, kv, d = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)
    linear_params = c * h * d + 2 * c * kv * d + h * d * c + 3 * c * f
    linear = 2 * linear_params * num_tokens
    attention = 2 * 2 * num_tokens * num_tokens * d * h / 2  # QK^T and PV, causal half
    return {"linear": linear, "attention": attention, "total": linear + attention, "linear_params": linear_params}


def fast_weight_bytes_per_update(device: str = "cpu", *, lengths=(512, 1024), prime_width: int = 8192) -> dict:
    """Bytes the current event loop keeps per inner update, in units of one fp32 copy of the fast weights.

    A bf16 model whose prime MLPs dominate everything else (hidden 64, prime width 8192, vocab 512, 2
    adaptive layers), one trajectory with fixed rounds (prompt 32; 2 header, 16 action, 1, 48
    observation, 1), at two lengths: (held after forward at the longer - at the shorter) / (extra
    updates x prime parameters x 4 B). Used to carry the H200 last-stage recording (made with bf16 fast
    weights) over to the current fp32 fast weights: the same tensors at twice the bytes.
    """
    import torch

    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import tiny_qwen3_config

    cfg = tiny_qwen3_config(num_hidden_layers=4, vocab_size=512)
    ttt = TTTConfig(adaptive_layers=2, prime_intermediate_size=prime_width).validate(cfg.num_hidden_layers)
    layout = resolve_layouts(cfg, ttt, ((2, 1),))["PP2xDP1"][2]
    stages = [build_stage(cfg, ttt, layout, s, dtype=torch.bfloat16, device=device) for s in range(2)]
    prime = sum(p.numel() for n, p in stages[1].named_parameters() if ".prime_mlp." in n)
    points = []
    for t in lengths:
        mb = layout_inputs({"probe": stages}, [synthetic_micro_batch(cfg, t, device=device, prompt=32, action=16,
                                                                      observation=48)])["probe"][0]
        set_step_objective(stages[1], mb)
        mem = measure_stage_memory(stages[1], 1, True, mb, device)
        ups = count_updates(mb)
        points.append({"tokens": t, "updates": ups, "held_after_forward_bytes": mem["held_after_forward_bytes"]})
    (a, b) = points[0], points[-1]
    factor = (b["held_after_forward_bytes"] - a["held_after_forward_bytes"]) / ((b["updates"] - a["updates"]) * prime * 4)
    return {"points": points, "prime_params": prime, "factor_fp32_copies_per_update": factor,
            "method": mem_method(device)}


def count_updates(mb: MicroBatch) -> int:
    """Observed rounds (one inner update each): a round is observed when a label in it predicts an
    observation token (label t predicts token t + 1; the event loop's rule)."""
    from ds_ttt.data.token_kind import TokenKind

    kinds, rounds = mb.kinds_BT[0].tolist(), mb.rounds_BT[0].tolist()
    return len({rounds[t] for t in range(len(kinds) - 1) if kinds[t + 1] == TokenKind.OBSERVATION})


def qwen3_8b_estimate(gpu_dir: pathlib.Path = GPU_RESULTS, *, global_batch: int = 32, last_stage_fwd_fraction: float,
                      frozen_backward: bool, fast_weight_factor: float | None, rates_tflops: tuple = (),
                      assumed_gemm_tflops: float = 600.0) -> dict:
    """Qwen3-8B layouts from the recorded H200 last stage (benchmarks/results/gpu/last_stage.json) and a FLOP
    estimate of the frozen decoder layers.

    Per recorded (attention backend, T): every layout's step simulated with the TrainSchedule model (the last
    stage = the recorded meta-step, split `last_stage_fwd_fraction` forward; a frozen stage = its layers'
    forward FLOPs at a bf16 rate, and, when `frozen_backward`, recompute + 2x forward for its backward;
    PP1 runs the frozen layers forward only, their outputs need no grad), and the busiest rank's memory:
    its weights + bf16 prime gradients + ZeRO-1 optimizer state / dp + the activations (recorded peak minus
    the last stage's weights and prime gradients). For a recording older than the fp32 fast weights,
    `fast_weight_factor` (fast_weight_bytes_per_update) adds what they hold beyond the recording's bf16 ones:
    updates x factor x P x (4 - 2) B + P x 4 B (the fp32 copy of W_0), P = prime MLP parameters.
    """
    from ds_ttt.model.presets import backbone_config

    cfg = backbone_config("qwen3-8b")
    last = json.loads((gpu_dir / "last_stage.json").read_text())
    fb = json.loads((gpu_dir / "flashbob_cuda.json").read_text())
    env = json.loads((gpu_dir / "environment.json").read_text())
    if fast_weight_factor is not None and recorded_with_fp32_fast_weights(env.get("git_commit")):
        fast_weight_factor = None  # the recording already holds the fp32 fast weights: nothing to add
    num_adaptive = last["config"]["num_adaptive"]
    num_frozen = cfg.num_hidden_layers - num_adaptive
    c, v, f = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    layer_params = decoder_layer_flops(cfg, 1)["linear_params"] + 2 * c + 2 * cfg.head_dim  # + 4 norms
    prime_mlp = num_adaptive * 3 * c * f  # prime width = intermediate size in the recording
    trainable = prime_mlp + num_adaptive * c  # + prime norms
    bf16 = 2
    weights_all = bf16 * (v * c + cfg.num_hidden_layers * layer_params + trainable + c + v * c)
    weights_last = last["weight_bytes"]
    grad_bytes = bf16 * trainable
    opt_bytes = ZERO1_OPTIMIZER_BYTES * trainable
    fp32_grad = ZERO1_FP32_GRAD_BYTES * trainable
    usable = {"80 GB": USABLE_80GB, "141 GB": (env["gpu"]["memory_gib"] - 2.0) * GIB}
    measured_rates = {r["n"]: r["tflops"] for r in fb["rows"]
                      if r.get("method", "").endswith("flash_fwd_bwd") and r.get("status") == "ok"}
    rows = []
    for rec in last["rows"]:
        if rec.get("status") != "ok":
            continue
        t, backend, step_last = rec["tokens"], rec["backend"], rec["step_s"]
        act = rec["peak_bytes"] - weights_last - grad_bytes
        extra = (rec["num_updates"] * fast_weight_factor * prime_mlp * (4 - bf16) + 4 * prime_mlp
                 if fast_weight_factor is not None else None)
        rates = list(rates_tflops) or ([measured_rates[t]] if t in measured_rates else []) + [assumed_gemm_tflops]
        layer = decoder_layer_flops(cfg, t)
        for name, stages, dp in (("PP4xDP1", 4, 1), ("PP2xDP2", 2, 2), ("PP1xDP4", 1, 4)):
            m = global_batch // dp
            sims = {}
            for rate in rates:
                frozen_layer_s = layer["total"] / (rate * 1e12)
                if stages == 1:
                    fwd = [[[num_frozen * frozen_layer_s + last_stage_fwd_fraction * step_last] * m]]
                    bwd = [[[(1 - last_stage_fwd_fraction) * step_last] * m]]
                else:
                    per = [num_frozen // (stages - 1)] * (stages - 1)
                    per[0] += num_frozen - sum(per)
                    fwd = [[[k * frozen_layer_s] * m for k in per] + [[last_stage_fwd_fraction * step_last] * m]]
                    bwd = [[[(3 * k * frozen_layer_s if frozen_backward else 0.0)] * m for k in per]
                           + [[(1 - last_stage_fwd_fraction) * step_last] * m]]
                sim = simulate_train_schedule(fwd * dp, bwd * dp)
                sims[rate] = {"step_s": sim["step_s"], "tokens_per_s": global_batch * t / sim["step_s"],
                              "utilisation_last": sim["utilisation"][f"0/{stages - 1}"], "bubble": sim["bubble"]}
            rank_weights = weights_all if stages == 1 else weights_last
            resident = rank_weights + grad_bytes + opt_bytes / dp
            mem = {"recorded_inner_loop": resident + max(act, fp32_grad / dp)}
            if extra is not None:
                mem["fp32_fast_weights"] = resident + max(act + extra, fp32_grad / dp)
            frozen_weights = (bf16 * (v * c + (num_frozen // (stages - 1) + num_frozen % (stages - 1)) * layer_params)
                              if stages > 1 else None)
            rows.append({"tokens": t, "backend": backend, "layout": name, "num_micro": m, "updates": rec["num_updates"],
                         "last_stage_step_s": step_last, "by_rate": sims, "busiest_rank_bytes": mem,
                         "stage0_weight_bytes": frozen_weights,
                         "fits": {gpu: {k: x <= cap for k, x in mem.items()} for gpu, cap in usable.items()}})
    return {"gpu": env["gpu"]["name"], "gpu_memory_gib": env["gpu"]["memory_gib"], "recorded_commit": env.get("git_commit"),
            "global_batch": global_batch, "num_frozen": num_frozen, "num_adaptive": num_adaptive,
            "trainable_params": trainable, "prime_mlp_params": prime_mlp, "weight_bytes_all": weights_all,
            "weight_bytes_last_stage": weights_last, "optimizer_bytes_dp1": opt_bytes, "grad_bytes": grad_bytes,
            "usable_bytes": usable, "last_stage_fwd_fraction": last_stage_fwd_fraction,
            "frozen_backward": frozen_backward, "fast_weight_factor": fast_weight_factor,
            "measured_flash_tflops": measured_rates, "assumed_gemm_tflops": assumed_gemm_tflops,
            "layer_fwd_flops_8k": decoder_layer_flops(cfg, 8192), "rows": rows}


def longest_fitting_context(est: dict, gpu: str, key: str) -> dict:
    """{(backend, layout): longest T (whole K tokens) whose busiest rank fits `gpu`}, interpolating memory
    linearly in T between recorded lengths (it grows with the number of events, i.e. with T); None when even
    the shortest recorded length does not fit; a recorded longest length that fits is reported as such
    (marked "+": not extrapolated)."""
    cap = est["usable_bytes"][gpu]
    out = {}
    for backend, layout in {(r["backend"], r["layout"]) for r in est["rows"]}:
        pts = sorted((r["tokens"], r["busiest_rank_bytes"][key]) for r in est["rows"]
                     if r["backend"] == backend and r["layout"] == layout)
        best = None
        for (t0, m0), (t1, m1) in zip(pts, pts[1:]):
            if m0 > cap:
                break
            best = f"{t0 // 1024}K"
            if m1 > cap:
                t = t0 + (cap - m0) / (m1 - m0) * (t1 - t0)
                best = f"{int(t // 1024)}K"
                break
        else:
            if pts and pts[-1][1] <= cap:
                best = f"{pts[-1][0] // 1024}K+"
        out[(backend, layout)] = best
    return out
