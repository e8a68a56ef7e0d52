"""Benchmark the FlashBoB second-order attention step against PyTorch math attention.

    cd /work/main && .venv/bin/python benchmarks/flashbob.py                  # CPU table
    .venv/bin/python benchmarks/flashbob.py --seqlens 1024,2048 --configs 8/8  # quick look
    .venv/bin/python benchmarks/flashbob.py --device cuda                     # on a GPU box

One "step" is what the meta-gradient does with an attention layer: forward, first gradient with
create_graph=True, then the gradient of Φ = Σ <U_X, dX> (X = Q, K, V) w.r.t. Q, K, V. Shapes:
B=1, H_q=8 with H_kv in {8, 2} (MHA and GQA), D=64, causal, N in --seqlens. Each (impl, shape)
runs in its own subprocess so peak memory is clean: peak RSS on CPU (ru_maxrss) and the increase
over the process's RSS after imports; torch.cuda.max_memory_allocated on CUDA.

Implementations:
  cpu   : ds_ttt.ops.flashbob.attention(backend="cpu")  (C++ tiled, O(N·d) extra memory)
  math  : F.scaled_dot_product_attention under SDPBackend.MATH (stores N×N tensors)
  cuda  : backend="cuda";  flash_attn: flash_attn_func forward+backward (first order only; the
          reference point for the issue's "BoB ≤ 4x flash-attn fwd+bwd" target)
Math is skipped (and the table says why) when its predicted peak (4x the previous N's increase)
exceeds --mem-limit-gb, or after it failed at a smaller N. --time-budget-s stops starting new
cases once spent. GFLOP/s uses the same causal "useful" FLOP count for every implementation:
fwd 4·N²·d, first backward 10·N²·d, BoB 36·N²·d per head, halved for causal; it is printed next
to this machine's measured fp32 matmul GFLOP/s. Results: benchmarks/results/flashbob_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


# ----------------------------------------------------------------------------- worker (child)
def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO))
    from ds_ttt.ops.flashbob import attention

    device, impl = spec["device"], spec["impl"]
    N, Hq, Hkv, D = spec["N"], spec["Hq"], spec["Hkv"], spec["D"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    if impl == "cpu":
        from ds_ttt.ops.flashbob.builder import load_cpu_op
        load_cpu_op()
    base_mb = _rss_mb()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def rand(*shape, grad=False):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    if impl == "flash_attn":
        from flash_attn import flash_attn_func
        q, k, v = rand(1, N, Hq, D, grad=True), rand(1, N, Hkv, D, grad=True), \
            rand(1, N, Hkv, D, grad=True)
        do = rand(1, N, Hq, D)

        def step():
            o = flash_attn_func(q, k, v, causal=True)
            torch.autograd.grad(o, (q, k, v), do)
    else:
        q, k, v = rand(1, Hq, N, D, grad=True), rand(1, Hkv, N, D, grad=True), \
            rand(1, Hkv, N, D, grad=True)
        do, uq, uk, uv = rand(1, Hq, N, D), rand(1, Hq, N, D), rand(1, Hkv, N, D), \
            rand(1, Hkv, N, D)

        def fwd():
            if impl == "math":
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.MATH):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                          enable_gqa=Hq != Hkv)
            return attention(q, k, v, causal=True, backend=impl)

        def step():
            o = fwd()
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
            phi = (dq * uq).sum() + (dk * uk).sum() + (dv * uv).sum()
            sync()
            t0 = time.perf_counter()
            torch.autograd.grad(phi, (q, k, v))  # the backward-over-backward part alone
            sync()
            return time.perf_counter() - t0

    times, bob_times = [], []
    try:
        for r in range(spec["warmup"] + spec["repeats"]):
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            t_bob = step()
            sync()
            if r >= spec["warmup"]:
                times.append(time.perf_counter() - t0)
                if t_bob is not None:
                    bob_times.append(t_bob)
    except (RuntimeError, MemoryError) as e:  # allocation failure under the memory limit
        return dict(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
    out = dict(ok=True, times_s=times, median_s=statistics.median(times),
               bob_median_s=statistics.median(bob_times) if bob_times else None,
               base_rss_mb=base_mb, peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out["peak_increase_mb"] = out["peak_rss_mb"] - base_mb
    if device == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


# ----------------------------------------------------------------------------- driver (parent)
def _flops(N, Hq, D, part):
    per_head = {"step": 4 + 10 + 36, "fwd_bwd": 4 + 10}[part] * N * N * D / 2  # causal
    return per_head * Hq


def _matmul_gflops(device: str) -> float:
    import torch
    n = 2048 if device == "cpu" else 8192
    dtype = torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def _run_case(spec: dict, mem_limit_gb: float) -> dict:
    env = dict(os.environ)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]

    def limit():  # a hard address-space cap so an over-large math case fails instead of OOM-killing
        cap = int(mem_limit_gb * 2**30) + 6 * 2**30  # + virtual-address overhead of torch/OpenMP
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    r = subprocess.run(cmd, capture_output=True, text=True, env=env,
                       preexec_fn=limit if spec["device"] == "cpu" else None)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return dict(ok=False, error=f"exit {r.returncode}: {r.stderr.strip()[-300:]}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--configs", default="8/8,8/2", help="Hq/Hkv pairs")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps (1 for N >= 16K on cpu)")
    ap.add_argument("--mem-limit-gb", type=float, default=18.0)
    ap.add_argument("--time-budget-s", type=float, default=3600.0)
    ap.add_argument("--impls", default=None, help="default: cpu,math (cpu) / cuda,flash_attn")
    ap.add_argument("--out", default=None, help="output stem (default results/flashbob_<device>)")
    ap.add_argument("--render", default=None, help="only rewrite the .md next to this .json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))), flush=True)
        return
    if args.render:
        data = json.loads(Path(args.render).read_text())
        impls = list(dict.fromkeys(r["impl"] for r in data["rows"]))
        Path(args.render).with_suffix(".md").write_text(_markdown(data["meta"], data["rows"], impls))
        return

    import torch
    impls = (args.impls or ("cpu,math" if args.device == "cpu" else "cuda,flash_attn")).split(",")
    stem = Path(args.out) if args.out else RESULTS / f"flashbob_{args.device}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    seqlens = [int(x) for x in args.seqlens.split(",")]
    configs = [tuple(int(y) for y in c.split("/")) for c in args.configs.split(",")]
    meta = dict(device=args.device, torch=torch.__version__, threads=torch.get_num_threads(),
                cpu=platform.processor() or platform.machine(), nproc=os.cpu_count(),
                loadavg_start=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                matmul_fp32_gflops=round(_matmul_gflops(args.device), 1), D=args.head_dim,
                mem_limit_gb=args.mem_limit_gb, command=" ".join(sys.argv))
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    print(f"[flashbob bench] {meta}", flush=True)
    rows, t_start = [], time.time()
    for Hq, Hkv in configs:
        skip_reason = {}
        prev_increase = {}
        for N in seqlens:
            for impl in impls:
                row = dict(impl=impl, N=N, Hq=Hq, Hkv=Hkv, D=args.head_dim)
                if impl in skip_reason:
                    row.update(ok=False, skipped=skip_reason[impl])
                elif time.time() - t_start > args.time_budget_s:
                    row.update(ok=False, skipped=f"time budget {args.time_budget_s:.0f} s spent")
                elif impl == "math" and impl in prev_increase and \
                        4 * prev_increase[impl] / 1024 > args.mem_limit_gb:
                    reason = (f"predicted peak {4 * prev_increase[impl] / 1024:.1f} GB "
                              f"(4x N/2's) > limit {args.mem_limit_gb} GB")
                    skip_reason[impl] = reason
                    row.update(ok=False, skipped=reason)
                else:
                    big = args.device == "cpu" and N >= 16384
                    spec = dict(device=args.device, impl=impl, N=N, Hq=Hq, Hkv=Hkv,
                                D=args.head_dim, warmup=0 if big else 1,
                                repeats=1 if big else args.repeats)
                    res = _run_case(spec, args.mem_limit_gb)
                    row.update(res)
                    if res.get("ok"):
                        part = "fwd_bwd" if impl == "flash_attn" else "step"
                        row["gflops"] = _flops(N, Hq, args.head_dim, part) / res["median_s"] / 1e9
                        prev_increase[impl] = res["peak_increase_mb"]
                    else:
                        skip_reason[impl] = f"failed at N={N}: {res.get('error', '')[:120]}"
                rows.append(row)
                print(f"[flashbob bench] {json.dumps(row)}", flush=True)
                stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    meta["loadavg_end"] = os.getloadavg()
    meta["wall_s"] = round(time.time() - t_start, 1)
    stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    stem.with_suffix(".md").write_text(_markdown(meta, rows, impls))
    print(stem.with_suffix(".md").read_text())


def _markdown(meta, rows, impls) -> str:
    mem_key = "peak_cuda_mb" if meta["device"] == "cuda" else "peak_rss_mb"
    lines = [f"# FlashBoB second-order attention step ({meta['device']})", "",
             f"{meta['date']}; torch {meta['torch']}, {meta['threads']} threads, "
             f"{meta.get('gpu', meta['cpu'])}; D={meta['D']}, B=1, causal. "
             f"Measured fp32 matmul: **{meta['matmul_fp32_gflops']} GFLOP/s**. "
             f"Load average at start/end: {meta['loadavg_start'][0]:.1f} / "
             f"{meta.get('loadavg_end', [float('nan')])[0]:.1f} (the machine is shared).", "",
             f"Command: `{meta['command']}`", "",
             "Step = forward + first grad (create_graph) + grad of Σ<U,dX> (flash_attn: fwd+bwd). "
             "Memory: peak RSS of the case's own process (increase over post-import RSS in "
             "parentheses)" + (" / CUDA max allocated" if meta["device"] == "cuda" else "") + ".", ""]
    extra = " BoB alone (s) | BoB / flash_attn fwd+bwd |" if meta["device"] == "cuda" else ""
    hdr = "| Hq/Hkv | N | " + " | ".join(f"{i} time (s) | {i} peak MB | {i} GFLOP/s"
                                         for i in impls) + " |" + extra + " speedup | memory ratio |"
    lines += [hdr, "|" + "---|" * (2 + 3 * len(impls) + 2 + (2 if extra else 0))]
    keyed = {(r["impl"], r["Hq"], r["Hkv"], r["N"]): r for r in rows}
    for Hq, Hkv, N in sorted({(r["Hq"], r["Hkv"], r["N"]) for r in rows}, key=lambda x: (-x[1], x[2])):
        cells = [f"{Hq}/{Hkv}", str(N)]
        got = {}
        for i in impls:
            r = keyed.get((i, Hq, Hkv, N), {})
            if r.get("ok"):
                got[i] = r
                mem = r.get(mem_key, r.get("peak_rss_mb"))
                inc = f" ({r['peak_increase_mb']:.0f})" if meta["device"] == "cpu" else ""
                cells += [f"{r['median_s']:.3f}", f"{mem:.0f}{inc}", f"{r['gflops']:.1f}"]
            else:
                why = r.get("skipped") or r.get("error", "not run")
                cells += [f"— ({why})", "—", "—"]
        a, b = impls[0], impls[1] if len(impls) > 1 else None
        if meta["device"] == "cuda" and a in got:
            cells.append(f"{got[a]['bob_median_s']:.4f}" if got[a].get("bob_median_s") else "—")
            cells.append(f"{got[a]['bob_median_s'] / got[b]['median_s']:.2f}x"
                         if b in got and got[a].get("bob_median_s") else "—")
        elif meta["device"] == "cuda":
            cells += ["—", "—"]
        if b and a in got and b in got:
            ma, mb = got[a].get(mem_key, 0), got[b].get(mem_key, 0)
            if meta["device"] == "cpu":
                ma, mb = got[a]["peak_increase_mb"], got[b]["peak_increase_mb"]
            cells += [f"{got[b]['median_s'] / got[a]['median_s']:.2f}x",
                      f"{ma / max(mb, 1e-9):.3f}"]
        else:
            cells += ["—", "—"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"speedup = {impls[1] if len(impls) > 1 else ''} time / {impls[0]} time; "
              f"memory ratio = {impls[0]} / {impls[1] if len(impls) > 1 else ''} "
              + ("peak increase over post-import RSS." if meta["device"] == "cpu" else
                 "CUDA max allocated (for flash_attn the time ratio is BoB step / fwd+bwd).")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
