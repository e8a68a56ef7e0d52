"""Result files of the GPU check: atomic JSON writes and the Markdown summary (stdlib only).

Every phase of `gpu_check/run.sh` leaves one JSON file in the results folder
(default benchmarks/results/gpu/):

    environment.json     GPU name, driver, Python / torch / CUDA / nvcc / deepspeed / flash-attn versions
    setup.json           the first contact: install; build (prebuilt or JIT, why, seconds); the
                         tensor-core probe with every lane of every case; the six kernels alone
                         under CUDA_LAUNCH_BLOCKING=1 (first wrong element); compute-sanitizer
                         memcheck / racecheck / synccheck (or why skipped); tests/ops (pytest
                         counts per module: a module skipped as a whole fails)
    flashbob_cuda.json   FlashBoB second-order step vs flash-attn fwd+bwd vs PyTorch math, N = 1K..32K,
                         and per-kernel profiler times at 8K (useful and executed FLOP/s)
    last_stage.json      one meta-training step of the Qwen3-8B last pipeline stage with the TTT settings of
                         ds_configs/run_qwen3_8b.json, T = 2K / 8K / 16K / 32K: step s, tokens/s, peak
                         allocated / reserved memory, whether it fits an 80 GB GPU, out-of-memory rows
    trainer.json         deepspeed launch/train.py on the GPU (one stage, the shipped configs): steps done
                         of planned, tokens/s, step time, peak per rank and its split, loss, save +
                         --resume equality, the layer count that fitted, the DeepSpeed config used
    serve_concurrency_gpu.json  the batched server's decode tokens/s at 1, 8 and 32 sessions on a
                         Qwen3-0.6B-shaped model (benchmarks/serve_concurrency.py), the ratios 8 vs 1 and
                         32 vs 1 against their targets, what it ran on
    pipeline_balance_gpu.json  each PP4 stage of Qwen3-8B timed alone on the GPU (benchmarks/pipeline_balance;
                         optional phase)
    summary.md           the tables below, rendered from those files
    gpu_check.log        everything the run printed

A phase file has the shape
    {"phase": str, "status": "running"|"ok"|"failed"|"timeout"|"skipped", "elapsed_s": float,
     "checks": [{"name": str, "ok": bool, "detail": str}], "rows": [...], "notes": [str], ...}
and is rewritten after every measurement (write to a temporary file, then rename), so a phase
that is killed at its time limit still leaves every row it finished.

    python gpu_check/gpu_results.py DIR      # (re)render DIR/summary.md from DIR/*.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

RESULT_FILES = ("environment.json", "setup.json", "flashbob_cuda.json", "last_stage.json", "trainer.json",
                "serve_concurrency_gpu.json", "pipeline_balance_gpu.json", "summary.md", "gpu_check.log")
PHASE_FILES = ("setup.json", "flashbob_cuda.json", "last_stage.json", "trainer.json", "serve_concurrency_gpu.json",
               "pipeline_balance_gpu.json")
STATUSES = ("running", "ok", "failed", "timeout", "skipped")


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write `obj` as JSON so that readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_finite(obj), f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _finite(obj):
    """JSON has no NaN/inf: store them as strings so the file stays standard JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def read_json(path: str | os.PathLike):
    """The parsed file, or None when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


class PhaseRecord:
    """A phase's JSON file, rewritten after each change."""

    def __init__(self, path: str | os.PathLike, phase: str, **fields):
        self.path = Path(path)
        self.data = {"phase": phase, "status": "running", "elapsed_s": 0.0, "checks": [], "rows": [],
                     "notes": [], **fields}
        self.save()

    def add_row(self, row: dict) -> None:
        self.data["rows"].append(row)
        self.save()

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.data["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        self.save()
        return bool(ok)

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.save()

    def set(self, **fields) -> None:
        self.data.update(fields)
        self.save()

    def finish(self, status: str, elapsed_s: float) -> None:
        assert status in STATUSES, status
        self.data.update(status=status, elapsed_s=round(elapsed_s, 2))
        self.save()

    def finish_by_checks(self, elapsed_s: float) -> None:
        """Finish as "failed" when a check failed, else "ok"."""
        self.finish("failed" if any(not c["ok"] for c in self.data["checks"]) else "ok", elapsed_s)

    def save(self) -> None:
        write_json_atomic(self.path, self.data)


def failed_checks(results_dir: str | os.PathLike) -> list[str]:
    """'file: check: detail' for every failed check in the phase files."""
    out = []
    for name in PHASE_FILES:
        data = read_json(Path(results_dir) / name) or {}
        for c in data.get("checks", []):
            if not c.get("ok"):
                out.append(f"{name}: {c.get('name')}: {c.get('detail', '')}".rstrip(": "))
    return out


# ---- Markdown ----------------------------------------------------------------------------------

def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _gib(num_bytes) -> str:
    return "–" if num_bytes is None else f"{num_bytes / 2**30:.2f}"


def _ms(seconds) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f}"


