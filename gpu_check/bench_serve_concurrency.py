"""GPU check phase `serve_concurrency`: batched decode at 1, 8 and 32 sessions on a Qwen3-0.6B-shaped model.

    python gpu_check/bench_serve_concurrency.py --out DIR/serve_concurrency_gpu.json [--budget-s 90]
    (run by gpu_check/run.sh; needs a CUDA GPU)
    .venv/bin/python gpu_check/bench_serve_concurrency.py --out /tmp/sc.json --device cpu --tiny   # CPU smoke

Runs benchmarks/serve_concurrency.py --device cuda --shape qwen3-0.6b --levels 1,8,32 --only-batched
--max-tokens 32 --repeats 0 --pairs 4 (this tree's OpenAI-compatible server in its own process, random
weights built on the spot: hidden 1024, 28 layers, 16 / 8 heads of 128, intermediate 3072, the main
job's TTT settings and compact vocabulary; no download) in a child killed at the budget, and turns its
serve_concurrency_qwen3-0.6b.json into the phase file: one row per level (decode tokens/s from the
scheduler's own counters, aggregate tokens/s, mean batch, per-token latency), the paired decode ratios
8 vs 1 and 32 vs 1 (median and bootstrap 95% interval over rounds) against the targets (8 sessions
>= 6x one, 32 >= 16x one), what it ran on, and the script's whole JSON under "serve_concurrency". A
missed target is recorded and printed, not a failed check: checks are for what did not run.
--tiny: the main job's tiny-mem backbone and 4-token replies instead (the CPU smoke of this code path).
Without bubblewrap on PATH the export's vocabulary comes from worlds run unsandboxed (--no-isolation).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gpu_check import REPO, Log, last_lines, run_child
from gpu_results import PhaseRecord, read_json

LEVELS = (1, 8, 32)
TARGETS = {8: 6.0, 32: 16.0}  # decode tokens/s at n sessions over one session, at least
MAX_TOKENS = 32  # a reply's length: one session's level lasts about a second on the GPU
PAIRS = 4
SHUTDOWN_S = 15.0  # the child's own budget leaves this for the servers' exit and the result files


def serve_command(python: str, out_dir: Path, budget_s: float, *, device: str = "cuda", tiny: bool = False,
                  sandboxed: bool = True) -> list[str]:
    cmd = [python, str(REPO / "benchmarks" / "serve_concurrency.py"), "--device", device,
           "--shape", "tiny-mem" if tiny else "qwen3-0.6b", "--levels", ",".join(map(str, LEVELS)), "--only-batched",
           "--max-tokens", "4" if tiny else str(MAX_TOKENS), "--repeats", "0", "--pairs", "2" if tiny else str(PAIRS),
           "--max-load", "1e9", "--budget-s", f"{max(budget_s - SHUTDOWN_S, 1):.0f}", "--out", str(out_dir)]
    return cmd if sandboxed else cmd + ["--no-isolation"]


def level_rows(res: dict) -> list[dict]:
    """One row per level from serve_concurrency's JSON (its table's batched server, the paired ratios)."""
    rows = []
    for n in res["levels"]:
        r = res["table"]["batched"][str(n)]
        paired = res["paired_decode_speedup"][str(n)]
        rows.append({"sessions": n, "decode_tokens_per_s": r.get("decode_tokens_per_s"),
                     "aggregate_tokens_per_s": r["tokens_per_s"], "mean_batch": r.get("mean_batch"),
                     "p50_ms_per_token": r["p50_ms"], "p95_ms_per_token": r["p95_ms"],
                     "decode_vs_one": paired["median"], "decode_vs_one_interval": [paired["lo"], paired["hi"]],
                     "target_vs_one": TARGETS.get(n)})
    return rows


def target_lines(rows: list[dict], pairs: int) -> list[dict]:
    """Each target: met (the paired median at or above it), and its line as printed."""
    out = []
    for row in rows:
        if row["target_vs_one"] is None:
            continue
        lo, hi = row["decode_vs_one_interval"]
        met = row["decode_vs_one"] >= row["target_vs_one"]
        out.append({"sessions": row["sessions"], "target": row["target_vs_one"], "ratio": row["decode_vs_one"],
                    "interval": [lo, hi], "met": met,
                    "line": f"decode tokens/s, {row['sessions']} sessions vs one: x{row['decode_vs_one']:.2f} "
                            f"[{lo:.2f}, {hi:.2f}] over {pairs} paired rounds; target >= x{row['target_vs_one']:g}: "
                            + ("met" if met else "NOT met")})
    return out


def run(*, out: str, budget_s: float, python: str = sys.executable, device: str = "cuda", tiny: bool = False,
        runner=run_child) -> PhaseRecord:
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="gpu_serve."))
    sandboxed = shutil.which("bwrap") is not None
    cmd = serve_command(python, tmp, budget_s, device=device, tiny=tiny, sandboxed=sandboxed)
    rec = PhaseRecord(out, "serve_concurrency_gpu", config={
        "command": " ".join(cmd[1:]), "levels": list(LEVELS), "targets": {str(k): v for k, v in TARGETS.items()},
        "shape": "tiny-mem" if tiny else "qwen3-0.6b", "device": device,
        "isolation": "required" if sandboxed else "none (bwrap is not on PATH)"})
    log = Log()
    r = runner(cmd, timeout=budget_s, log=log, prefix="[serve] ")
    res = read_json(tmp / ("serve_concurrency.json" if tiny else "serve_concurrency_qwen3-0.6b.json"))
    if r["timed_out"] or r["rc"] not in (0, 1) or res is None:
        why = f"timed out after {budget_s:.0f} s" if r["timed_out"] else f"exit {r['rc']}"
        rec.check("serve_concurrency: the batched server decoded 1, 8 and 32 sessions", False,
                  f"{why}: {last_lines(r['tail'], 3)}")
        rec.finish("timeout" if r["timed_out"] else "failed", time.monotonic() - t0)
        return rec
    rows = level_rows(res)
    for row in rows:
        rec.add_row(row)
    good = [row for row in rows if row["decode_tokens_per_s"] and math.isfinite(row["decode_tokens_per_s"])]
    rec.check("serve_concurrency: the batched server decoded 1, 8 and 32 sessions", len(good) == len(LEVELS),
              ", ".join(f"{row['sessions']}: {row['decode_tokens_per_s'] or 0:.1f} tokens/s" for row in rows))
    targets = target_lines(rows, res["pairs"])
    for t in targets:
        log(f"[serve] {t['line']}")
    rec.set(targets=targets, machine=res.get("machine"), pairs=res["pairs"],
            one_session_decode_tokens_per_s=res.get("one_session_decode_tokens_per_s"), serve_concurrency=res)
    rec.finish_by_checks(time.monotonic() - t0)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the phase's JSON file")
    ap.add_argument("--budget-s", type=float, default=90.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny-mem backbone, 4-token replies (the CPU smoke)")
    a = ap.parse_args(argv)
    return 0 if run(out=a.out, budget_s=a.budget_s, device=a.device, tiny=a.tiny).data["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
