"""FlashBoB on CUDA: the exact second-order attention step next to flash-attn and PyTorch math.

    python gpu_check/bench_flashbob_cuda.py --out benchmarks/results/gpu/flashbob_cuda.json
        [--sizes 1024,2048,4096,8192,16384,32768] [--budget-s 90] [--no-flashbob] [--check-n 1024]
        [--profile-n 8192] [--sweep-share 0.3]

Shapes: bf16, causal, B=1, 32 query heads sharing 8 key/value heads (GQA), head dim 128,
sequence length N per --sizes. Methods, each timed per N until it runs out of memory or time:

    flashbob_bob        FlashBoB ("cuda" backend) second-order step: o = attn(q, k, v);
                        (dq, dk, dv) = grad(o, (q, k, v), dO, create_graph=True);
                        (q̄, k̄, v̄, dŌ) = grad((dq, dk, dv), (q, k, v, dO), (U_Q, U_K, U_V))
    flashbob_fwd_bwd    FlashBoB forward + first backward (no graph)
    flash_attn_fwd_bwd  flash-attn's flash_attn_func forward + backward, when flash-attn is installed;
                        otherwise sdpa_flash_fwd_bwd, PyTorch SDPA's own FlashAttention-2 kernel
    math_bob            the same second-order step through PyTorch SDPA's MATH backend (stores N×N)

Per (N, method): step time (median of CUDA-event timings after a warm-up; repeats sized to
~0.3 s), peak allocated memory during one step above what the inputs hold, and TFLOP/s under
the FLOP model: per query head, forward 4·N²·D, first backward 10·N²·D (flash-attn's 2.5×
convention), backward-over-backward 36·N²·D (docs/flashbob_math.md), halved for
causal. Out-of-memory is recorded and that method skips larger N.

Per-kernel times (`kernel_profile` in the JSON): at N = --profile-n (default 8K) the FlashBoB
second-order step runs under torch.profiler, and the device time of each of the six kernels per
step is reported with FLOP/s counted two ways, both named:
    useful_tflops    the model above, 50·N²·D per query head halved for causal (what the
                     benchmark's rows use; the same numerator for every method);
    executed_tflops  the GEMMs the kernels issue: per tile pair fwd 2, bwd row 3, bwd col 4,
                     BoB stats 7, BoB row 7, BoB col 8 (KERNEL_GEMMS, from the kernel source's
                     header), 2·BM·BN·D FLOPs each, 31 GEMMs = 62·N²·D per head, halved for
                     causal (the diagonal tiles' masked half, ~BM/N more, is not counted).
Per kernel only the executed count exists (the useful model has no per-kernel split).

Tile-shape sweep (`tile_sweep` in the JSON), right after the profile: the CUDA op carries every
tile set of the kernels (ds_ttt/ops/flashbob/tiles.py: "sm80" 64-row blocks of 4 warps, "sm90"
128-row blocks of 8 warps, and both with half the streamed rows per stage), so each set runs the
same second-order step at N = --profile-n under the profiler, without a rebuild: per set the six
kernels' device times, and per kernel the fastest set (`best`). The device's default set is the
profile above, not run twice. Each set first passes the same tripwire as the default (rel err
< 5e-2 against fp32 math at --check-n), a failed check like any other. The sweep stops (the rest
"skipped (time budget)") beyond --sweep-share of --budget-s; a set the GPU cannot run is recorded
with the binding's reason.

Correctness (the phase fails when one fails): every measured step's outputs are finite, and at
N = --check-n FlashBoB's o, q̄, k̄, v̄, dŌ are compared with an fp32 PyTorch-math second-order
step on the same inputs; the relative error ‖x − x_fp32‖ / ‖x_fp32‖ must stay under 5e-2, a
tripwire for gross errors (the bf16 math step's own error is recorded beside it; the accuracy
rule lives in tests/ops/test_flashbob_cuda.py).

The step functions take any device and attention callable, so gpu_check/tests/test_gpu_check.py runs
them on CPU with tiny shapes (reference backend vs PyTorch math).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_results import PhaseRecord, positive_ints  # noqa: E402

FLOP_MODEL = ("per query head: fwd 4·N²·D, bwd 10·N²·D, bwd-over-bwd 36·N²·D; x0.5 causal; "
              "bob step = fwd + bwd + bwd-over-bwd = 50·N²·D, fwd+bwd = 14·N²·D")
OUTPUT_NAMES = ("o", "q_bar", "k_bar", "v_bar", "do_bar")
# GEMMs per (row block, column tile) pair that each kernel issues with all three tangents nonzero
# (flashbob_cuda_kernel.cu header; gpu_check/tests/test_gpu_check.py ties the two together).
KERNEL_GEMMS = {"fwd_kernel": 2, "bwd_row_kernel": 3, "bwd_col_kernel": 4, "bob_stats_kernel": 7,
                "bob_row_kernel": 7, "bob_col_kernel": 8}
USEFUL_PER_STEP = 4 + 10 + 36  # ·N²·D per query head
EXECUTED_PER_STEP = 2 * sum(KERNEL_GEMMS.values())  # 62 ·N²·D per query head
TRIPWIRE_REL_ERR = 5e-2
SWEEP_SHARE = 0.3  # of the benchmark's budget, at most, for the tile-shape sweep


def step_flops(kind: str, n: int, *, heads_q: int, head_dim: int, causal: bool = True) -> float:
    per = {"bob": 4 + 10 + 36, "fwd_bwd": 4 + 10}[kind]
    return per * n * n * head_dim * heads_q * (0.5 if causal else 1.0)


def kernel_times(events, reps: int) -> dict:
    """{kernel family: {"ms_per_step", "calls_per_step"}} from torch.profiler's key_averages()
    (objects with .key, .count and the device time in microseconds), plus "other" for every
    other device kernel in the step (PyTorch's own elementwise / reduction kernels)."""
    out = {k: {"ms_per_step": 0.0, "calls_per_step": 0.0} for k in (*KERNEL_GEMMS, "other")}
    for e in events:
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0.0)
        if not us:
            continue
        fam = next((k for k in KERNEL_GEMMS if f"{k}<" in e.key or e.key == k), "other")
        out[fam]["ms_per_step"] += us / 1e3 / reps
        out[fam]["calls_per_step"] += e.count / reps
    return out


