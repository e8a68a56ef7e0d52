"""Benchmark the FlashBoB second-order attention step against PyTorch math attention, with every
timed result checked against the reference and every rate checked against this run's peak.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/flashbob.py            # CPU table (~5 min)
    .venv/bin/python benchmarks/flashbob.py --seqlens 1024 --configs 8/8   # quick look
    .venv/bin/python benchmarks/flashbob.py --device cuda                  # on a GPU box

One "step" is what the meta-gradient does with an attention layer: forward, first gradient with
create_graph=True, then the gradient of Φ = Σ <U_X, dX> (X = Q, K, V) w.r.t. Q, K, V. Shapes:
B=1, H_q=8 with H_kv in {8, 2} (MHA and GQA), D=64, causal, N in --seqlens.

Honesty rules (a result that breaks one is an error: the row says why and the exit code is 1):
  * every timed repeat is checked: its seven outputs (O, dQ, dK, dV, Q̄, K̄, V̄; flash_attn: the
    first four) are fingerprinted; the first repeat's outputs, and any repeat whose fingerprint
    differs, are compared by a separate process with the float64 reference
    (ds_ttt.ops.flashbob.reference, one query head at a time) within a tolerance derived from
    the float32 reference's own error (CHECK_FACTOR x, plus a floor of CHECK_FLOOR_ULPS ulps);
  * timing: `--repeats` timed steps after `--warmup`; the table gives the median and the range;
    wall time and process CPU time are both recorded, and CPU time above wall time x threads
    (more parallelism than the process has) is an error;
  * peak: the fp32 matmul rate is measured before every case and at the end (wall GFLOP/s and
    GFLOP per CPU-second); the run's peak is the maximum. A case whose wall rate exceeds the wall
    peak, or whose rate per CPU-second exceeds the matmul's per CPU-second, is an error: the FLOP
    count or the timing would be wrong, or the step did not do the work.
GFLOP/s uses the same causal "useful" FLOP count for every implementation: fwd 4·N²·d, first
backward 10·N²·d, BoB 36·N²·d per query head, halved for causal.

Each (impl, shape) runs in its own subprocess (benchmarks/flashbob_step.py --worker; the check in
another, --checker) so peak memory is clean: peak RSS on CPU (ru_maxrss) and its increase over the
process's RSS after imports; torch.cuda.max_memory_allocated on CUDA. The kernel source's SHA-256 is recorded per case (a mid-run rebuild would show).
Implementations:
  cpu   : ds_ttt.ops.flashbob.attention(backend="cpu")  (C++ tiled, O(N·d) extra memory)
  math  : F.scaled_dot_product_attention under SDPBackend.MATH (stores N×N tensors)
  cuda  : backend="cuda";  flash_attn: flash_attn_func forward+backward (first order only)
Math is skipped above --math-max-n, when its predicted peak (4x the previous N's increase)
exceeds --mem-limit-gb, or after it failed at a smaller N. Cases above --check-max-n are not
run (the float64 reference needs O(N²) memory per head) unless --allow-unchecked, and then are
marked unchecked. Results: benchmarks/results/flashbob_<device>.{json,md}.
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
import tempfile
import time
from pathlib import Path

from flashbob_step import CHECK_FACTOR, CHECK_FLOOR_ULPS, KERNEL_SOURCES

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
STEP_SCRIPT = Path(__file__).resolve().with_name("flashbob_step.py")  # the worker and checker processes
MATMUL_N = {"cpu": 2048, "cuda": 8192}


def _flops(N, Hq, D, part):
    per_head = {"step": 4 + 10 + 36, "fwd_bwd": 4 + 10}[part] * N * N * D / 2  # causal
    return per_head * Hq


# ----------------------------------------------------------------------------- driver (parent)
def _matmul_rates(device: str) -> dict:
    """fp32 matmul: best of 5 in wall GFLOP/s, and GFLOP per process-CPU-second (CPU only)."""
    import torch
    n = MATMUL_N[device]
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b
    best_wall, best_cpu = float("inf"), float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        c0, t0 = time.process_time(), time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best_wall = min(best_wall, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    flop = 2 * n**3
    return dict(wall_gflops=flop / best_wall / 1e9,
                cpu_gflops_per_cpu_s=flop / max(best_cpu, 1e-9) / 1e9 if device == "cpu" else None,
                loadavg=os.getloadavg()[0])


def _child(mode: str, spec: dict, mem_limit_gb: float | None) -> dict:
    cmd = [sys.executable, str(STEP_SCRIPT), f"--{mode}", json.dumps(spec)]

    def limit():  # a hard address-space cap so an over-large math case fails instead of OOM-killing
        cap = int(mem_limit_gb * 2**30) + 6 * 2**30  # + virtual-address overhead of torch/OpenMP
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    r = subprocess.run(cmd, capture_output=True, text=True,
                       preexec_fn=limit if mem_limit_gb and spec["device"] == "cpu" else None)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return dict(ok=False, error=f"{mode} exit {r.returncode}: {r.stderr.strip()[-300:]}")
    return json.loads(lines[-1])


def _judge(row: dict, peak: dict, device: str) -> list[str]:
    """The honesty rules: the reasons this row is an error (empty when it is a result)."""
    errors = []
    if not row.get("unchecked") and not row.get("check", {}).get("ok"):
        bad = [f"{n} err {e['err']:.2e} > tol {e['tol']:.2e}"
               for r in row.get("check", {}).get("results", []) for n, e in r["errors"].items()
               if not e["ok"]]
        errors.append("check against the reference failed: " +
                      ("; ".join(bad[:4]) or row.get("check", {}).get("error", "no result")))
    if row["gflops"] > peak["wall_gflops"]:
        errors.append(f"{row['gflops']:.1f} GFLOP/s is above the run's measured fp32 matmul peak "
                      f"{peak['wall_gflops']:.1f}")
    if device == "cpu":
        per_cpu_s = row["flop"] / statistics.median(row["cpu_s"]) / 1e9
        row["gflops_per_cpu_s"] = per_cpu_s
        if per_cpu_s > peak["cpu_gflops_per_cpu_s"]:
            errors.append(f"{per_cpu_s:.1f} GFLOP per CPU-second is above the matmul's "
                          f"{peak['cpu_gflops_per_cpu_s']:.1f}")
        over = [c / w for c, w in zip(row["cpu_s"], row["times_s"]) if c > 1.05 * w * row["threads"]]
        if over:
            errors.append(f"CPU time {max(over):.2f}x wall time exceeds the {row['threads']} threads")
    return errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--seqlens", default="1024,2048,4096")
    ap.add_argument("--configs", default="8/8,8/2", help="Hq/Hkv pairs")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per case")
    ap.add_argument("--math-max-n", type=int, default=4096)
    ap.add_argument("--check-max-n", type=int, default=4096,
                    help="largest N checked against the float64 reference (O(N²) per head)")
    ap.add_argument("--allow-unchecked", action="store_true",
                    help="also time N above --check-max-n (rows marked unchecked)")
    ap.add_argument("--mem-limit-gb", type=float, default=12.0)
    ap.add_argument("--impls", default=None, help="default: cpu,math (cpu) / cuda,flash_attn")
    ap.add_argument("--out", default=None, help="output stem (default results/flashbob_<device>)")
    ap.add_argument("--render", default=None, help="only rewrite the .md next to this .json")
    args = ap.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(_markdown(data["meta"], data["rows"],
                                                                  data["meta"]["impls"]))
        return 0

    import torch
    impls = (args.impls or ("cpu,math" if args.device == "cpu" else "cuda,flash_attn")).split(",")
    stem = Path(args.out) if args.out else RESULTS / f"flashbob_{args.device}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    seqlens = [int(x) for x in args.seqlens.split(",")]
    configs = [tuple(int(y) for y in c.split("/")) for c in args.configs.split(",")]
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--",
                            *[str(KERNEL_SOURCES[i]) for i in impls if i in KERNEL_SOURCES]],
                           capture_output=True, text=True).stdout.strip()
    meta = dict(device=args.device, impls=impls, torch=torch.__version__,
                threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                cpu=platform.processor() or platform.machine(), nproc=os.cpu_count(),
                affinity=len(os.sched_getaffinity(0)), git=git,
                kernel_sources_dirty=bool(dirty), date=time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                     time.gmtime()),
                D=args.head_dim, warmup=args.warmup, repeats=args.repeats,
                mem_limit_gb=args.mem_limit_gb, check_factor=CHECK_FACTOR,
                check_floor_ulps=CHECK_FLOOR_ULPS, command=" ".join(sys.argv))
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    print(f"[flashbob bench] {meta}", flush=True)
    matmul = []
    rows, t_start = [], time.time()
    for Hq, Hkv in configs:
        skip_reason, prev_increase = {}, {}
        for N in seqlens:
            unchecked = N > args.check_max_n
            shape_rows = []
            with tempfile.TemporaryDirectory(prefix="flashbob_bench_") as tmp:
                for impl in impls:
                    row = dict(impl=impl, N=N, Hq=Hq, Hkv=Hkv, D=args.head_dim,
                               unchecked=unchecked)
                    shape_rows.append(row)
                    if impl in skip_reason:
                        row.update(ok=False, skipped=skip_reason[impl])
                    elif unchecked and not args.allow_unchecked:
                        row.update(ok=False, skipped=f"N > --check-max-n {args.check_max_n} (no "
                                                     "reference check possible; --allow-unchecked)")
                    elif impl == "math" and N > args.math_max_n:
                        row.update(ok=False, skipped=f"N > --math-max-n {args.math_max_n}")
                    elif impl == "math" and impl in prev_increase and \
                            4 * prev_increase[impl] / 1024 > args.mem_limit_gb:
                        reason = (f"predicted peak {4 * prev_increase[impl] / 1024:.1f} GB "
                                  f"(4x N/2's) > limit {args.mem_limit_gb} GB")
                        skip_reason[impl] = reason
                        row.update(ok=False, skipped=reason)
                    else:
                        matmul.append(_matmul_rates(args.device))
                        save_dir = None if unchecked else str(Path(tmp) / impl)
                        if save_dir:
                            Path(save_dir).mkdir()
                        spec = dict(device=args.device, impl=impl, N=N, Hq=Hq, Hkv=Hkv,
                                    D=args.head_dim, warmup=args.warmup, repeats=args.repeats,
                                    save_dir=save_dir)
                        res = _child("worker", spec, args.mem_limit_gb)
                        row.update(res)
                        if res.get("ok"):
                            part = "fwd_bwd" if impl == "flash_attn" else "step"
                            row["flop"] = _flops(N, Hq, args.head_dim, part)
                            row["gflops"] = row["flop"] / res["median_s"] / 1e9
                            prev_increase[impl] = res["peak_increase_mb"]
                        else:
                            skip_reason[impl] = f"failed at N={N}: {res.get('error', '')[:120]}"
                    print(f"[flashbob bench] {json.dumps(row)}", flush=True)
                to_check = {r["impl"]: r["saved"] for r in shape_rows
                            if r.get("ok") and not unchecked}
                if to_check:
                    spec = dict(device=args.device, N=N, Hq=Hq, Hkv=Hkv, D=args.head_dim,
                                threads=torch.get_num_threads(), saved=to_check)
                    checked = _child("checker", spec, None)
                    for r in shape_rows:
                        if r["impl"] in to_check:
                            r["check"] = checked.get(r["impl"], dict(ok=False, error=checked.get(
                                "error", "checker returned nothing")))
                            print(f"[flashbob bench] check {r['impl']} N={N} {Hq}/{Hkv}: "
                                  f"ok={r['check'].get('ok')}", flush=True)
            rows += shape_rows
            stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    matmul.append(_matmul_rates(args.device))
    peak = dict(wall_gflops=max(m["wall_gflops"] for m in matmul),
                cpu_gflops_per_cpu_s=max((m["cpu_gflops_per_cpu_s"] or 0) for m in matmul) or None)
    n_errors = 0
    for row in rows:
        if row.get("ok"):
            row["errors"] = _judge(row, peak, args.device)
            n_errors += bool(row["errors"])
    shas = {r.get("source_sha") for r in rows if r.get("source_sha")}
    meta.update(matmul=matmul, peak=peak, loadavg_end=os.getloadavg(), wall_s=round(time.time() - t_start, 1),
                kernel_source_shas=sorted(shas), n_errors=n_errors)
    if len(shas) > 1:
        meta["error"] = "the kernel source changed during the run"
        n_errors += 1
    stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    stem.with_suffix(".md").write_text(_markdown(meta, rows, impls))
    print(stem.with_suffix(".md").read_text())
    if n_errors:
        print(f"[flashbob bench] {n_errors} ERROR(S): see the table", file=sys.stderr)
    return 1 if n_errors else 0


def _markdown(meta, rows, impls) -> str:
    cpu = meta["device"] == "cpu"
    mem_key = "peak_cuda_mb" if not cpu else "peak_rss_mb"
    peak = meta.get("peak", {})
    mm = meta.get("matmul", [])
    lines = [f"# FlashBoB second-order attention step ({meta['device']})", "",
             f"{meta['date']}; git {meta.get('git')}; torch {meta['torch']}, "
             f"{meta['threads']} torch threads (OMP_NUM_THREADS={meta.get('omp_num_threads')}), "
             f"{meta.get('gpu', meta['cpu'])}, {meta.get('affinity', meta['nproc'])} CPUs; "
             f"D={meta['D']}, B=1, causal; {meta.get('warmup')} warm-up + {meta.get('repeats')} "
             "timed steps per case.", "",
             f"fp32 matmul measured {len(mm)} times in this run (before each case and at the end): "
             f"wall {min((m['wall_gflops'] for m in mm), default=float('nan')):.1f}–"
             f"**{peak.get('wall_gflops', float('nan')):.1f} GFLOP/s** (peak = max)"
             + (f", **{peak['cpu_gflops_per_cpu_s']:.1f} GFLOP per CPU-second**"
                if peak.get("cpu_gflops_per_cpu_s") else "") +
             f". Load average during the run: {min((m['loadavg'] for m in mm), default=0):.1f}–"
             f"{max((m['loadavg'] for m in mm), default=0):.1f} (the machine is shared; wall "
             "times scale with it, CPU-seconds much less).", "",
             f"Command: `{meta['command']}`", "",
             "Step = forward + first grad (create_graph) + grad of Σ<U,dX> (flash_attn: fwd+bwd). "
             "Time: median of the timed steps (min–max). Check: largest error of any output "
             "against the float64 reference, as a fraction of its tolerance (≤ 1 passes; every "
             "distinct result of the timed steps is checked). Memory: peak RSS of the case's own "
             "process (increase over post-import RSS in parentheses)"
             + (" / CUDA max allocated" if not cpu else "") + ".", ""]
    per_cpu = " | GFLOP/CPU-s" if cpu else ""
    hdr = "| Hq/Hkv | N | impl | time (s) | GFLOP/s" + per_cpu + " | check (err/tol) | peak MB | status |"
    lines += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    keyed = {(r["impl"], r["Hq"], r["Hkv"], r["N"]): r for r in rows}
    for Hq, Hkv, N in sorted({(r["Hq"], r["Hkv"], r["N"]) for r in rows},
                             key=lambda x: (-x[1], x[2])):
        for i in impls:
            r = keyed.get((i, Hq, Hkv, N))
            if r is None:
                continue
            cells = [f"{Hq}/{Hkv}", str(N), i]
            if r.get("ok"):
                mem = r.get(mem_key, r.get("peak_rss_mb"))
                inc = f" ({r['peak_increase_mb']:.0f})" if cpu else ""
                if r.get("unchecked"):
                    chk = "unchecked"
                elif r.get("check", {}).get("results"):
                    worst = max(e["err"] / max(e["tol"], 1e-300) for res in r["check"]["results"]
                                for e in res["errors"].values())
                    chk = f"{worst:.2g} ({len(r['check']['results'])} distinct)"
                else:
                    chk = "check failed to run: " + str(r.get("check", {}).get("error", ""))[:80]
                cells += [f"{r['median_s']:.3f} ({r['min_s']:.3f}–{r['max_s']:.3f})",
                          f"{r['gflops']:.1f}"]
                if cpu:
                    cells.append(f"{r.get('gflops_per_cpu_s', float('nan')):.1f}")
                cells += [chk, f"{mem:.0f}{inc}",
                          "**ERROR: " + "; ".join(r["errors"]) + "**" if r.get("errors") else "ok"]
            else:
                why = r.get("skipped") or r.get("error", "not run")
                cells += ["—", "—"] + (["—"] if cpu else []) + ["—", "—", f"not run: {why}"]
            lines.append("| " + " | ".join(cells) + " |")
    if len(impls) > 1:
        lines += _ratio_table(rows, impls, keyed, cpu, mem_key)
    if meta.get("notes"):  # analysis written into the .json's meta.notes (kept by --render)
        lines += ["", meta["notes"].rstrip()]
    if meta.get("error"):
        lines += ["", f"**RUN ERROR: {meta['error']}** (kernel source SHA-256s: "
                  f"{meta.get('kernel_source_shas')})"]
    return "\n".join(lines) + "\n"


def _ratio_table(rows, impls, keyed, cpu, mem_key) -> list[str]:
    lines = []
    lines += ["", "Ratios measured side by side in this run (median times):", "",
              "| Hq/Hkv | N | " + " | ".join(f"{b} / {impls[0]} time" for b in impls[1:]) +
              " | memory " + impls[0] + " / " + (impls[1] if len(impls) > 1 else "") + " |",
              "|" + "---|" * (3 + max(len(impls) - 1, 0))]
    for Hq, Hkv, N in sorted({(r["Hq"], r["Hkv"], r["N"]) for r in rows}, key=lambda x: (-x[1], x[2])):
        a = keyed.get((impls[0], Hq, Hkv, N), {})
        cells = [f"{Hq}/{Hkv}", str(N)]
        for b_name in impls[1:]:
            b = keyed.get((b_name, Hq, Hkv, N), {})
            ok = a.get("ok") and b.get("ok") and not a.get("errors") and not b.get("errors")
            cells.append(f"{b['median_s'] / a['median_s']:.2f}x" if ok else "—")
        b = keyed.get((impls[1], Hq, Hkv, N), {}) if len(impls) > 1 else {}
        if a.get("ok") and b.get("ok"):
            ka = "peak_increase_mb" if cpu else mem_key
            cells.append(f"{a[ka] / max(b[ka], 1e-9):.3f}")
        else:
            cells.append("—")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