def _cell(value, limit: int = 400) -> str:
    """One table cell: a single line, '|' escaped, long text cut from the front (errors end last)."""
    text = " ".join((value if isinstance(value, str) else _fmt(value)).split()).replace("|", "\\|")
    return text if len(text) <= limit else "…" + text[-limit:]


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return lines


def _status_of(name: str, data) -> str:
    if data is None:
        return "not run"
    status = data.get("status", "?")
    if status == "running":
        status = "interrupted"
    return status


def render_summary(results_dir: str | os.PathLike) -> str:
    """Markdown summary of every result file in `results_dir` (missing files show as 'not run')."""
    d = Path(results_dir)
    env = read_json(d / "environment.json") or {}
    setup = read_json(d / "setup.json")
    fb = read_json(d / "flashbob_cuda.json")
    ls = read_json(d / "last_stage.json")
    tr = read_json(d / "trainer.json")
    pb = read_json(d / "pipeline_balance_gpu.json")
    sc = read_json(d / "serve_concurrency_gpu.json")
    fails = failed_checks(d)
    lines = ["# GPU check results", ""]
    lines.append(f"Written by `bash gpu_check/run.sh` (gpu_check/). Started {env.get('started', '?')}; "
                 f"total {_fmt(env.get('total_s'))} s.")
    lines.append("")
    verdict = env.get("verdict")
    if verdict:
        lines += [f"**Verdict: {verdict}**", ""]
    gpu = env.get("gpu") or {}
    sw = env.get("software") or {}
    lines += ["## Machine and software", ""]
    lines += _table(["what", "value"], [
        ["GPU", f"{gpu.get('name', '?')} (sm_{gpu.get('capability', '?')}, {_fmt(gpu.get('memory_gib'))} GiB)"],
        ["driver", gpu.get("driver", "?")],
        ["python", sw.get("python", "?")],
        ["torch (CUDA)", f"{sw.get('torch', '?')} (CUDA {sw.get('torch_cuda', '?')})"],
        ["nvcc", sw.get("nvcc", "?")],
        ["deepspeed", sw.get("deepspeed", "?")],
        ["transformers", sw.get("transformers", "?")],
        ["flash-attn", sw.get("flash_attn") or "not installed"],
        ["repository", f"{env.get('git_commit', '?')}{' (dirty)' if env.get('git_dirty') else ''}"],
    ])
    lines += ["", "## Phases", ""]
    phase_rows = []
    for label, data in (("setup (install, build, probe, kernels, sanitizer, tests/ops)", setup), ("FlashBoB CUDA benchmark", fb),
                        ("last-stage meta-training step", ls), ("trainer (deepspeed launch/train.py)", tr),
                        ("serving concurrency (batched decode)", sc), ("PP4 stage balance", pb)):
        phase_rows.append([label, _status_of(label, data), _fmt((data or {}).get("elapsed_s"))])
    lines += _table(["phase", "status", "seconds"], phase_rows)

    lines += ["", "## Correctness checks", ""]
    checks = []
    for name, data in (("setup", setup), ("flashbob", fb), ("last_stage", ls), ("trainer", tr),
                       ("serve_concurrency", sc), ("balance", pb)):
        for c in (data or {}).get("checks", []):
            checks.append([name, c.get("name", "?"), "PASS" if c.get("ok") else "**FAIL**", c.get("detail", "")])
    lines += _table(["phase", "check", "result", "detail"], checks) if checks else ["(none ran)"]
    if fails:
        lines += ["", f"{len(fails)} check(s) failed."]

    build = (setup or {}).get("build") or {}
    if build:
        load = build.get("load") or {}
        lines += ["", "## First contact", "",
                  f"FlashBoB op loaded: {load.get('path', 'no')} in {_fmt(load.get('seconds'))} s"
                  + (f" (prebuilt objects not used: {load.get('prebuilt_skipped')})" if load.get("path") == "jit" else "")
                  + ". Probe, kernel and sanitizer results are the checks above; every probe lane is in setup.json."]
        san = (setup or {}).get("sanitizer") or {}
        if san.get("skipped"):
            lines += ["", f"compute-sanitizer: skipped ({san['skipped']})."]
    prof = (fb or {}).get("kernel_profile")
    if prof:
        lines += ["", f"## FlashBoB kernels at N={prof.get('n')} (torch.profiler device time per step)", "",
                  "executed TFLOP/s counts the GEMMs each kernel issues; the step's useful TFLOP/s uses the "
                  "benchmark's model. " + "; ".join(f"{k}: {v}" for k, v in (prof.get("flop_counts") or {}).items()),
                  ""]
        rows = [[k, _fmt(v.get("ms_per_step")), _fmt(v.get("calls_per_step")), _fmt(v.get("executed_tflops"))]
                for k, v in prof.get("kernels", {}).items()]
        rows.append(["six kernels", _fmt(prof.get("flashbob_kernels_ms_per_step")), "–",
                     f"{_fmt(prof.get('executed_tflops'))} executed, {_fmt(prof.get('useful_tflops'))} useful"])
        rows.append(["other kernels", _fmt(prof.get("other_ms_per_step")), "–", "–"])
        lines += _table(["kernel", "ms/step", "calls/step", "TFLOP/s"], rows)
    lines += _sweep_section((fb or {}).get("tile_sweep"))
    if fb and fb.get("rows"):
        cfg = fb.get("config", {})
        where = "" if cfg.get("device", "cuda") == "cuda" else f" (device {cfg.get('device')}: not a GPU run)"
        lines += ["", "## FlashBoB on CUDA" + where, "",
                  f"bf16, causal, B={cfg.get('batch', '?')}, H={cfg.get('heads_q', '?')} query / "
                  f"{cfg.get('heads_kv', '?')} key-value heads, D={cfg.get('head_dim', '?')}. "
                  "Time: median CUDA-event time of one step. Memory: peak allocated during the step "
                  "above what the inputs hold. TFLOP/s from the FLOP model in the JSON "
                  f"({fb.get('flop_model', '')})."]
        methods = list(dict.fromkeys(r.get("method", "?") for r in fb["rows"]))
        by_key = {(r.get("n"), r.get("method")): r for r in fb["rows"]}
        sizes = list(dict.fromkeys(r.get("n") for r in fb["rows"]))

        def cell(r, what):
            if r is None:
                return "–"
            if r.get("status") != "ok":
                return {"oom": "OOM"}.get(r.get("status"), r.get("status", "?")).replace("skipped ", "")
            if what == "time":
                return f"{_ms(r.get('time_s'))} ({_fmt(r.get('tflops'))})"
            return _gib(r.get("peak_bytes"))
        lines += ["", "Step time in ms (TFLOP/s):", ""]
        lines += _table(["N", *methods], [[str(n), *(cell(by_key.get((n, m)), "time") for m in methods)] for n in sizes])
        lines += ["", "Peak memory in GiB above the inputs:", ""]
        lines += _table(["N", *methods], [[str(n), *(cell(by_key.get((n, m)), "mem") for m in methods)] for n in sizes])
    if ls and ls.get("rows"):
        cfg = ls.get("config", {})
        lines += ["", "## Last pipeline stage: one meta-training step", "",
                  f"{cfg.get('description', '')}", ""]
        rows = []
        for r in ls["rows"]:
            peak = _gib(r.get("peak_bytes"))
            if r.get("status") == "oom" and r.get("peak_bytes_before_oom") is not None:
                peak = f">= {_gib(r['peak_bytes_before_oom'])} (OOM)"
            rows.append([str(r.get("tokens")), r.get("backend", "?"), r.get("status", "?"), _fmt(r.get("num_events")),
                         _fmt(r.get("step_s")), _fmt(r.get("repeats_run")), _fmt(r.get("tokens_per_s")), peak,
                         _gib(r.get("reserved_peak_bytes")), _fmt(r.get("fits_80gb")), _fmt(r.get("loss"))])
        lines += _table(["T", "attention", "status", "events", "step s", "repeats", "tokens/s", "peak GiB",
                         "reserved GiB", "fits 80 GB", "loss"], rows)
    lines += _trainer_section(tr) + _serve_section(sc) + _balance_section(pb)
    for label, data in (("setup", setup), ("flashbob", fb), ("last_stage", ls), ("trainer", tr),
                        ("serve_concurrency", sc), ("balance", pb)):
        notes = (data or {}).get("notes", [])
        if notes:
            lines += ["", f"Notes ({label}):", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _sweep_section(sweep) -> list[str]:
    """The tile-shape sweep: ms/step per kernel (rows) and tile set (columns), the fastest in bold."""
    if not sweep:
        return []
    sets = sweep.get("sets", [])
    ok = [r for r in sets if r.get("status") == "ok"]
    lines = ["", f"## Tile-shape sweep at N={sweep.get('n')} (ms/step per kernel; shape BM/BN/warps)", "",
             f"Default set on this GPU: {sweep.get('default_set')}. {sweep.get('note', '')}", ""]
    kernels = sorted({k for r in ok for k in r.get("kernels_ms", {})})
    rows = []
    for k in kernels:
        best = (sweep.get("best") or {}).get(k, {}).get("set")
        cells = []
        for r in ok:
            v = r["kernels_ms"].get(k)
            cell = f"{v:.2f} ({r['shapes'].get(k, '?')})" if v is not None else "–"
            cells.append(f"**{cell}**" if r["name"] == best else cell)
        rows.append([k, *cells])
    rows.append(["six kernels", *[f"{r['total_ms']:.2f}" for r in ok]])
    if ok:
        lines += _table(["kernel", *[r["name"] + (" (default)" if r.get("default") else "") for r in ok]], rows)
    others = [f"{r['name']}: {r.get('status')}" for r in sets if r.get("status") != "ok"]
    if others:
        lines += ["", "Not timed: " + "; ".join(others) + "."]
    return lines


def _trainer_section(tr) -> list[str]:
    if not tr or not tr.get("rows"):
        return []
    fit = tr.get("layer_fit") or {}
    tried = ", ".join(f"{a.get('layers')}: " + ("ran" if a.get("ok") else "OOM" if a.get("oom") else
                                                 "skipped" if a.get("skipped") else "failed")
                      for a in fit.get("attempts", []))
    src = (tr.get("config") or {}).get("deepspeed_source") or {}
    lines = ["", "## Trainer on the GPU: deepspeed launch/train.py", "", (tr.get("config") or {}).get("description", ""),
             "", f"Layers: {fit.get('layers', '?')} of 36 (attempts: {tried or 'none'}).", ""]
    if src:
        changed = ", ".join(f"{k} {v.get('from')} -> {v.get('to')}" for k, v in (src.get("changed") or {}).items())
        lines += [f"DeepSpeed config: {src.get('source')}"
                  + (f", a temporary copy for {src.get('world_size')} GPU changing {changed}." if src.get("generated")
                     else ", as shipped."), ""]
    rows = []
    for r in tr["rows"]:
        mem = r.get("memory") or {}

        def part(key):
            return _gib((mem.get(key) or {}).get("value"))
        resume = r.get("resume") or {}
        res = resume.get("status", "–") if resume.get("status") != "ok" else (
            "equal (exact)" if resume.get("exact") else f"equal within {_fmt(resume.get('max_rel_diff'))}"
            if resume.get("ok") else f"**differs** ({_fmt(resume.get('max_rel_diff'))})")
        steps = f"{_fmt(r.get('steps_done'))}/{_fmt(r.get('steps_planned'))}" if r.get("steps_planned") else "–"
        rows.append([str(r.get("tokens")), r.get("status", "?") + (f" ({r['reason']})" if r.get("reason") else ""),
                     _fmt(r.get("layers")), steps, _fmt(r.get("tokens_per_step")), _fmt(r.get("step_time_s")),
                     _fmt(r.get("tokens_per_s")), part("peak_bytes"), _fmt(r.get("fits_80gb")), part("weights_bytes"),
                     part("optimizer_bytes"), part("gradients_bytes"), part("activations_bytes"),
                     _fmt(r.get("final_loss")), res])
    lines += _table(["capacity", "status", "layers", "steps done", "tokens/step", "step s", "tokens/s",
                     "peak GiB per rank (measured)", "fits 80 GB", "weights (computed)", "optimizer (computed)",
                     "grads (computed)", "activations (peak - computed)", "loss", "resume"], rows)
    return lines


def _serve_section(sc) -> list[str]:
    if not sc or not sc.get("rows"):
        return []
    cfg, m = sc.get("config") or {}, sc.get("machine") or {}
    lines = ["", "## Serving concurrency on the GPU: batched decode (benchmarks/serve_concurrency.py)", "",
             f"`{cfg.get('command', '')}`", "",
             f"Ran on {m.get('gpu') or m.get('device', '?')} (CPU {m.get('cpu_model', '?')}); model shape "
             f"{cfg.get('shape', '?')}, random weights; {sc.get('pairs', '?')} paired rounds; one session decodes "
             f"{_fmt(sc.get('one_session_decode_tokens_per_s'))} tokens/s.", ""]
    lines += _table(["sessions", "decode tokens/s", "vs one (paired median [95% interval])", "target",
                     "aggregate tokens/s", "mean batch", "p50 ms/token"],
                    [[str(r.get("sessions")), _fmt(r.get("decode_tokens_per_s")),
                      f"x{_fmt(r.get('decode_vs_one'))} [{', '.join(_fmt(x) for x in r.get('decode_vs_one_interval', []))}]",
                      f">= x{_fmt(r['target_vs_one'])}" if r.get("target_vs_one") else "–",
                      _fmt(r.get("aggregate_tokens_per_s")), _fmt(r.get("mean_batch")), _fmt(r.get("p50_ms_per_token"))]
                     for r in sc["rows"]])
    lines += [""] + [f"- {t['line']}" for t in sc.get("targets", [])]
    return lines


def _balance_section(pb) -> list[str]:
    if not pb or not pb.get("rows"):
        return []
    sched = pb.get("schedule") or {}
    lines = ["", "## PP4 stages timed alone on the GPU (benchmarks/pipeline_balance)", "",
             f"`{(pb.get('config') or {}).get('command', '')}`", ""]
    lines += _table(["stage", "fwd s", "bwd s", "fwd+bwd s", "params", "trainable", "activation peak GiB"],
                    [[str(r.get("stage")), _fmt(r.get("fwd_s")), _fmt(r.get("bwd_s")), _fmt(r.get("total_s")),
                      _fmt(r.get("params")), _fmt(r.get("trainable_params")), _gib(r.get("activation_peak_bytes"))]
                     for r in pb["rows"]])
    lines += ["", f"1F1B step from these stage times: {_fmt(sched.get('step_s'))} s for {sched.get('num_micro', '?')} "
                  f"micro-batches; bubble {_fmt(sched.get('bubble'))} (uniform stages: {_fmt(sched.get('uniform_bubble'))})."]
    return lines


def write_summary(results_dir: str | os.PathLike) -> Path:
    path = Path(results_dir) / "summary.md"
    tmp = path.with_name(".summary.md.tmp")
    tmp.write_text(render_summary(results_dir))
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python gpu_check/gpu_results.py RESULTS_DIR")
    print(write_summary(sys.argv[1]))


def positive_ints(text: str) -> list[int]:
    """argparse type: "1024,2048" -> [1024, 2048] (order kept); anything else is a usage error."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