def kernel_profile(times: dict, *, n: int, heads_q: int, head_dim: int, causal: bool = True) -> dict:
    """Per-kernel executed TFLOP/s and the step's useful and executed TFLOP/s (both named)."""
    unit = n * n * head_dim * heads_q * (0.5 if causal else 1.0)
    kernels, total_ms = {}, 0.0
    for k, gemms in KERNEL_GEMMS.items():
        ms = times[k]["ms_per_step"]
        total_ms += ms
        kernels[k] = {**times[k], "executed_flop": 2 * gemms * unit,
                      "executed_tflops": (2 * gemms * unit / (ms / 1e3) / 1e12) if ms > 0 else None}
    secs = total_ms / 1e3
    return {"n": n, "kernels": kernels, "other_ms_per_step": times["other"]["ms_per_step"],
            "flashbob_kernels_ms_per_step": total_ms,
            "useful_flop": USEFUL_PER_STEP * unit, "executed_flop": EXECUTED_PER_STEP * unit,
            "useful_tflops": USEFUL_PER_STEP * unit / secs / 1e12 if secs > 0 else None,
            "executed_tflops": EXECUTED_PER_STEP * unit / secs / 1e12 if secs > 0 else None,
            "flop_counts": {"useful": f"{USEFUL_PER_STEP}·N²·D per query head, x0.5 causal (the benchmark's model)",
                            "executed": f"{EXECUTED_PER_STEP}·N²·D per query head, x0.5 causal (GEMMs the kernels "
                                        "issue: " + ", ".join(f"{k} {g}" for k, g in KERNEL_GEMMS.items()) + ")"}}


