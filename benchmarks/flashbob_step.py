"""The FlashBoB benchmark's child processes: one timed implementation of one shape (`--worker`), and
the check of its saved outputs against the float64 reference (`--checker`). benchmarks/flashbob.py
starts each in its own process (clean peak memory, a memory cap); run by hand for one case:

    .venv/bin/python benchmarks/flashbob_step.py --worker '{"device": "cpu", "impl": "cpu", "N": 256, "Hq": 8,
        "Hkv": 2, "D": 64, "warmup": 1, "repeats": 2, "save_dir": null}'
    .venv/bin/python benchmarks/flashbob_step.py --checker SPEC   # SPEC: device, N, Hq, Hkv, D, threads, saved

Each prints one JSON line (the result) last. The step, the inputs, the tolerance rule and the
fingerprints are described in benchmarks/flashbob.py's docstring.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_SOURCES = {"cpu": REPO / "ds_ttt/ops/flashbob/csrc/flashbob_cpu.cpp",
                  "cuda": REPO / "ds_ttt/ops/flashbob/csrc/flashbob_cuda_kernel.cu"}
OUTPUTS_STEP = ("o", "dq", "dk", "dv", "qbar", "kbar", "vbar")
OUTPUTS_FWD_BWD = ("o", "dq", "dk", "dv")
CHECK_FACTOR = 8.0  # allowed error = CHECK_FACTOR x the fp32 reference's own error + floor
CHECK_FLOOR_ULPS = 8  # floor: this many fp32 (bf16 on CUDA) ulps of the output's largest value
SEED = 0


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else "missing"


def fingerprint(tensors) -> str:
    """SHA-256 of the outputs' bytes: equal fingerprints, bit-identical results."""
    import torch
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- worker (child)
def inputs(device, dtype, N, Hq, Hkv, D, layout):
    """Seeded inputs, generated in float32 on the CPU (identical for every impl), then moved.
    layout "bhnd" (ours, math) or "bnhd" (flash_attn)."""
    import torch
    g = torch.Generator().manual_seed(SEED)
    shapes = dict(q=(1, Hq, N, D), k=(1, Hkv, N, D), v=(1, Hkv, N, D), do=(1, Hq, N, D),
                  uq=(1, Hq, N, D), uk=(1, Hkv, N, D), uv=(1, Hkv, N, D))
    out = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    if layout == "bnhd":
        out = {n: t.transpose(1, 2).contiguous() for n, t in out.items()}
    return {n: t.to(device=device, dtype=dtype) for n, t in out.items()}


