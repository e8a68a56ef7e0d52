"""First contact with a GPU: the steps that say most about what is wrong, each in its own process.

    python gpu_check/first_contact.py probe   --out probe.json
    python gpu_check/first_contact.py kernels --launcher fwd|bwd|bwd_bwd|all --out k.json [--n 96]
                                               [--first-case-only]

gpu_check/gpu_check.py runs these as its `probe`, `kernels` and `sanitizer` phases, in this
order and each in a fresh process, so an illegal address in one kernel (which poisons the CUDA
context of its process) cannot hide the diagnosis of the next; every step writes its JSON before
the next starts.

probe    The tensor-core probe (csrc/mma_probe.cu: ldmatrix in all six forms, mma.sync with exactly
         summable and with random inputs, ldmatrix -> mma, cp.async with zero fill, bf16x2/f16x2
         packing) on the GPU, against the PTX ISA's fragment tables written out in Python
         (tests/unit/mma_probe_cases.py), with every lane of every case saved: the GPU's registers,
         the expected ones, and the mismatches as (lane, register, got, expected). No emulator
         build is needed on the device. Exact cases must match bit for bit; random mma within
         ACC_ULPS fp32 ulps of sum |a*b| + |c| (tensor cores truncate addends when aligning).
kernels  One launcher (fwd: fwd_kernel; bwd: bwd_row_kernel, bwd_col_kernel; bwd_bwd:
         bob_stats_kernel, bob_row_kernel, bob_col_kernel) at small N, meant to run under
         CUDA_LAUNCH_BLOCKING=1 so a fault is reported by the kernel it happened in (the binding
         names flashbob::last_launched_kernel). The launcher is fed float64-reference inputs where
         it takes them (o and stats come from fwd_kernel, checked first), and each output is
         compared with the float64 reference under the tests' derived tolerance (k x the
         reference's own bf16/fp16 error + 4 ulps); a wrong output names the kernel that writes
         it and its first wrong element (index, got, expected, tolerance). Outputs written by a
         later kernel from an earlier one's results (bwd_col_kernel uses D from bwd_row_kernel;
         the BoB output passes use D, α, E° from bob_stats_kernel) are checked after them, so the
         first kernel reported wrong is the one to fix.

Exit 0 when everything matched, 1 otherwise (the JSON says what), 2 on bad arguments / no GPU.
gpu_check/tests/test_gpu_check.py runs both steps on the CPU with the emulated kernels as the
"GPU", and with a deliberately corrupted output, to show what a failure report looks like.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

from gpu_results import write_json_atomic  # noqa: E402

ACC_ULPS = 18  # as tests/ops/test_mma_probe_cuda.py: k + 2 for k = 16 addends
MAX_MISMATCHES = 32  # listed per case (the count is always complete)

# Which kernel writes which output, in launch order (flashbob_cuda_kernel.cu).
KERNEL_OUTPUTS = {
    "fwd": [("fwd_kernel", ("o",))],
    "bwd": [("bwd_row_kernel", ("dq",)), ("bwd_col_kernel", ("dk", "dv"))],
    "bwd_bwd": [("bob_stats_kernel", ("delta", "alpha", "e0", "dobar")),
                ("bob_row_kernel", ("qbar",)), ("bob_col_kernel", ("kbar", "vbar"))],
}
KERNELS = [k for steps in KERNEL_OUTPUTS.values() for k, _ in steps]
FACTORS = dict(o=2.0, dq=3.0, dk=3.0, dv=3.0, qbar=4.0, kbar=4.0, vbar=4.0, dobar=4.0,
               delta=4.0, alpha=4.0, e0=4.0)
# (label, B, Hq, Hkv, N, D, dtype, kwargs): GQA, causal, a window, both head dims and dtypes.
KERNEL_CASES = [("gqa_causal_d128_bf16", 1, 4, 2, None, 128, torch.bfloat16, dict(causal=True, window=0)),
                ("gqa_window_d64_fp16", 1, 4, 2, None, 64, torch.float16, dict(causal=True, window=40))]


# ---- probe -----------------------------------------------------------------------------------------

def probe_cases():
    """(name, case, kind) for every probe the GPU test runs (tests/ops/test_mma_probe_cuda.py)."""
    from tests.unit import mma_probe_cases as mc

    out = []
    for variant in sorted(mc.LDMATRIX_VARIANTS):
        for seed in (0, 1):
            num, trans = mc.LDMATRIX_VARIANTS[variant]
            out.append((f"ldmatrix_x{num}{'_trans' if trans else ''}_seed{seed}",
                        mc.ldmatrix_case(variant, nthreads=64, seed=seed), "ldmatrix"))
    for dt, tag in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
        for alias in (False, True):
            out.append((f"mma_exact_{tag}_{'d_is_c' if alias else 'd_new'}",
                        mc.mma_case(dt, alias, nthreads=64, seed=3, exact=True), "mma_exact"))
        out.append((f"mma_random_{tag}", mc.mma_case(dt, False, nthreads=64, seed=4, exact=False),
                    "mma_random"))
        for kn in (False, True):
            out.append((f"ldmatrix_mma_{tag}_{'B_kn_trans' if kn else 'B_nk'}",
                        mc.ldmatrix_mma_case(dt, kn, nthreads=64, seed=6), "ldmatrix_mma"))
    out.append(("cp_async_zfill", mc.cp_async_case(nthreads=128, seed=8), "cp_async"))
    out.append(("cp_async_small_zfill", mc.cp_async_case(nthreads=128, seed=8, variant=1), "cp_async"))
    out.append(("pack_bf16x2_f16x2", mc.pack_case(), "pack"))
    return out


def _u32(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFF for v in t.to(torch.int64).tolist()]


def expected_outputs(case, kind: str):
    """(expected out_u or None, expected out_f or None, f tolerance per element or None,
    mask of the elements that are defined (None: all)) from the ISA tables."""
    from tests.unit import mma_probe_cases as mc

    if kind == "ldmatrix":
        return mc.ldmatrix_expected_all(case), None, None, None
    if kind in ("mma_exact", "mma_random"):
        mats = case.info["mats"]
        exp = torch.cat([mc.c_lanes(mc.mma_reference(A, B, C)) for A, B, C in mats]).reshape(-1)
        if kind == "mma_exact":
            return None, exp, None, None
        scale = torch.cat([mc.c_lanes((A.double().abs() @ B.double().abs() + C.double().abs()).float())
                           for A, B, C in mats]).reshape(-1).double()
        return None, exp, ACC_ULPS * 2.0**-23 * scale, None
    if kind == "ldmatrix_mma":
        mats = case.info["mats"]
        exp = torch.cat([(A.double() @ B.double()).reshape(-1) for A, B in mats])
        scale = torch.cat([(A.double().abs() @ B.double().abs()).reshape(-1) for A, B in mats])
        return None, exp.float(), ACC_ULPS * 2.0**-23 * scale, None
    if kind == "cp_async":
        exp, done = mc.cp_async_expected(case)
        return torch.cat(exp), None, None, torch.cat(done)
    if kind == "pack":
        u, f = mc.pack_expected(case)
        return u, f, None, None
    raise ValueError(f"unknown probe kind {kind!r}")


def compare_probe(name: str, kind: str, case, got_u: torch.Tensor, got_f: torch.Tensor) -> dict:
    """Every lane saved, and the mismatches as (lane, register, got, expected)."""
    exp_u, exp_f, tol_f, mask = expected_outputs(case, kind)
    regs = 4 if kind in ("ldmatrix", "mma_exact", "mma_random") else None  # registers per lane
    res = {"name": name, "kind": kind, "nthreads": case.nthreads, "got_u": _u32(got_u),
           "got_f": got_f.tolist(), "expected_u": None if exp_u is None else _u32(exp_u),
           "expected_f": None if exp_f is None else exp_f.tolist(), "mismatches": [], "num_mismatches": 0}
    if mask is not None:
        res["defined"] = mask.tolist()

    def where(i: int) -> dict:
        return {"index": i, "lane": i // regs % 32, "warp": i // regs // 32, "register": i % regs} if regs \
            else {"index": i}

    bad = []
    if exp_u is not None:
        diff = got_u.to(torch.int64) != exp_u.to(torch.int64)
        if mask is not None:
            diff &= mask
        bad += [("u", i) for i in diff.nonzero().flatten().tolist()]
    if exp_f is not None:
        if tol_f is None:
            diff = ~((got_f == exp_f) | (torch.isnan(got_f) & torch.isnan(exp_f)))
        else:
            diff = ~((got_f.double() - exp_f.double()).abs() <= tol_f)
        bad += [("f", i) for i in diff.nonzero().flatten().tolist()]
    res["num_mismatches"] = len(bad)
    for which, i in bad[:MAX_MISMATCHES]:
        got = res["got_u"][i] if which == "u" else res["got_f"][i]
        exp = res["expected_u"][i] if which == "u" else res["expected_f"][i]
        item = {"output": which, **where(i), "got": got, "expected": exp}
        if which == "f" and tol_f is not None:
            item["tolerance"] = float(tol_f[i])
        res["mismatches"].append(item)
    res["ok"] = not bad
    return res


def run_probe(probe, out: Path) -> dict:
    """Run every case on `probe` (mma_probe_cases.Probe); rewrite `out` after each case."""
    report = {"step": "probe", "ok": False, "cases": [], "device": probe.device}
    t0 = time.perf_counter()
    for name, case, kind in probe_cases():
        try:
            got_u, got_f = probe.run_case(case)
            res = compare_probe(name, kind, case, got_u, got_f)
        except Exception as exc:  # noqa: BLE001 - a fault is the result; the context may be gone
            res = {"name": name, "kind": kind, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            report["cases"].append(res)
            report["error"] = f"probe {name} raised; later cases not run (the CUDA context may be lost)"
            break
        report["cases"].append(res)
        report["seconds"] = round(time.perf_counter() - t0, 2)
        write_json_atomic(out, report)
    report["ok"] = "error" not in report and all(c["ok"] for c in report["cases"])
    report["summary"] = probe_summary(report)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    write_json_atomic(out, report)
    return report


def probe_summary(report: dict) -> str:
    bad = [c for c in report["cases"] if not c["ok"]]
    if not bad:
        return f"all {len(report['cases'])} probe cases match the ISA tables"
    parts = []
    for c in bad[:6]:
        if "error" in c:
            parts.append(f"{c['name']}: {c['error'][:300]}")
        else:
            m = c["mismatches"][0]
            at = (f"warp {m['warp']} lane {m['lane']} reg {m['register']}" if "lane" in m
                  else f"element {m['index']}")
            parts.append(f"{c['name']}: {c['num_mismatches']} wrong, first at {at}: got {m['got']}, "
                         f"expected {m['expected']}")
    return f"{len(bad)} of {len(report['cases'])} probe cases wrong: " + "; ".join(parts)


# ---- kernels ---------------------------------------------------------------------------------------

def _expand(t: torch.Tensor, G: int) -> torch.Tensor:
    return t.repeat_interleave(G, dim=1)


def row_scalars_reference(x: dict, *, causal: bool, window: int, scale: float, dtype=torch.float64):
    """D = <dO, O>, α = Σ_j P∘F, E° = Σ_j P∘P̄° per query row (flashbob_math.md), dense, in `dtype`
    (float64: the reference; bf16/fp16: the same formulas at low precision, for the tolerance)."""
    from ds_ttt.ops.flashbob.reference import visibility_mask

    q, k, v, do, uq, uk, uv = (x[n].to(dtype) for n in ("q", "k", "v", "do", "uq", "uk", "uv"))
    G = q.shape[1] // k.shape[1]
    k, v, uk, uv = (_expand(t, G) for t in (k, v, uk, uv))
    Nq, Nk = q.shape[2], k.shape[2]
    mask = visibility_mask(Nq, Nk, causal=causal, window=window, q_offset=Nk - Nq, k_offset=0).to(q.device)
    s = (q @ k.transpose(-1, -2)).float() * scale if dtype != torch.float64 else (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0).to(dtype)
    o = p @ v
    delta = (do.double() * o.double()).sum(-1) if dtype == torch.float64 else (do.float() * o.float()).sum(-1)
    f = (uq @ k.transpose(-1, -2) + q @ uk.transpose(-1, -2)) * scale
    c = do @ uv.transpose(-1, -2)
    dp = do @ v.transpose(-1, -2)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    p, f, c, dp = (t.to(acc) for t in (p, f, c, dp))
    pbar0 = c + f * (dp - delta.to(acc).unsqueeze(-1))
    return {"delta": delta.to(acc), "alpha": (p * f).sum(-1), "e0": (p * pbar0).sum(-1)}


def first_wrong(got: torch.Tensor, ref: torch.Tensor, tol: float) -> dict | None:
    """The first element (row-major) that is non-finite or off by more than `tol`."""
    g, r = got.double().cpu(), ref.double().cpu()
    bad = ~torch.isfinite(g) | ((g - r).abs() > tol)
    if not bool(bad.any()):
        return None
    flat = int(bad.reshape(-1).nonzero()[0])
    idx = list(torch.unravel_index(torch.tensor(flat), g.shape))
    return {"index": [int(i) for i in idx], "got": float(g.reshape(-1)[flat]), "expected": float(r.reshape(-1)[flat]),
            "num_wrong": int(bad.sum()), "of": g.numel()}


def check_output(name: str, got: torch.Tensor, ref64: torch.Tensor, ref_lp: torch.Tensor, dtype) -> dict:
    from tests.unit.flashbob_cases import derived_tol

    ref64, ref_lp, got_c = (t.detach().double().cpu() for t in (ref64, ref_lp, got))
    err_ref = float((ref_lp - ref64).abs().max())
    tol = derived_tol(err_ref, ref64, dtype, FACTORS[name])
    finite = bool(torch.isfinite(got_c).all())
    err = float((got_c - ref64).abs().max()) if finite else float("inf")
    res = {"output": name, "max_err": err, "ref_lowprec_err": err_ref, "tolerance": tol, "ok": finite and err <= tol}
    if not res["ok"]:
        res["first_wrong"] = first_wrong(got_c, ref64, tol)
    return res


def run_launcher(op, launcher: str, *, n: int, device: str, out: Path | None = None, cases=None) -> dict:
    """Run one launcher of `op` (the CUDA extension, or the emulator in tests) on each KERNEL_CASE
    and check every output against the float64 reference; returns {kernel: verdict, ...}."""
    from tests.unit.flashbob_cases import make_inputs, second_order

    report = {"step": f"kernels:{launcher}", "n": n, "device": device, "ok": False, "cases": []}
    t0 = time.perf_counter()
    cases = KERNEL_CASES if cases is None else cases
    for label, B, Hq, Hkv, _, D, dtype, kw in cases:
        case = {"case": label, "shape": [B, Hq, Hkv, n, D], "dtype": str(dtype).split(".")[-1], **kw,
                "kernels": {}}
        report["cases"].append(case)
        x64 = make_inputs(B, Hq, Hkv, n, n, D, seed=1)
        scale = D ** -0.5
        ref64 = second_order(x64, backend="reference", dtype=torch.float64, **kw)
        ref_lp = second_order(x64, backend="reference", dtype=dtype, device=device, **kw)
        if launcher == "bwd_bwd":
            ref64.update(row_scalars_reference(x64, scale=scale, **kw))
            x_lp = {k: t.to(device=device, dtype=dtype) for k, t in x64.items()}
            ref_lp.update(row_scalars_reference(x_lp, scale=scale, dtype=dtype, **kw))
        x = {k: t.to(device=device, dtype=dtype).contiguous() for k, t in x64.items()}
        args = (kw["causal"], kw["window"], 0, 0, scale)
        current = "fwd_kernel"
        try:
            outs = {}
            o, stats = op.fwd(x["q"], x["k"], x["v"], *args)
            _sync(device)
            outs["o"] = o
            if launcher != "fwd":
                fwd_check = check_output("o", o, ref64["o"], ref_lp["o"], dtype)
                case["fwd_kernel_input_check"] = fwd_check
                if not fwd_check["ok"]:
                    raise _InputWrong("fwd_kernel's o (an input of this launcher) is wrong: "
                                      "fix fwd_kernel first (its own step says where)")
            if launcher == "bwd":
                current = "bwd_row_kernel"
                outs["dq"], outs["dk"], outs["dv"] = op.bwd(x["q"], x["k"], x["v"], o, stats, x["do"], *args)
                _sync(device)
            elif launcher == "bwd_bwd":
                current = "bob_stats_kernel"
                dq = ref_lp["dq"].to(device=device, dtype=dtype).contiguous()  # unused by the kernels
                r = op.bwd_bwd(x["q"], x["k"], x["v"], o, stats, x["do"], dq, x["uq"], x["uk"], x["uv"], *args)
                _sync(device)
                for name, t in zip(("qbar", "kbar", "vbar", "dobar", "delta", "alpha", "e0"), r):
                    outs[name] = t
        except _InputWrong as exc:
            case["error"] = str(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - a fault: the binding's message names the kernel
            msg = f"{type(exc).__name__}: {exc}"
            named = next((k for k in KERNELS if k in msg), None)
            case["error"] = msg[:2000]
            case["kernels"][named or current] = {"ok": False, "error": msg[:2000],
                                                 "named_by": "the binding" if named else "launch order"}
            case["traceback"] = traceback.format_exc()[-2000:]
            break  # the context may be poisoned: nothing after this is trustworthy
        for kernel, names in KERNEL_OUTPUTS[launcher]:
            checks = [check_output(nm, outs[nm], ref64[nm], ref_lp[nm], dtype) for nm in names]
            case["kernels"][kernel] = {"ok": all(c["ok"] for c in checks), "outputs": checks}
        if out is not None:
            write_json_atomic(out, report)
    report["ok"] = all("error" not in c and all(k["ok"] for k in c["kernels"].values()) for c in report["cases"]) \
        and len(report["cases"]) == len(cases)
    report["summary"] = kernels_summary(report)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    if out is not None:
        write_json_atomic(out, report)
    return report


class _InputWrong(Exception):
    pass


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def kernels_summary(report: dict) -> str:
    parts = []
    for c in report["cases"]:
        for kernel, v in c["kernels"].items():
            if v["ok"]:
                continue
            if "error" in v:
                parts.append(f"{kernel} ({c['case']}): {v['error'][:300]}")
                continue
            for o in v["outputs"]:
                if not o["ok"]:
                    fw = o.get("first_wrong") or {}
                    parts.append(f"{kernel} ({c['case']}): {o['output']} max err {o['max_err']:.3g} > tol "
                                 f"{o['tolerance']:.3g}; first wrong {o['output']}{fw.get('index')}: got "
                                 f"{fw.get('got')}, expected {fw.get('expected')} ({fw.get('num_wrong')} of "
                                 f"{fw.get('of')} wrong)")
        if "error" in c and not c["kernels"]:
            parts.append(f"{c['case']}: {c['error'][:300]}")
    if not parts:
        names = [k for k, _ in KERNEL_OUTPUTS[report["step"].split(":")[1]]]
        return f"{', '.join(names)} match the float64 reference in {len(report['cases'])} cases at N={report['n']}"
    return "; ".join(parts)


# ---- command line ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=("probe", "kernels"))
    ap.add_argument("--out", required=True, help="JSON file to (re)write")
    ap.add_argument("--launcher", choices=tuple(KERNEL_OUTPUTS) + ("all",),
                    help="kernels: which launcher (all: the three in turn, for compute-sanitizer)")
    ap.add_argument("--n", type=int, default=96, help="kernels: sequence length (default %(default)s)")
    ap.add_argument("--first-case-only", action="store_true",
                    help="kernels: only the first shape (under compute-sanitizer, which is slow)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("[first_contact] refused: no CUDA device visible", file=sys.stderr)
        return 2
    out = Path(a.out)
    if a.step == "probe":
        from ds_ttt.ops.flashbob.probe_builder import load_probe_cuda
        from tests.unit import mma_probe_cases as mc

        try:
            probe = mc.Probe(load_probe_cuda(), "cuda")
        except Exception as exc:  # noqa: BLE001
            write_json_atomic(out, {"step": "probe", "ok": False, "error": f"probe build/load: {exc}"[:3000],
                                    "summary": f"probe did not load: {exc}"[:500]})
            print(f"[probe] FAILED to load: {exc}", flush=True)
            return 1
        report = run_probe(probe, out)
        from ds_ttt.ops.flashbob.builder import load_info

        report["load"] = load_info()
        write_json_atomic(out, report)
        print(f"[probe] {'OK' if report['ok'] else 'FAILED'}: {report['summary']}", flush=True)
        return 0 if report["ok"] else 1
    if a.launcher is None:
        ap.error("kernels needs --launcher")
    from ds_ttt.ops.flashbob.builder import load_cuda_op

    from ds_ttt.ops.flashbob.builder import load_info

    cases = KERNEL_CASES[:1] if a.first_case_only else KERNEL_CASES
    reports = {}
    for launcher in (tuple(KERNEL_OUTPUTS) if a.launcher == "all" else (a.launcher,)):
        part = out if a.launcher != "all" else out.with_name(f"{out.stem}.{launcher}{out.suffix}")
        report = run_launcher(load_cuda_op(), launcher, n=a.n, device="cuda", out=part, cases=cases)
        report["load"] = load_info()
        write_json_atomic(part, report)
        reports[launcher] = report
        print(f"[kernels:{launcher}] {'OK' if report['ok'] else 'FAILED'}: {report['summary']}", flush=True)
    if a.launcher == "all":
        write_json_atomic(out, {"step": "kernels:all", "ok": all(r["ok"] for r in reports.values()),
                                "launchers": reports})
    return 0 if all(r["ok"] for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