def profile_step(step, *, reps: int = 3) -> dict:
    """Run `step` `reps` times under torch.profiler (CUDA activity) after one warm-up."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    return kernel_times(prof.key_averages(), reps)


def make_inputs(n: int, *, batch: int = 1, heads_q: int = 32, heads_kv: int = 8, head_dim: int = 128,
                dtype=torch.bfloat16, device="cuda", seed: int = 0) -> dict:
    """q, k, v, the output cotangent dO and the second-order tangents U_Q, U_K, U_V ([B, H, N, D])."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(h):
        return torch.randn(batch, h, n, head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
    return {"q": rnd(heads_q), "k": rnd(heads_kv), "v": rnd(heads_kv), "do": rnd(heads_q),
            "uq": rnd(heads_q), "uk": rnd(heads_kv), "uv": rnd(heads_kv)}


def second_order_step(attn, x: dict) -> tuple[torch.Tensor, ...]:
    """(o, q̄, k̄, v̄, dŌ): forward, first backward with create_graph, then the second backward."""
    q, k, v, do = (x[name].detach().requires_grad_(True) for name in ("q", "k", "v", "do"))
    o = attn(q, k, v)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    q_bar, k_bar, v_bar, do_bar = torch.autograd.grad((dq, dk, dv), (q, k, v, do), (x["uq"], x["uk"], x["uv"]))
    return o.detach(), q_bar, k_bar, v_bar, do_bar


def first_order_step(attn, x: dict) -> tuple[torch.Tensor, ...]:
    """(o, dq, dk, dv): forward and the ordinary backward."""
    q, k, v = (x[name].detach().requires_grad_(True) for name in ("q", "k", "v"))
    o = attn(q, k, v)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), x["do"])
    return o.detach(), dq, dk, dv


def flashbob_attn(backend: str = "cuda"):
    from ds_ttt.ops.flashbob import attention

    def attn(q, k, v):
        return attention(q, k, v, causal=True, backend=backend)
    return attn


def math_attn(q, k, v):
    """PyTorch SDPA's MATH backend (twice differentiable; materialises N×N)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def flash_attn_attn(q, k, v):
    """flash-attn (tensors [B, N, H, D] underneath; GQA native)."""
    from flash_attn import flash_attn_func

    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)


def sdpa_flash_attn(q, k, v):
    """PyTorch SDPA restricted to its FlashAttention-2 kernel (K/V expanded over the group if needed)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except RuntimeError:
            g = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                                  is_causal=True)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def cross_check(attn, x: dict, gold=None) -> dict:
    """Relative errors of `attn`'s second-order step (and of bf16 math) against fp32 math (`gold`:
    that step's outputs when already computed)."""
    gold = second_order_step(math_attn, {k: t.float() for k, t in x.items()}) if gold is None else gold
    got = second_order_step(attn, x)
    low = second_order_step(math_attn, x)
    return {name: {"kernel": rel_err(a, g), "math_lowprec": rel_err(b, g)}
            for name, a, b, g in zip(OUTPUT_NAMES, got, low, gold)}