def worker(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from ds_ttt.ops.flashbob import attention

    device, impl = spec["device"], spec["impl"]
    N, Hq, Hkv, D = spec["N"], spec["Hq"], spec["Hkv"], spec["D"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if impl in ("cpu", "cuda"):
        from ds_ttt.ops.flashbob.builder import load_cpu_op, load_cuda_op
        (load_cpu_op if impl == "cpu" else load_cuda_op)()
    source_sha = sha256(KERNEL_SOURCES[impl]) if impl in KERNEL_SOURCES else None
    x = inputs(device, dtype, N, Hq, Hkv, D, "bnhd" if impl == "flash_attn" else "bhnd")
    base_mb = rss_mb()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    q, k, v = (x[n].requires_grad_(True) for n in ("q", "k", "v"))
    if impl == "flash_attn":
        from flash_attn import flash_attn_func

        def step():
            o = flash_attn_func(q, k, v, causal=True)
            return (o.detach(),) + torch.autograd.grad(o, (q, k, v), x["do"]), None
    else:
        def fwd():
            if impl == "math":
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.MATH):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                          enable_gqa=Hq != Hkv)
            return attention(q, k, v, causal=True, backend=impl)

        def step():
            o = fwd()
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), x["do"], create_graph=True)
            phi = (dq * x["uq"]).sum() + (dk * x["uk"]).sum() + (dv * x["uv"]).sum()
            sync()
            t0 = time.perf_counter()
            bars = torch.autograd.grad(phi, (q, k, v))  # the backward-over-backward part alone
            sync()
            t_bob = time.perf_counter() - t0
            return (o.detach(), dq.detach(), dk.detach(), dv.detach()) + bars, t_bob

    names = OUTPUTS_FWD_BWD if impl == "flash_attn" else OUTPUTS_STEP
    times, cpu_times, bob_times, prints, saved = [], [], [], [], []
    try:
        for r in range(spec["warmup"] + spec["repeats"]):
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync()
            c0, t0 = time.process_time(), time.perf_counter()
            outs, t_bob = step()
            sync()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if r < spec["warmup"]:
                continue
            times.append(wall)
            cpu_times.append(cpu)
            if t_bob is not None:
                bob_times.append(t_bob)
            fp = fingerprint(outs)
            prints.append(fp)
            kept = next((s for s in saved if s["fingerprint"] == fp), None)
            if kept is None and spec.get("save_dir"):  # a result not seen yet: keep it for the check
                path = Path(spec["save_dir"]) / f"outputs_{len(saved)}.pt"
                torch.save({n: t.detach().cpu() for n, t in zip(names, outs)}, path)
                kept = dict(path=str(path), fingerprint=fp, repeats=[])
                saved.append(kept)
            if kept is not None:
                kept["repeats"].append(len(times) - 1)
            del outs
    except (RuntimeError, MemoryError) as e:  # allocation failure under the memory limit
        return dict(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
    out = dict(ok=True, times_s=times, cpu_s=cpu_times, median_s=statistics.median(times),
               min_s=min(times), max_s=max(times),
               bob_median_s=statistics.median(bob_times) if bob_times else None,
               fingerprints=prints, saved=saved, source_sha=source_sha,
               threads=torch.get_num_threads(), base_rss_mb=base_mb,
               peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out["peak_increase_mb"] = out["peak_rss_mb"] - base_mb
    if device == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


# ----------------------------------------------------------------------------- checker (child)
def reference_one_head(x, h, G, dtype):
    """Outputs of query head h (and its contributions to K, V's gradients) from the spec."""
    import torch

    from ds_ttt.ops.flashbob.reference import attention_reference
    kv = h // G
    q = x["q"][:, h:h + 1].to(dtype).requires_grad_(True)
    k = x["k"][:, kv:kv + 1].to(dtype).requires_grad_(True)
    v = x["v"][:, kv:kv + 1].to(dtype).requires_grad_(True)
    o = attention_reference(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), x["do"][:, h:h + 1].to(dtype), create_graph=True)
    phi = (dq * x["uq"][:, h:h + 1].to(dtype)).sum() + (dk * x["uk"][:, kv:kv + 1].to(dtype)).sum() \
        + (dv * x["uv"][:, kv:kv + 1].to(dtype)).sum()
    qb, kb, vb = torch.autograd.grad(phi, (q, k, v))
    return {n: t.detach() for n, t in dict(o=o, dq=dq, dk=dk, dv=dv, qbar=qb, kbar=kb,
                                           vbar=vb).items()}


def reference(x, Hq, Hkv, dtype, heads=None):
    """Full reference outputs (per-head contributions to dK, dV, K̄, V̄ summed over the group)."""
    import torch
    G = Hq // Hkv
    out = {n: torch.zeros_like(x[{"o": "q", "dq": "q", "qbar": "q"}.get(n, "k")], dtype=dtype)
           for n in OUTPUTS_STEP}
    for h in (range(Hq) if heads is None else heads):
        r = reference_one_head(x, h, G, dtype)
        kv = h // G
        for n in ("o", "dq", "qbar"):
            out[n][:, h:h + 1] = r[n]
        for n in ("dk", "dv", "kbar", "vbar"):
            out[n][:, kv:kv + 1] += r[n]
    return out


def checker(spec: dict) -> dict:
    """Compare every saved result of one shape (spec["saved"]: impl -> saved outputs) with the
    float64 reference; the reference is computed once for all implementations."""
    import torch
    torch.set_num_threads(spec["threads"])
    N, Hq, Hkv, D = spec["N"], spec["Hq"], spec["Hkv"], spec["D"]
    x = inputs("cpu", torch.float32, N, Hq, Hkv, D, "bhnd")  # what the worker used, in float32
    if spec["device"] == "cuda":  # the worker rounded its inputs to bf16: check against those
        x = {n: t.to(torch.bfloat16).float() for n, t in x.items()}
    low = torch.float32 if spec["device"] == "cpu" else torch.bfloat16
    ref64 = reference(x, Hq, Hkv, torch.float64)
    ref_low = reference(x, Hq, Hkv, low)  # the reference's own error at the kernel's precision
    out = {}
    for impl, saved in spec["saved"].items():
        results = []
        for s in saved:
            got = torch.load(s["path"], weights_only=True)  # a dict of tensors
            errs = {}
            for n, t in got.items():
                t = t.double()
                if impl == "flash_attn":
                    t = t.transpose(1, 2)
                want = ref64[n]
                own = (ref_low[n].double() - want).abs().max().item()
                floor = CHECK_FLOOR_ULPS * torch.finfo(low).eps * max(want.abs().max().item(), 1e-30)
                tol = CHECK_FACTOR * own + floor
                err = (t - want).abs().max().item() if torch.isfinite(t).all() else float("inf")
                errs[n] = dict(err=err, tol=tol, own_err=own, ref_max=want.abs().max().item(),
                               ok=err <= tol)
            results.append(dict(fingerprint=s["fingerprint"], repeats=s["repeats"], errors=errs,
                                ok=all(e["ok"] for e in errs.values())))
        out[impl] = dict(ok=all(r["ok"] for r in results) and bool(results), results=results)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--worker", metavar="SPEC", help="time one implementation of one shape (JSON spec)")
    mode.add_argument("--checker", metavar="SPEC", help="check saved outputs against the reference (JSON spec)")
    args = ap.parse_args()
    fn, spec = (worker, args.worker) if args.worker else (checker, args.checker)
    print(json.dumps(fn(json.loads(spec))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