def tile_sweep(op, attn, x: dict, *, n: int, head_dim: int, budget_s: float, check_x: dict | None = None,
               default_times: dict | None = None, cuda: bool = True) -> tuple[dict, list[str]]:
    """Time the second-order step of `attn` (running on the kernels of `op`) under each tile set of
    `op` at N = n; returns (the record, the names of the sets whose tripwire failed).

    check_x: inputs at a small N; each set's step there must stay within TRIPWIRE_REL_ERR of fp32
    math. default_times: kernel_times() of the device's default set at this N (not timed again).
    On CUDA a set's times are torch.profiler device times per kernel; elsewhere (tests, through the
    CPU emulator) the wall time of one step.
    """
    from ds_ttt.ops.flashbob.tiles import active_tile_set, tile_sets, use_tile_set

    t0 = time.perf_counter()
    default = active_tile_set(op)["name"]
    gold = second_order_step(math_attn, {k: t.float() for k, t in check_x.items()}) if check_x else None
    record = {"n": n, "default_set": default, "sets": [], "best": {},
              "note": "The default set is chosen by analysis (docs/flashbob.md); the best set per kernel here "
                      "is the measurement that should decide it."}
    failed, last_cost = [], None
    for ts in tile_sets(op):
        shapes = {sh["kernel"]: f"{sh['BM']}/{sh['BN']}/{sh['warps']}" for sh in ts["shapes"] if sh["D"] == head_dim}
        row = {"name": ts["name"], "shapes": shapes, "default": ts["name"] == default}
        record["sets"].append(row)
        if not shapes or "bf16" not in ts["dtypes"]:
            row["status"] = f"not built for bf16 at D={head_dim}"
            continue
        spent = time.perf_counter() - t0
        if last_cost is not None and spent + last_cost > budget_s:
            row.update(status="skipped (time budget)", predicted_s=round(last_cost, 1))
            continue
        start = time.perf_counter()
        try:
            with use_tile_set(op, ts["name"]):
                if check_x is not None:
                    errs = cross_check(attn, check_x, gold)
                    worst = max(e["kernel"] for e in errs.values())
                    row["rel_err"] = {k: e["kernel"] for k, e in errs.items()}
                    if not (math.isfinite(worst) and worst < TRIPWIRE_REL_ERR):
                        failed.append(ts["name"])
                if ts["name"] == default and default_times is not None:
                    times = default_times
                elif cuda:
                    times = profile_step(lambda: second_order_step(attn, x), reps=2)
                else:
                    second_order_step(attn, x)
                    w0 = time.perf_counter()
                    second_order_step(attn, x)
                    times = {"wall": {"ms_per_step": (time.perf_counter() - w0) * 1e3, "calls_per_step": 1.0}}
        except RuntimeError as exc:  # a set this GPU cannot run: the binding says why
            row["status"] = f"not run: {str(exc)[:300]}"
            continue
        last_cost = time.perf_counter() - start
        kernels = {k: v["ms_per_step"] for k, v in times.items() if k != "other" and v["calls_per_step"]}
        row.update(status="ok", kernels_ms=kernels, total_ms=sum(kernels.values()), seconds=round(last_cost, 2))
    ok_rows = [r for r in record["sets"] if r.get("status") == "ok"]
    for kernel in sorted({k for r in ok_rows for k in r["kernels_ms"]}):
        best = min((r for r in ok_rows if kernel in r["kernels_ms"]), key=lambda r: r["kernels_ms"][kernel])
        record["best"][kernel] = {"set": best["name"], "ms_per_step": best["kernels_ms"][kernel],
                                  "shape": best["shapes"].get(kernel), "default_is_best": best["default"]}
    record["seconds"] = round(time.perf_counter() - t0, 2)
    return record, failed


def _all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def time_step(fn, *, device="cuda", target_s: float = 0.3, max_reps: int = 20) -> tuple[float, int, int | None, tuple]:
    """(median seconds, repeats, peak bytes above the start, outputs of the first measured run).

    CUDA: CUDA-event times and the allocator's peak; CPU (tests only): wall clock, no memory figure.
    """
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed():
        if not cuda:
            t0 = time.perf_counter()
            result = fn()
            return time.perf_counter() - t0, result
        start.record()
        result = fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, result

    first, outs = timed()
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    reps = max(1, min(max_reps, int(target_s / max(first, 1e-6))))
    times = [timed()[0] for _ in range(reps)]
    return statistics.median(times), reps, peak, outs


def run(*, out: str, sizes: list[int], budget_s: float = 90.0, use_flashbob: bool = True,
        check_n: int = 1024, profile_n: int = 8192, heads_q: int = 32, heads_kv: int = 8, head_dim: int = 128, device: str = "cuda",
        flashbob_backend: str = "cuda", sweep_share: float = SWEEP_SHARE) -> dict:
    """Measure every (N, method) within `budget_s`; rewrite `out` after each; return the record.

    device / flashbob_backend default to the GPU; tests run the same loop on CPU with tiny shapes
    and the "reference" backend.
    """
    t_start = time.perf_counter()
    cuda = torch.device(device).type == "cuda"
    has_flash_attn = cuda and importlib.util.find_spec("flash_attn") is not None  # flash-attn is CUDA-only
    methods = []
    if use_flashbob:
        methods += [("flashbob_bob", "bob", flashbob_attn(flashbob_backend)),
                    ("flashbob_fwd_bwd", "fwd_bwd", flashbob_attn(flashbob_backend))]
    methods.append(("flash_attn_fwd_bwd", "fwd_bwd", flash_attn_attn) if has_flash_attn
                   else ("sdpa_flash_fwd_bwd", "fwd_bwd", sdpa_flash_attn))
    methods.append(("math_bob", "bob", math_attn))
    rec = PhaseRecord(out, "flashbob_cuda", flop_model=FLOP_MODEL, config={
        "batch": 1, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim, "dtype": "bf16",
        "causal": True, "sizes": sizes, "methods": [m[0] for m in methods], "check_n": check_n, "device": device,
        "flashbob_backend": flashbob_backend})
    if not has_flash_attn:
        rec.note("flash-attn is not installed: the first-order baseline is PyTorch SDPA's FlashAttention-2 "
                 "kernel (sdpa_flash_fwd_bwd) instead of flash_attn_func")
    if not use_flashbob:
        rec.note("FlashBoB CUDA op unavailable (build failed or skipped): only the baselines ran")
    failed = False

    # Correctness tripwire first, at a small N, so a wrong kernel is caught even if time runs out.
    if use_flashbob:
        try:
            x = make_inputs(check_n, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, device=device)
            errs = cross_check(flashbob_attn(flashbob_backend), x)
            worst = max(e["kernel"] for e in errs.values())
            rec.set(cross_check={"n": check_n, "rel_err": errs})
            detail = ", ".join(f"{k} {v['kernel']:.1e} (math bf16 {v['math_lowprec']:.1e})" for k, v in errs.items())
            ok = math.isfinite(worst) and worst < TRIPWIRE_REL_ERR
            failed |= not rec.check(f"FlashBoB second-order step vs fp32 math at N={check_n} (rel err < "
                                    f"{TRIPWIRE_REL_ERR:g})", ok, detail)
        except Exception as exc:  # noqa: BLE001
            failed = True
            rec.check(f"FlashBoB second-order step vs fp32 math at N={check_n}", False,
                      f"{type(exc).__name__}: {str(exc)[:500]}")
            methods = [m for m in methods if not m[0].startswith("flashbob")]
        finally:
            x = None
            gc.collect()
            torch.cuda.empty_cache()

    # Per-kernel device times at profile_n, then the tile-shape sweep there, before the size sweep
    # so that they exist even if time runs out.
    if use_flashbob and cuda and profile_n > 0 and any(m[0] == "flashbob_bob" for m in methods):
        times = None
        try:
            x = make_inputs(profile_n, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, device=device)
            attn = flashbob_attn(flashbob_backend)
            times = profile_step(lambda: second_order_step(attn, x))
            prof = kernel_profile(times, n=profile_n, heads_q=heads_q, head_dim=head_dim)
            rec.set(kernel_profile=prof)
            missing = [k for k, v in prof["kernels"].items() if not v["calls_per_step"]]
            if missing:
                rec.note(f"profiler at N={profile_n}: no device time recorded for {', '.join(missing)}")
            if sweep_share > 0:
                from ds_ttt.ops.flashbob.builder import load_cuda_op

                check_x = make_inputs(check_n, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, device=device)
                sweep, bad = tile_sweep(load_cuda_op(), attn, x, n=profile_n, head_dim=head_dim,
                                        budget_s=sweep_share * budget_s, check_x=check_x, default_times=times)
                rec.set(tile_sweep=sweep)
                ran = [r["name"] for r in sweep["sets"] if r.get("status") == "ok"]
                failed |= not rec.check(f"every tile set's second-order step vs fp32 math at N={check_n} (rel err "
                                        f"< {TRIPWIRE_REL_ERR:g})", not bad,
                                        f"ran {', '.join(ran) or 'none'}" + (f"; wrong: {', '.join(bad)}" if bad else ""))
        except Exception as exc:  # noqa: BLE001 - the size sweep below still runs
            rec.note(f"profiler / tile sweep at N={profile_n} failed: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            x = check_x = None
            gc.collect()
            torch.cuda.empty_cache()

    stopped: dict[str, str] = {}
    last: dict[str, tuple[int, float]] = {}
    nonfinite = []
    for n in sizes:
        x = make_inputs(n, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, device=device)
        for name, kind, attn in methods:
            row = {"n": n, "method": name}
            if name in stopped:
                rec.add_row({**row, "status": stopped[name]})
                continue
            remaining = budget_s - (time.perf_counter() - t_start)
            if name in last:  # quadratic in N; one warm-up + one memory run + ~0.3 s of repeats
                n0, t0 = last[name]
                predicted = t0 * (n / n0) ** 2 * 3 + 0.3
                if predicted > remaining:
                    stopped[name] = "skipped (time budget)"
                    rec.add_row({**row, "status": stopped[name], "predicted_s": round(predicted, 2)})
                    continue
            step = (lambda a=attn: second_order_step(a, x)) if kind == "bob" else (lambda a=attn: first_order_step(a, x))
            try:
                step()  # warm-up (first call also builds/loads the op)
                secs, reps, peak, outs = time_step(step, device=device)
                finite = _all_finite(outs)
                flops = step_flops(kind, n, heads_q=heads_q, head_dim=head_dim)
                row.update(status="ok", time_s=secs, repeats=reps, peak_bytes=peak, tflops=flops / secs / 1e12,
                           finite=finite)
                if not finite:
                    nonfinite.append(f"{name} N={n}")
                last[name] = (n, secs)
                outs = None
            except Exception as exc:  # noqa: BLE001
                if _is_oom(exc):
                    row.update(status="oom")
                    stopped[name] = f"skipped (OOM at N={n})"
                else:
                    row.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:400]}")
                    stopped[name] = f"skipped (error at N={n})"
                    if name.startswith("flashbob"):
                        failed = True
                        rec.check(f"{name} runs at N={n}", False, row["error"])
            gc.collect()
            torch.cuda.empty_cache()
            rec.add_row(row)
        x = None
        gc.collect()
        torch.cuda.empty_cache()
    measured = [r for r in rec.data["rows"] if r.get("status") == "ok"]
    failed |= not rec.check("every measured step has finite outputs", not nonfinite,
                            f"{len(measured)} measured" + (f"; non-finite: {', '.join(nonfinite)}" if nonfinite else ""))
    rec.finish("failed" if failed else "ok", time.perf_counter() - t_start)
    return rec.data


def _int_list(text: str) -> list[int]:
    return sorted(positive_ints(text))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to (re)write")
    ap.add_argument("--sizes", type=_int_list, default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--budget-s", type=float, default=90.0)
    ap.add_argument("--no-flashbob", action="store_true", help="baselines only (the CUDA op did not build)")
    ap.add_argument("--check-n", type=int, default=1024)
    ap.add_argument("--profile-n", type=int, default=8192, help="per-kernel profiler times at this N (0: off)")
    ap.add_argument("--sweep-share", type=float, default=SWEEP_SHARE,
                    help="share of --budget-s for the tile-shape sweep at --profile-n (0: off)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("[flashbob_cuda] no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    data = run(out=a.out, sizes=a.sizes, budget_s=a.budget_s, use_flashbob=not a.no_flashbob, check_n=a.check_n,
               profile_n=a.profile_n, sweep_share=a.sweep_share)
    prof = data.get("kernel_profile")
    if prof:
        for k, v in prof["kernels"].items():
            print(f"[flashbob_cuda] N={prof['n']} {k:<17} {v['ms_per_step']:.2f} ms/step, executed "
                  f"{v['executed_tflops'] or 0:.1f} TFLOP/s", flush=True)
        print(f"[flashbob_cuda] N={prof['n']} six kernels {prof['flashbob_kernels_ms_per_step']:.2f} ms/step: useful "
              f"{prof['useful_tflops'] or 0:.1f} TFLOP/s (50·N²·D), executed {prof['executed_tflops'] or 0:.1f} "
              f"TFLOP/s (62·N²·D)", flush=True)
    sweep = data.get("tile_sweep")
    if sweep:
        for r in sweep["sets"]:
            print(f"[flashbob_cuda] N={sweep['n']} tile set {r['name']:<13} {r.get('status')}"
                  + (f": six kernels {r['total_ms']:.2f} ms/step" if r.get("status") == "ok" else ""), flush=True)
        for k, b in sweep["best"].items():
            print(f"[flashbob_cuda] fastest {k:<17} {b['set']} ({b['shape']}) {b['ms_per_step']:.2f} ms/step"
                  + ("" if b["default_is_best"] else f"; the default set is {sweep['default_set']}"), flush=True)
    for r in data["rows"]:
        t = r.get("time_s")
        print(f"[flashbob_cuda] N={r['n']:>6} {r['method']:<20} {r.get('status')}"
              + (f": {t * 1e3:.2f} ms, {r['peak_bytes'] / 2**30:.2f} GiB, {r['tflops']:.1f} TFLOP/s" if t else ""),
              flush=True)
    return 0 if data["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
