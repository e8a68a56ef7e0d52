"""The GPU check's CPU-testable parts: clean refusal without CUDA, arguments, the phase plan and time
limits, process-group timeouts that keep partial results (and mark the measurement in flight), the
result writer and summary, and the benchmark step functions on tiny CPU shapes (reference backend vs
PyTorch math; the last-stage meta-training step with the reference backend; the last stage's run over
T = 2K..32K with the 8B recipe's TTT settings, an out-of-memory at 16K and the time budget, through a
fake step). The prebuilt kernels' manifest check uses the loader's own rule. The first contact (probe, kernels alone,
sanitizer; gpu_check/first_contact.py) runs on the CPU emulator's builds as the "GPU", also
with a corrupted lane / element / a fault, and its phases with fake child processes; the tests
phase must fail on a module skipped as a whole; the per-kernel profiler accounting, the FLOP
counts and the resource-usage table generated from the committed cuobjdump log are checked here.

    .venv/bin/python -m pytest gpu_check/tests/test_gpu_check.py -q
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GPU_DIR = REPO / "gpu_check"
sys.path.insert(0, str(GPU_DIR))

import bench_flashbob_cuda as bfc  # noqa: E402
import bench_last_stage as bls  # noqa: E402
import gpu_check  # noqa: E402
import gpu_results  # noqa: E402

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the behaviour without a CUDA GPU")


def _env_without_gpu_tools() -> dict:
    """PATH without any nvidia-smi, Python = this interpreter (a CPU torch)."""
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and not (Path(p) / "nvidia-smi").exists())
    return {**os.environ, "PATH": path, "PYTHON": sys.executable}


# ---- refusal and arguments -------------------------------------------------------------------------

@NO_CUDA
def test_refuses_cleanly_without_cuda_and_writes_nothing(tmp_path):
    out = tmp_path / "results"
    r = subprocess.run(["bash", "gpu_check/run.sh", "--out", str(out)], cwd=REPO, capture_output=True,
                       text=True, env=_env_without_gpu_tools(), timeout=120)
    assert r.returncode == 2, r.stderr
    assert "refused" in r.stderr and "no CUDA GPU" in r.stderr and "nothing was run or written" in r.stderr
    assert not out.exists()
    # An earlier run's results in the folder stay untouched by a refused run.
    out.mkdir()
    (out / "summary.md").write_text("earlier run\n")
    r = subprocess.run(["bash", "gpu_check/run.sh", "--out", str(out), "--quick"], cwd=REPO,
                       capture_output=True, text=True, env=_env_without_gpu_tools(), timeout=120)
    assert r.returncode == 2
    assert [p.name for p in out.iterdir()] == ["summary.md"] and (out / "summary.md").read_text() == "earlier run\n"


def test_refuses_without_python_interpreter(tmp_path):
    r = subprocess.run(["bash", "gpu_check/run.sh"], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHON": "no-such-python-3.11"}, timeout=30)
    assert r.returncode == 2 and "no Python interpreter" in r.stderr


def test_plan_and_help_need_no_gpu():
    r = subprocess.run(["bash", "gpu_check/run.sh", "--plan", "--total-s", "300", "--budget", "build=100"],
                       cwd=REPO, capture_output=True, text=True, env=_env_without_gpu_tools(), timeout=60)
    assert r.returncode == 0, r.stderr
    for phase in gpu_check.PHASES:
        assert phase in r.stdout
    assert "build       limit   100 s" in r.stdout and "300 s" in r.stdout
    r = subprocess.run(["bash", "gpu_check/run.sh", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--wheels" in r.stdout and "--quick" in r.stdout


def test_plan_prints_the_long_context_phases_and_their_limits():
    """--plan names the last stage's lengths and recipe, the trainer's steps and context, every limit, and
    balance as optional (failed on the code before: T up to 16K, trainer at 8K then 4K, balance reserved)."""
    r = subprocess.run(["bash", "gpu_check/run.sh", "--plan"], cwd=REPO, capture_output=True, text=True,
                       env=_env_without_gpu_tools(), timeout=60)
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()[1:] if ln.startswith("  ") and ln.split()[0] in gpu_check.PHASES}
    assert list(lines) == list(gpu_check.PHASES)
    assert "limit   120 s; reserved minimum  80 s" in lines["last_stage"]
    assert "T=2048,8192,16384,32768" in lines["last_stage"] and "ds_configs/run_qwen3_8b.json" in lines["last_stage"]
    assert "limit   240 s; reserved minimum 150 s" in lines["trainer"] and "3 steps at T=8192" in lines["trainer"]
    assert "limit    60 s; reserved minimum  40 s" in lines["flashbob"]
    assert "not run (optional" in lines["balance"]
    assert gpu_check.parse_args([]).phases == list(gpu_check.DEFAULT_PHASES) and "balance" not in gpu_check.DEFAULT_PHASES
    assert gpu_check.parse_args(["--phases", "trainer,balance"]).phases == ["trainer", "balance"]
    # the trainer's worst case is its minimum; after the H200 run's phase times it gets more
    typical = int(lines["trainer"].split("limit, ")[1].split()[0])
    assert typical >= 180


def test_the_old_command_forwards_to_the_check():
    """`bash benchmarks/gpu_check.sh` (the command the team brief names) runs gpu_check/run.sh, from any cwd."""
    argv = ["--plan", "--total-s", "300"]
    new = subprocess.run(["bash", "gpu_check/run.sh", *argv], cwd=REPO, capture_output=True, text=True,
                         env=_env_without_gpu_tools(), timeout=60)
    old = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), *argv], cwd="/", capture_output=True,
                         text=True, env=_env_without_gpu_tools(), timeout=60)
    assert old.returncode == new.returncode == 0, old.stderr
    assert old.stdout == new.stdout and "phase" in old.stdout


@pytest.mark.parametrize("argv, message", [
    (["--phases", "build,bogus"], "unknown phase"),
    (["--phases", ""], "unknown phase"),
    (["--budget", "build=0"], "must be > 0"),
    (["--budget", "build"], "PHASE=SECONDS"),
    (["--budget", "compile=10"], "PHASE=SECONDS"),
    (["--budget", "tests=soon"], "must be a number"),
    (["--total-s", "0"], "--total-s must be > 0"),
    (["--wheels", "/no/such/folder"], "not a folder"),
    (["--frobnicate"], "unrecognized arguments"),
])
def test_bad_arguments_exit_2_naming_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_arguments_defaults_and_phase_order():
    a = gpu_check.parse_args(["--phases", "last_stage,build", "--budget", "tests=12.5"])
    assert a.phases == ["build", "last_stage"]  # canonical order whatever the order given
    assert a.budgets["tests"] == 12.5 and a.budgets["build"] == gpu_check.BUDGETS["build"]
    assert Path(a.out) == REPO / "benchmarks" / "results" / "gpu"


def test_phase_limits_keep_later_minimums_and_fit_the_window():
    phases = list(gpu_check.PHASES)
    budgets = dict(gpu_check.BUDGETS)
    # Worst case: every phase uses its whole limit; the run still ends inside --total-s.
    for total in (450.0, 300.0, 200.0):
        remaining, used = total, 0.0
        for p in phases:
            limit = gpu_check.phase_limit(p, phases, remaining, budgets)
            remaining -= limit
            used += limit
        assert used <= total - gpu_check.SUMMARY_RESERVE_S + 1e-9
    # A slow build cannot take the benchmarks' reserved minimum.
    later = sum(gpu_check.MINIMUMS[p] for p in phases[phases.index("build") + 1:]) + gpu_check.SUMMARY_RESERVE_S
    assert phases[phases.index("build") + 1:] == ["probe", "kernels", "sanitizer", "tests", "flashbob", "last_stage",
                                                  "trainer", "serve_concurrency", "balance"]
    assert gpu_check.phase_limit("build", phases, 560.0, {**budgets, "build": 1e9}) == 560.0 - later
    # every phase's minimum fits the default run
    assert sum(gpu_check.MINIMUMS.values()) + gpu_check.SUMMARY_RESERVE_S < gpu_check.parse_args([]).total_s
    assert gpu_check.phase_limit("last_stage", phases, 1e9, budgets) == budgets["last_stage"]
    assert gpu_check.phase_limit("tests", phases, 5.0, budgets) == 0.0


def test_requirements_and_missing_packages():
    reqs = gpu_check.read_requirements(REPO / "requirements" / "gpu.txt")
    assert reqs["torch"].startswith("torch==") and reqs["deepspeed"].startswith("deepspeed==")
    present = {n: "1.0" for n in gpu_check.NEEDED}
    assert gpu_check.missing_requirements({"packages": present, "torch_cuda": "13.0"}, reqs) == []
    # A CPU-only torch counts as missing; so does an absent package.
    missing = gpu_check.missing_requirements({"packages": {**present, "deepspeed": None}, "torch_cuda": None}, reqs)
    assert missing == [reqs["torch"], reqs["deepspeed"]]


# ---- processes, partial results ------------------------------------------------------------------------

def test_run_child_kills_the_whole_process_group_at_the_limit(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pid_file)!r}, "w").write(str(p.pid))
        print("started", flush=True)
        time.sleep(120)
    """)
    lines = []
    t0 = time.monotonic()
    r = gpu_check.run_child([sys.executable, "-c", code], timeout=3, log=lines.append)
    assert r["timed_out"] and time.monotonic() - t0 < 30
    assert "started" in r["tail"] and "started" in lines
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init shortly after the kill
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{grandchild}/status").exists() and "zombie" in Path(f"/proc/{grandchild}/status").read_text():
            break
        time.sleep(0.1)
    else:
        pytest.fail("grandchild survived the phase timeout")
    r = gpu_check.run_child([sys.executable, "-c", "import sys; print('x'); sys.exit(3)"], timeout=30,
                            log=lines.append)
    assert r["rc"] == 3 and not r["timed_out"]


def _context(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    args = gpu_check.parse_args(["--out", str(out)])
    args.argv = []
    return gpu_check.Context(args, sys.executable, out, gpu_check.Log(), tmp_path)


def test_killed_benchmark_keeps_its_rows_and_is_marked_timeout(tmp_path):
    ctx = _context(tmp_path)
    script = tmp_path / "slow_bench.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(GPU_DIR)!r})
        from gpu_results import PhaseRecord
        rec = PhaseRecord(sys.argv[1], "slow")
        rec.add_row({{"n": 1, "status": "ok", "time_s": 0.5}})
        print("row written", flush=True)
        time.sleep(120)
    """))
    path = ctx.out / "flashbob_cuda.json"
    gpu_check.phase_bench(ctx, "flashbob_cuda", path.name, [sys.executable, str(script), str(path)], timeout=4)
    data = json.loads(path.read_text())
    assert data["status"] == "timeout" and data["rows"] == [{"n": 1, "status": "ok", "time_s": 0.5}]
    assert any("killed at the phase limit" in n for n in data["notes"])


@pytest.mark.parametrize("how", ["killed", "crashed"])
def test_the_measurement_in_flight_is_marked_when_the_benchmark_dies(tmp_path, how):
    """A row written as "running" before a long T says whether the phase limit or a crash ended it
    (failed on the code before: it stayed "running")."""
    ctx = _context(tmp_path)
    script = tmp_path / "bench.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(GPU_DIR)!r})
        from gpu_results import PhaseRecord
        rec = PhaseRecord(sys.argv[1], "last_stage")
        rec.add_row({{"tokens": 8192, "status": "ok"}})
        rec.add_row({{"tokens": 32768, "status": "running"}})
        print("32K started", flush=True)
        time.sleep(120) if {how == "killed"!r} else sys.exit(3)
    """))
    path = ctx.out / "last_stage.json"
    gpu_check.phase_bench(ctx, "last_stage", path.name, [sys.executable, str(script), str(path)], timeout=6)
    data = json.loads(path.read_text())
    assert data["rows"][0]["status"] == "ok"
    if how == "killed":
        assert data["status"] == "timeout" and data["rows"][1]["status"] == "killed at the phase limit (6 s)"
        assert "except the one in flight" in data["notes"][-1]
    else:
        assert data["status"] == "failed" and data["rows"][1]["status"] == "crashed (exit 3)"


def test_crashed_benchmark_without_results_becomes_a_failed_check(tmp_path):
    ctx = _context(tmp_path)
    cmd = [sys.executable, "-c", "raise SystemExit('boom: no kernel')"]
    gpu_check.phase_bench(ctx, "last_stage", "last_stage.json", cmd, timeout=30)
    data = json.loads((ctx.out / "last_stage.json").read_text())
    assert data["status"] == "failed"
    assert data["checks"][0]["ok"] is False and "boom: no kernel" in data["checks"][0]["detail"]
    assert any("last_stage" in f for f in gpu_results.failed_checks(ctx.out))


def test_junit_counts(tmp_path):
    xml = tmp_path / "ops.xml"
    xml.write_text('<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
                   '<testcase classname="tests.ops.t" name="a"/><testcase classname="tests.ops.t" name="b">'
                   '<failure message="x"/></testcase><testcase classname="tests.ops.t" name="c"/>'
                   '<testcase classname="tests.ops.t" name="d"><skipped/></testcase></testsuite></testsuites>')
    c = gpu_check.parse_junit(xml)
    assert (c["tests"], c["passed"], c["failures"], c["skipped"]) == (4, 2, 1, 1)
    assert c["failed_names"] == ["tests.ops.t::b"]
    assert gpu_check.parse_junit(tmp_path / "missing.xml") is None


@NO_CUDA
def test_main_without_a_usable_torch_records_the_failure_and_exits_1(tmp_path, monkeypatch):
    """A GPU that torch cannot use (here: faked nvidia-smi answer, CPU torch) fails the run with files."""
    out = tmp_path / "res"
    out.mkdir()
    (out / "README.md").write_text("keep me\n")
    (out / "last_stage.json").write_text("{}")  # an earlier run's file: removed
    monkeypatch.setattr(gpu_check, "detect_gpu", lambda python: {"source": "test", "name": "Fake GPU",
                                                                  "driver": "0", "memory_gib": 1.0, "count": 1})
    rc = gpu_check.main(["--out", str(out), "--phases", "flashbob", "--total-s", "120"])
    assert rc == 1
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "environment.json", "gpu_check.log", "setup.json", "summary.md"]
    env = json.loads((out / "environment.json").read_text())
    assert env["verdict"].startswith("FAIL") and env["gpu"]["name"] == "Fake GPU"
    assert env["software"]["torch"] == torch.__version__
    setup = json.loads((out / "setup.json").read_text())
    assert [c["name"] for c in setup["checks"] if not c["ok"]] == ["torch sees the GPU"]
    summary = (out / "summary.md").read_text()
    assert "Fake GPU" in summary and "**FAIL**" in summary and "torch sees the GPU" in summary


@NO_CUDA
def test_build_script_reports_why_the_cuda_op_cannot_build(tmp_path):
    out = tmp_path / "build.json"
    r = subprocess.run([sys.executable, str(GPU_DIR / "build_flashbob.py"), "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"})
    assert r.returncode == 1
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["compatible"] is False
    assert data["name"] == "ds_ttt_flashbob_cuda" and any(s.endswith(".cu") for s in data["sources"])
    assert data["incompatible_reason"] and data["incompatible_reason"] in data["error"]


# ---- result files and summary ------------------------------------------------------------------------

def test_json_writer_is_atomic_and_standard(tmp_path):
    path = tmp_path / "a" / "r.json"
    gpu_results.write_json_atomic(path, {"x": float("nan"), "y": [1.5, float("inf")], "z": (1, 2)})
    assert json.loads(path.read_text()) == {"x": "nan", "y": [1.5, "inf"], "z": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary file left behind
    with pytest.raises(TypeError):
        gpu_results.write_json_atomic(path, {"bad": object()})
    assert json.loads(path.read_text())["x"] == "nan"  # the earlier file survives a failed write
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_summary_renders_every_phase(tmp_path):
    gpu_results.write_json_atomic(tmp_path / "environment.json", {
        "started": "2026-11-30 14:00:00 UTC", "total_s": 400.0, "verdict": "FAIL: 1 correctness check(s) failed",
        "gpu": {"name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8, "driver": "580.1"},
        "software": {"python": "3.12.3", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "nvcc": "13.0.88",
                     "deepspeed": "0.19.8", "transformers": "5.17.0", "flash_attn": None},
        "git_commit": "abc123", "git_dirty": True})
    setup = gpu_results.PhaseRecord(tmp_path / "setup.json", "setup")
    setup.check("build: FlashBoB CUDA op compiles", True, "80 s")
    setup.check("tests/ops: CUDA correctness tests pass", False, "1 failed")
    setup.note("flash-attn not installed")
    setup.finish("failed", 120.0)
    fb = gpu_results.PhaseRecord(tmp_path / "flashbob_cuda.json", "flashbob_cuda", flop_model="fwd 4·N²·D",
                                 config={"batch": 1, "heads_q": 32, "heads_kv": 8, "head_dim": 128})
    fb.add_row({"n": 1024, "method": "flashbob_bob", "status": "ok", "time_s": 0.0012, "peak_bytes": 3 * 2**30,
                "tflops": 155.25})
    fb.add_row({"n": 32768, "method": "math_bob", "status": "oom"})
    # last_stage.json left "running": a killed phase shows as interrupted
    ls = gpu_results.PhaseRecord(tmp_path / "last_stage.json", "last_stage", config={"description": "9 layers"})
    ls.add_row({"tokens": 2048, "backend": "cuda", "status": "ok", "num_events": 3, "step_s": 1.25, "repeats_run": 2,
                "tokens_per_s": 1638.4, "peak_bytes": 40 * 2**30, "reserved_peak_bytes": 42 * 2**30, "fits_80gb": True,
                "loss": 11.9})
    ls.add_row({"tokens": 32768, "backend": "cuda", "status": "oom", "num_events": 33,
                "peak_bytes_before_oom": 130 * 2**30})
    path = gpu_results.write_summary(tmp_path)
    text = path.read_text()
    assert "NVIDIA H200" in text and "2.11.0+cu130" in text and "abc123 (dirty)" in text
    assert "flash-attn | not installed" in text
    assert "**Verdict: FAIL" in text and "| setup | tests/ops: CUDA correctness tests pass | **FAIL** | 1 failed |" in text
    assert "| N | flashbob_bob | math_bob |" in text  # methods side by side, one row per N
    assert "| 1024 | 1.20 (155) | – |" in text and "| 32768 | – | OOM |" in text  # time table
    assert "| 1024 | 3.00 | – |" in text  # memory table
    assert "| 2048 | cuda | ok | 3 | 1.25 | 2 | 1.64e+03 | 40.00 | 42.00 | yes | 11.9 |" in text
    assert "| 32768 | cuda | oom | 33 | – | – | – | >= 130.00 (OOM) | – | – | – |" in text
    assert "| last-stage meta-training step | interrupted |" in text
    assert "- flash-attn not installed" in text
    assert gpu_results.failed_checks(tmp_path) == ["setup.json: tests/ops: CUDA correctness tests pass: 1 failed"]


def test_summary_of_an_empty_folder_says_not_run(tmp_path):
    text = gpu_results.render_summary(tmp_path)
    assert text.count("| not run |") == 6 and "(none ran)" in text  # setup, flashbob, last_stage, trainer, serve, balance


# ---- benchmark step functions on CPU ----------------------------------------------------------------------

def test_second_order_step_matches_pytorch_math_on_cpu():
    x = bfc.make_inputs(12, heads_q=4, heads_kv=2, head_dim=8, dtype=torch.float64, device="cpu", seed=3)
    got = bfc.second_order_step(bfc.flashbob_attn("reference"), x)
    want = bfc.second_order_step(bfc.math_attn, x)
    assert [t.shape for t in got] == [x["q"].shape, x["q"].shape, x["k"].shape, x["v"].shape, x["do"].shape]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert all(float(t.abs().sum()) > 0 for t in got)
    o, dq, dk, dv = bfc.first_order_step(bfc.flashbob_attn("reference"), x)
    torch.testing.assert_close(o, got[0])
    assert dk.shape == x["k"].shape and dv.shape == x["v"].shape


def test_cross_check_passes_a_correct_kernel_and_trips_on_a_wrong_one():
    x = bfc.make_inputs(32, heads_q=4, heads_kv=2, head_dim=16, dtype=torch.bfloat16, device="cpu", seed=0)
    errs = bfc.cross_check(bfc.flashbob_attn("reference"), x)
    assert set(errs) == set(bfc.OUTPUT_NAMES)
    assert max(e["kernel"] for e in errs.values()) < bfc.TRIPWIRE_REL_ERR

    def non_causal(q, k, v):  # a plausible bug: the causal mask dropped
        from ds_ttt.ops.flashbob import attention

        return attention(q, k, v, causal=False, backend="reference")
    bad = bfc.cross_check(non_causal, x)
    assert max(e["kernel"] for e in bad.values()) > bfc.TRIPWIRE_REL_ERR


def test_flop_model():
    fwd_bwd = bfc.step_flops("fwd_bwd", 1024, heads_q=32, head_dim=128)
    bob = bfc.step_flops("bob", 1024, heads_q=32, head_dim=128)
    assert fwd_bwd == 14 * 1024**2 * 128 * 32 * 0.5 and bob / fwd_bwd == pytest.approx(50 / 14)
    assert bfc.step_flops("bob", 1024, heads_q=32, head_dim=128, causal=False) == 2 * bob


def test_synthetic_trajectory_structure():
    ids, kinds, rounds = bls.synthetic_trajectory(40, prompt=6, action=4, observation=5, vocab=50, seed=1)
    assert ids.shape == kinds.shape == rounds.shape == (1, 40) and int(ids.max()) < 50
    k, r = kinds[0].tolist(), rounds[0].tolist()
    assert k[:6] == [0] * 6 and r[:6] == [0] * 6
    one = [0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 2, 0]  # header, action, separator, observation, separator
    assert k[6:19] == one and r[6:19] == [1] * 13 and k[19:32] == one and r[19:32] == [2] * 13
    assert k[32:] == one[:8] and r[32:] == [3] * 8  # the last round is cut at T
    assert r == sorted(r)
    with pytest.raises(ValueError, match="must exceed the prompt"):
        bls.synthetic_trajectory(6, prompt=6, action=4, observation=5, vocab=50)


def test_last_stage_step_on_a_tiny_cpu_model(tmp_path, tiny_qwen3_config, monkeypatch):
    real_step = bls.last_stage_step

    def step_running_out_of_memory_from_60_tokens(suffix, ttt, hidden, *rest):
        if hidden.shape[1] >= 60:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real_step(suffix, ttt, hidden, *rest)
    monkeypatch.setattr(bls, "last_stage_step", step_running_out_of_memory_from_60_tokens)
    out = tmp_path / "last_stage.json"
    data = bls.run(out=str(out), contexts=[40, 60, 80], backends=["reference"], repeats=1, budget_s=120,
                   preset="tiny", num_adaptive=2, device="cpu", dtype="fp32", prompt=6, action=4, observation=5,
                   config=tiny_qwen3_config)
    assert data == json.loads(out.read_text())
    assert data["status"] == "ok" and all(c["ok"] for c in data["checks"]) and data["checks"]
    row, oom, skipped = data["rows"]
    assert (oom["tokens"], oom["status"]) == (60, "oom") and "out of memory" in oom["error"]
    assert (skipped["tokens"], skipped["status"]) == (80, "skipped (OOM at T=60)")
    assert row["status"] == "ok" and row["tokens"] == 40 and row["num_events"] == 4
    assert row["num_updates"] == 3 and row["checks_ok"] and math.isfinite(row["loss"]) and row["tokens_per_s"] > 0
    assert "9 adaptive" not in data["config"]["description"] and "2 adaptive layers" in data["config"]["description"]


def test_last_stage_gradients_reach_only_the_trainable_scope(tiny_qwen3_config):
    from ds_ttt.config import TTTConfig

    suffix = bls.build_last_stage(tiny_qwen3_config, num_adaptive=2, device="cpu", dtype=torch.float32)
    trainable = bls.trainable_parameters(suffix)
    assert trainable and all(p.requires_grad for p in trainable)
    assert not any(p.requires_grad for p in suffix.lm_head.parameters())
    assert sum(p.numel() for p in trainable) == sum(
        p.numel() for layer in suffix.layers for n, p in layer.named_parameters() if n.startswith("prime_"))
    ids, kinds, rounds = bls.synthetic_trajectory(30, prompt=4, action=3, observation=4, vocab=256)
    hidden = torch.randn(1, 30, tiny_qwen3_config.hidden_size, requires_grad=True)
    ttt = TTTConfig(adaptive_layers=2, attention_backend="reference").validate(tiny_qwen3_config.num_hidden_layers)
    info = bls.last_stage_step(suffix, ttt, hidden, ids, kinds, rounds)
    checks = bls.step_checks(info, hidden, suffix, rounds, kinds)
    assert all(ok for _, ok, _ in checks), checks
    assert suffix.lm_head.weight.grad is None
    # The checks do fail on a broken step.
    hidden.grad = torch.zeros_like(hidden)
    bad = {n: ok for n, ok, _ in bls.step_checks({**info, "num_updates": 0}, hidden, suffix, rounds, kinds)}
    assert bad == {"loss finite": True, "input gradient finite and non-zero": False,
                   "prime gradients finite and not all zero": True, "one inner update per observed round": False}


def test_flashbob_benchmark_loop_on_cpu(tmp_path):
    """The whole measuring loop (cross-check first, rows per N and method, JSON) at tiny CPU shapes."""
    out = tmp_path / "flashbob_cuda.json"
    data = bfc.run(out=str(out), sizes=[16, 32], budget_s=60, check_n=16, heads_q=4, heads_kv=2, head_dim=8,
                   device="cpu", flashbob_backend="reference")
    assert data == json.loads(out.read_text())
    assert data["status"] == "ok" and [c["ok"] for c in data["checks"]] == [True, True]
    assert set(data["cross_check"]["rel_err"]) == set(bfc.OUTPUT_NAMES)
    methods = ["flashbob_bob", "flashbob_fwd_bwd", data["config"]["methods"][2], "math_bob"]
    assert data["config"]["methods"] == methods and methods[2] in ("flash_attn_fwd_bwd", "sdpa_flash_fwd_bwd")
    assert [(r["n"], r["method"]) for r in data["rows"]] == [(n, m) for n in (16, 32) for m in methods]
    for r in data["rows"]:
        assert r["status"] == "ok" and r["finite"] and r["time_s"] > 0 and r["tflops"] > 0, r


def test_flashbob_benchmark_records_oom_and_time_budget(tmp_path, monkeypatch):
    def out_of_memory(q, k, v):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
    monkeypatch.setattr(bfc, "math_attn", out_of_memory)
    data = bfc.run(out=str(tmp_path / "fb.json"), sizes=[16, 32, 64], budget_s=1e-3, use_flashbob=False,
                   heads_q=4, heads_kv=2, head_dim=8, device="cpu")
    rows = {(r["n"], r["method"]): r["status"] for r in data["rows"]}
    first = data["config"]["methods"][0]
    assert data["config"]["methods"][1] == "math_bob"
    assert rows[(16, "math_bob")] == "oom" and rows[(32, "math_bob")] == rows[(64, "math_bob")] == "skipped (OOM at N=16)"
    assert rows[(16, first)] == "ok" and rows[(32, first)] == rows[(64, first)] == "skipped (time budget)"
    assert data["status"] == "ok"  # running out of memory or time is a measurement, not a failure
    assert any("FlashBoB CUDA op unavailable" in n for n in data["notes"])


def _recipe_file(tmp_path, **ttt) -> Path:
    """ds_configs/run_qwen3_8b.json with some TTT settings changed: what the phase must read at run time."""
    recipe = json.loads((REPO / "ds_configs" / "run_qwen3_8b.json").read_text())
    path = tmp_path / "run_recipe.json"
    path.write_text(json.dumps({**recipe, "ttt": {**recipe["ttt"], **ttt}}))
    return path


def _fake_step(calls, *, oom_from=None, clock=None, on_call=None):
    """Stands in for last_stage_step: records (backend, T, ttt), fills the gradients the checks read and
    returns what the real step returns; out of memory from T = oom_from; advances `clock` by T / 1024 s."""
    def step(suffix, ttt, hidden, ids, kinds, rounds):
        n = hidden.shape[1]
        calls.append((ttt.attention_backend, n, ttt))
        if on_call:
            on_call(ttt.attention_backend, n)
        if clock is not None:
            clock[0] += n / 1024
        if oom_from is not None and n >= oom_from:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        hidden.grad = torch.ones_like(hidden)
        for p in bls.trainable_parameters(suffix):
            p.grad = torch.ones_like(p)
        observed = {r for r, k in zip(rounds[0, :-1].tolist(), kinds[0, 1:].tolist()) if k == 2}
        return {"loss": 11.5, "num_updates": len(observed), "num_skipped": 0, "num_action_tokens": 4,
                "num_obs_tokens": 5}
    return step


def test_last_stage_measures_the_recipe_from_2k_to_32k_and_keeps_the_short_lengths_at_an_oom(
        tmp_path, tiny_qwen3_config, monkeypatch):
    """T ascending whatever the order given; the reference cross-check right after the first T; each T's row on
    disk ("running") before it starts, so the 2K and 8K results are there when 16K runs out of memory; the
    OOM is a row, 32K is then skipped; the TTT settings are the recipe's, read at run time (failed on the
    code before: hard-coded TTT settings, T up to 16K, the cross-check backend last)."""
    recipe = _recipe_file(tmp_path, adaptive_layers=2, fast_matrices="down", inner_lr=0.05)
    out = tmp_path / "last_stage.json"
    calls, on_disk = [], {}

    def look(backend, n):
        on_disk[(backend, n)] = [(r["tokens"], r["backend"], r["status"]) for r in json.loads(out.read_text())["rows"]]
    monkeypatch.setattr(bls, "last_stage_step", _fake_step(calls, oom_from=16384, on_call=look))
    data = bls.run(out=str(out), contexts=[32768, 2048, 16384, 8192], repeats=1, budget_s=600, preset="tiny",
                   run_config=recipe, device="cpu", dtype="fp32", prompt=6, action=4, observation=5,
                   config=tiny_qwen3_config)
    assert data == json.loads(out.read_text())
    assert [(b, n) for b, n, _ in calls] == [("cuda", 2048), ("cuda", 2048), ("reference", 2048), ("reference", 2048),
                                             ("cuda", 8192), ("cuda", 16384)]  # warm-up + 1 repeat at 2K
    assert all(t.fast_matrices == "down" and t.inner_lr == 0.05 and t.adaptive_layers == 2 for _, _, t in calls)
    assert on_disk[("cuda", 16384)] == [(2048, "cuda", "ok"), (2048, "reference", "ok"), (8192, "cuda", "ok"),
                                        (16384, "cuda", "running")]
    rows = [(r["tokens"], r["backend"], r["status"]) for r in data["rows"]]
    assert rows == [(2048, "cuda", "ok"), (2048, "reference", "ok"), (8192, "cuda", "ok"), (16384, "cuda", "oom"),
                    (32768, "cuda", "skipped (OOM at T=16384)")]
    assert "out of memory" in data["rows"][3]["error"]
    for r in data["rows"][:3]:
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["repeats_run"] == 1 and r["checks_ok"]
    # each measured length carries the trainer's pre-flight estimate of the same stage, growing with T
    from ds_ttt.train.memory_budget import Layout, estimate
    ttt = calls[0][2]
    want = estimate(tiny_qwen3_config, ttt, tokens=8192, round_tokens=4 + 5 + 4,
                    layout=Layout(stages=2, dp=1, offload_optimizer=True)).total_gib
    assert data["rows"][2]["estimate_gib"] == round(want, 2) and data["rows"][3]["estimate_gib"] > want
    assert data["status"] == "ok" and all(c["ok"] for c in data["checks"])
    assert "cuda vs reference at T=2048: loss and input gradient agree" in [c["name"] for c in data["checks"]]
    cfg = data["config"]
    assert cfg["contexts"] == [2048, 8192, 16384, 32768] and cfg["run_config"] == str(recipe)
    assert cfg["ttt"]["fast_matrices"] == "down" and cfg["backends"] == ["cuda", "reference"]
    assert "fast_matrices=down" in cfg["description"]


def test_last_stage_long_lengths_run_once_and_a_hopeless_one_is_skipped(tmp_path, tiny_qwen3_config, monkeypatch):
    """Fake clock, a step of T/1024 s, 40 s: 2K and its cross-check twice, 8K and 16K once (predicted over
    LONG_STEP_S), 32K (predicted 45 s, 4 s left) skipped with its prediction (failed on the code before)."""
    clock = [0.0]
    monkeypatch.setattr(bls, "time", type("FakeTime", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    calls = []
    monkeypatch.setattr(bls, "last_stage_step", _fake_step(calls, clock=clock))
    data = bls.run(out=str(tmp_path / "ls.json"), contexts=[2048, 8192, 16384, 32768], repeats=2, budget_s=40,
                   preset="tiny", ttt=bls.recipe_ttt(_recipe_file(tmp_path, adaptive_layers=2)), device="cpu",
                   dtype="fp32", prompt=6, action=4, observation=5, config=tiny_qwen3_config)
    rows = {(r["tokens"], r["backend"]): r for r in data["rows"]}
    assert [rows[(2048, "cuda")]["repeats_run"], rows[(2048, "reference")]["repeats_run"], rows[(8192, "cuda")]["repeats_run"],
            rows[(16384, "cuda")]["repeats_run"]] == [2, 2, 1, 1]
    skipped = rows[(32768, "cuda")]
    assert skipped["status"] == "skipped (time budget)" and skipped["predicted_s"] == pytest.approx(45.3, abs=0.1)
    assert data["config"]["run_config"] == "the given TTTConfig"
    assert bls.repeats_for(3, None, 10) == 3 and bls.repeats_for(3, 2.0, 5.0) == 2 and bls.repeats_for(3, 50.0, 1.0) == 1


def test_runner_last_stage_command_measures_the_recipe_at_2k_to_32k(tmp_path):
    cmd = gpu_check.phase_command("/py", "last_stage", tmp_path, 120.0, gpu_check.FULL)
    assert cmd[1] == str(GPU_DIR / "bench_last_stage.py") and cmd[cmd.index("--out") + 1] == str(tmp_path / "last_stage.json")
    args = bls.parse_args(cmd[2:])
    assert args.contexts == [2048, 8192, 16384, 32768] and args.backends is None  # the recipe's backend + reference
    assert Path(args.run_config) == REPO / "ds_configs" / "run_qwen3_8b.json" and args.repeats == 2
    assert args.budget_s == 120.0 - gpu_check.CHILD_STARTUP_S
    unbuilt = bls.parse_args(gpu_check.phase_command("/py", "last_stage", tmp_path, 120.0, gpu_check.FULL,
                                                     built=False)[2:])
    assert unbuilt.backends == ["reference"]
    assert bls.recipe_ttt().attention_backend == json.loads(
        (REPO / "ds_configs" / "run_qwen3_8b.json").read_text())["ttt"]["attention_backend"]
    assert bls.measurement_plan([8, 2, 4], ["cuda", "reference", "cuda"]) == [("cuda", 2), ("reference", 2), ("cuda", 4),
                                                                                 ("cuda", 8)]


def test_last_stage_of_qwen3_8b_shape_builds_on_the_meta_device():
    """The GPU run's model, built without memory: 9 adaptive layers 27..35 of Qwen3-8B + norm + LM head."""
    from ds_ttt.model.presets import qwen3_8b_config

    cfg = qwen3_8b_config()
    suffix = bls.build_last_stage(cfg, num_adaptive=9, device="meta", dtype=torch.bfloat16)
    assert [layer.layer_idx for layer in suffix.layers] == list(range(27, 36))
    assert all(layer.is_adaptive for layer in suffix.layers)
    assert tuple(suffix.lm_head.weight.shape) == (151936, 4096) and suffix.lm_head.weight.dtype == torch.bfloat16
    attn = suffix.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.head_dim) == (32 * 128, 8 * 128, 128)
    prime = suffix.layers[0].prime_mlp
    assert tuple(prime.gate_proj.weight.shape) == (12288, 4096) and tuple(prime.down_proj.weight.shape) == (4096, 12288)
    trainable = sum(p.numel() for p in bls.trainable_parameters(suffix))
    assert trainable == 9 * (3 * 4096 * 12288 + 4096)  # prime MLPs + prime norms
    total = sum(p.numel() for layer in suffix.layers for p in layer.parameters()) + suffix.lm_head.weight.numel()
    assert 3.7e9 < total + 4096 < 3.8e9  # ~7.4 GB of bf16 weights on the GPU


# ---- first contact: probe, kernels alone, sanitizer ---------------------------------------------------

import first_contact as fc  # noqa: E402
import resource_table as rt  # noqa: E402


class _CorruptProbe:
    """The emulator's probe with one register of one case flipped: what a wrong GPU lane looks like."""

    def __init__(self, inner, case_nthreads, flat_index):
        self.inner, self.device, self.nthreads, self.flat = inner, inner.device, case_nthreads, flat_index
        self.hit = False

    def run_case(self, case):
        u, f = self.inner.run_case(case)
        if not self.hit and case.op == 0 and u.numel() > self.flat:  # the first ldmatrix case
            u = u.clone()
            u[self.flat] ^= 1
            self.hit = True
        return u, f


@pytest.fixture(scope="module")
def emu_probe():
    from ds_ttt.ops.flashbob.probe_builder import load_probe_emu
    from tests.unit import mma_probe_cases as mc

    return mc.Probe(load_probe_emu(), "cpu")


def test_probe_saves_every_lane_and_passes_on_the_emulator(emu_probe, tmp_path):
    rep = fc.run_probe(emu_probe, tmp_path / "probe.json")
    assert rep["ok"], rep["summary"]
    names = [c["name"] for c in rep["cases"]]
    assert len(names) == 12 + 6 + 4 + 3 and names[0] == "ldmatrix_x1_seed0"  # as tests/ops/test_mma_probe_cuda.py
    for c in rep["cases"]:  # every lane of every case is in the file
        assert len(c["got_u"]) + len(c["got_f"]) > 0 and c["num_mismatches"] == 0
    assert json.loads((tmp_path / "probe.json").read_text())["cases"][5]["got_u"] == rep["cases"][5]["got_u"]


def test_probe_names_the_case_lane_and_register_of_a_wrong_value(emu_probe, tmp_path):
    lane, reg = 13, 0  # warp 0: flat index = lane * 4 + register
    rep = fc.run_probe(_CorruptProbe(emu_probe, 64, lane * 4 + reg), tmp_path / "probe.json")
    assert not rep["ok"]
    bad = [c for c in rep["cases"] if not c["ok"]]
    assert [c["name"] for c in bad] == ["ldmatrix_x1_seed0"] and bad[0]["num_mismatches"] == 1
    m = bad[0]["mismatches"][0]
    assert (m["warp"], m["lane"], m["register"]) == (0, lane, reg) and m["got"] == m["expected"] ^ 1
    assert "ldmatrix_x1_seed0: 1 wrong, first at warp 0 lane 13 reg 0" in rep["summary"]


def test_probe_stops_at_a_fault_and_says_where(emu_probe, tmp_path):
    class Faulting:
        device = "cpu"

        def run_case(self, case):
            if case.op == 1:
                raise RuntimeError("mma probe launch failed: an illegal memory access was encountered")
            return emu_probe.run_case(case)
    rep = fc.run_probe(Faulting(), tmp_path / "probe.json")
    assert not rep["ok"] and "illegal memory access" in rep["cases"][-1]["error"]
    assert rep["cases"][-1]["name"] == "mma_exact_bf16_d_new" and "later cases not run" in rep["error"]


@pytest.fixture(scope="module")
def emu_op():
    from ds_ttt.ops.flashbob.builder import load_cuda_emu_op

    return load_cuda_emu_op()


SMALL = [("gqa_window_d64_bf16", 1, 2, 1, None, 64, torch.bfloat16, dict(causal=True, window=20))]


@pytest.mark.parametrize("launcher", ["fwd", "bwd", "bwd_bwd"])
def test_each_launcher_alone_passes_on_the_emulated_kernels(emu_op, launcher, tmp_path):
    rep = fc.run_launcher(emu_op, launcher, n=40, device="cpu", out=tmp_path / "k.json", cases=SMALL)
    assert rep["ok"], rep["summary"]
    assert list(rep["cases"][0]["kernels"]) == [k for k, _ in fc.KERNEL_OUTPUTS[launcher]]


class _Wrong:
    """The emulated op with one output element changed, or a launch that faults in a named kernel."""

    def __init__(self, inner, *, bump=None, fault=None):
        self.inner, self.bump, self.fault = inner, bump, fault

    def fwd(self, *a):
        return self.inner.fwd(*a)

    def bwd(self, *a):
        return self.inner.bwd(*a)

    def bwd_bwd(self, *a):
        if self.fault:
            raise RuntimeError(f"flashbob cuda bwd_bwd failed in {self.fault}: an illegal memory access")
        out = list(self.inner.bwd_bwd(*a))
        if self.bump is not None:
            i, idx = self.bump
            out[i] = out[i].clone()
            out[i][idx] += 10.0
        return out


def test_a_wrong_output_names_its_kernel_and_first_wrong_element(emu_op):
    rep = fc.run_launcher(_Wrong(emu_op, bump=(0, (0, 1, 7, 3))), "bwd_bwd", n=40, device="cpu", cases=SMALL)
    ks = rep["cases"][0]["kernels"]
    assert not rep["ok"] and ks["bob_stats_kernel"]["ok"] and ks["bob_col_kernel"]["ok"]
    qbar = ks["bob_row_kernel"]["outputs"][0]
    assert qbar["output"] == "qbar" and not qbar["ok"] and qbar["first_wrong"]["index"] == [0, 1, 7, 3]
    assert "bob_row_kernel" in rep["summary"] and "qbar[0, 1, 7, 3]" in rep["summary"]


def test_a_fault_is_pinned_on_the_kernel_the_binding_names(emu_op):
    rep = fc.run_launcher(_Wrong(emu_op, fault="bob_col_kernel"), "bwd_bwd", n=40, device="cpu", cases=SMALL)
    v = rep["cases"][0]["kernels"]["bob_col_kernel"]
    assert not rep["ok"] and v["named_by"] == "the binding" and "illegal memory access" in v["error"]
    assert list(rep["cases"][0]["kernels"]) == ["bob_col_kernel"]


def _fake_children(monkeypatch, writer):
    """run_child that records (cmd, env) and lets `writer` produce the child's output file and result."""
    calls = []

    def fake(cmd, *, timeout, log, env=None, cwd=None, prefix=""):
        calls.append((cmd, env or {}))
        return {"rc": 0, "timed_out": False, "seconds": 0.1, "tail": "", **(writer(cmd) or {})}
    monkeypatch.setattr(gpu_check, "run_child", fake)
    return calls


def test_kernels_phase_runs_each_launcher_in_its_own_blocking_process(tmp_path, monkeypatch):
    ctx = _context(tmp_path)

    def writer(cmd):
        launcher, out = cmd[cmd.index("--launcher") + 1], Path(cmd[cmd.index("--out") + 1])
        ok = launcher != "bwd"
        kernels = {k: {"ok": ok or k == "bwd_row_kernel", "outputs": []} for k, _ in fc.KERNEL_OUTPUTS[launcher]}
        out.write_text(json.dumps({"ok": ok, "cases": [{"case": "c", "kernels": kernels}],
                                   "summary": "" if ok else "bwd_col_kernel (c): dk max err 1 > tol 0.1; first wrong dk[0, 0, 5, 2]"}))
        return {"rc": 0 if ok else 1}
    calls = _fake_children(monkeypatch, writer)
    gpu_check.phase_kernels(ctx, 60)
    assert [c[0][c[0].index("--launcher") + 1] for c in calls] == ["fwd", "bwd", "bwd_bwd"]
    assert all(env.get("CUDA_LAUNCH_BLOCKING") == "1" for _, env in calls)
    checks = {c["name"]: c for c in ctx.setup.data["checks"]}
    assert len(checks) == 6 and all(k in " ".join(checks) for k in fc.KERNELS)
    bad = [c for c in checks.values() if not c["ok"]]
    assert [c["name"] for c in bad] == ["kernels: bwd_col_kernel alone at N=96"] and "dk[0, 0, 5, 2]" in bad[0]["detail"]


def test_probe_phase_writes_the_lanes_into_setup_json(tmp_path, monkeypatch):
    ctx = _context(tmp_path)

    def writer(cmd):
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(
            {"ok": False, "cases": [{"name": "mma_exact_bf16_d_new", "ok": False, "got_f": [1.0] * 256}],
             "summary": "1 of 1 probe cases wrong: mma_exact_bf16_d_new: 3 wrong, first at warp 1 lane 4 reg 2"}))
        return {"rc": 1}
    calls = _fake_children(monkeypatch, writer)
    gpu_check.phase_probe(ctx, 30)
    assert calls[0][0][2] == "probe"
    setup = json.loads((ctx.out / "setup.json").read_text())
    assert len(setup["probe"]["cases"][0]["got_f"]) == 256
    assert not setup["checks"][0]["ok"] and "warp 1 lane 4 reg 2" in setup["checks"][0]["detail"]


def test_sanitizer_phase_records_a_skip_without_the_tool_and_errors_with_it(tmp_path, monkeypatch):
    ctx = _context(tmp_path)
    monkeypatch.setattr(gpu_check, "find_sanitizer", lambda env: None)
    calls = _fake_children(monkeypatch, lambda cmd: None)
    gpu_check.phase_sanitizer(ctx, 60)
    assert calls == [] and "not in this image" in ctx.setup.data["sanitizer"]["skipped"]
    assert ctx.setup.data["checks"] == []  # a recorded skip, not a failure
    (tmp_path / "b").mkdir()
    ctx = _context(tmp_path / "b")
    monkeypatch.setattr(gpu_check, "find_sanitizer", lambda env: "/opt/cuda/bin/compute-sanitizer")
    tails = {"memcheck": "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors",
             "racecheck": "========= Error: Race reported between Write access at bob_row_kernel+0x1a0\n"
                          "========= ERROR SUMMARY: 2 errors",
             "synccheck": "========= ERROR SUMMARY: 0 errors"}
    calls = _fake_children(monkeypatch, lambda cmd: {"tail": tails[cmd[2]], "rc": 9 if cmd[2] == "racecheck" else 0})
    gpu_check.phase_sanitizer(ctx, 60)
    assert [c[0][2] for c in calls] == ["memcheck", "racecheck", "synccheck"]
    assert all(env["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1" and "--first-case-only" in cmd for cmd, env in calls)
    res = {c["name"].split(":")[1].split()[0]: c for c in ctx.setup.data["checks"]}
    assert res["memcheck"]["ok"] and res["synccheck"]["ok"] and not res["racecheck"]["ok"]
    assert "2 errors" in res["racecheck"]["detail"] and "bob_row_kernel+0x1a0" in res["racecheck"]["detail"]


JUNIT_ONE_MODULE_SKIPPED = (
    '<testsuites><testsuite tests="3" failures="0" errors="0" skipped="1">'
    '<testcase classname="tests.ops.test_mma_probe_cuda" name="test_pack_identical"/>'
    '<testcase classname="tests.ops.test_event_loop_syncs" name="test_syncs"/>'
    '<testcase classname="" name="tests.ops.test_flashbob_cuda"><skipped type="pytest.skip" '
    'message="flashbob cuda builder incompatible: no nvcc"/></testcase></testsuite></testsuites>')


def test_a_module_skipped_as_a_whole_fails_the_tests_phase(tmp_path, monkeypatch):
    ctx = _context(tmp_path)

    def writer(cmd):
        junit = next(a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml="))
        Path(junit).write_text(JUNIT_ONE_MODULE_SKIPPED)
    _fake_children(monkeypatch, writer)
    gpu_check.phase_tests(ctx, 60)
    check = ctx.setup.data["checks"][-1]
    assert not check["ok"] and "test_flashbob_cuda: all 1 skipped (flashbob cuda builder incompatible: no nvcc)" \
        in check["detail"]
    counts = gpu_check.parse_junit(tmp_path / "ops.xml", ["test_flashbob_cuda", "test_mma_probe_cuda", "test_new"])
    assert gpu_check.skipped_modules(counts) == [
        "test_flashbob_cuda: all 1 skipped (flashbob cuda builder incompatible: no nvcc)",
        "test_new: not in the report (not collected)"]


def test_results_stay_within_eight_files_and_the_first_contact_comes_first():
    assert {k: tuple(n for n, _ in v) for k, v in fc.KERNEL_OUTPUTS.items()} == gpu_check.LAUNCHER_KERNELS
    # the device tool brings back 8 files: the default phases write that many (balance runs in a call of its own)
    assert len(gpu_check.files_written(gpu_check.DEFAULT_PHASES)) <= gpu_check.MAX_FILES == 8
    assert set(gpu_check.files_written(gpu_check.PHASES)) == set(gpu_results.RESULT_FILES)
    order = list(gpu_check.PHASES)
    assert order.index("build") < order.index("probe") < order.index("kernels") < order.index("sanitizer") \
        < order.index("tests") < order.index("flashbob") < order.index("last_stage") < order.index("trainer")
    assert gpu_check.parse_args([]).total_s <= 570  # with the env probe and the summary, inside the tool's 600-s call


# ---- per-kernel profiler times and the two FLOP counts ------------------------------------------------

class _Evt:
    def __init__(self, key, us, count):
        self.key, self.device_time_total, self.count = key, us, count


def _emulated_attn(q, k, v):
    """The CUDA kernels through the CPU emulator, causal (what flashbob_attn("cuda") runs on a GPU)."""
    from ds_ttt.ops.flashbob.function import AttnFunc

    return AttnFunc.apply(q, k, v, "cuda_emu", True, q.shape[-1] ** -0.5, 0, k.shape[2] - q.shape[2], 0)


def test_tile_sweep_runs_every_set_on_the_emulator_and_names_the_fastest(emu_op):
    """The sweep's loop on the emulated kernels: on an emulated H100 all four tile sets run (each
    through the tripwire against fp32 math), on an emulated A100 the sm_90-only sets are recorded
    with the binding's reason; a set over the time budget is skipped; the summary shows the table."""
    x = bfc.make_inputs(32, heads_q=1, heads_kv=1, head_dim=128, device="cpu")
    check_x = bfc.make_inputs(24, heads_q=1, heads_kv=1, head_dim=128, device="cpu", seed=1)
    try:
        emu_op.set_emulated_device(9, 0, 227 * 1024)
        rec, bad = bfc.tile_sweep(emu_op, _emulated_attn, x, n=32, head_dim=128, budget_s=600, check_x=check_x,
                                  cuda=False)
        assert bad == [] and rec["default_set"] == "sm90"
        assert [r["name"] for r in rec["sets"]] == ["sm80", "sm90", "sm80_half_bn", "sm90_half_bn"]
        assert all(r["status"] == "ok" and max(r["rel_err"].values()) < bfc.TRIPWIRE_REL_ERR for r in rec["sets"])
        assert rec["sets"][1]["shapes"]["bob_row_kernel"] == "128/32/8" and rec["sets"][1]["default"]
        assert rec["sets"][2]["shapes"]["bob_col_kernel"] == "64/16/4"
        assert rec["best"]["wall"]["set"] in {r["name"] for r in rec["sets"]}
        emu_op.set_emulated_device(8, 0, 163 * 1024)
        rec, bad = bfc.tile_sweep(emu_op, _emulated_attn, x, n=32, head_dim=128, budget_s=0.0, cuda=False)
        assert rec["default_set"] == "sm80" and rec["sets"][0]["status"] == "ok"
        assert rec["sets"][1]["status"].startswith("skipped (time budget)")  # the first set's cost is over
        rec, _ = bfc.tile_sweep(emu_op, _emulated_attn, x, n=32, head_dim=128, budget_s=600, cuda=False)
        assert "compiled for sm_90 and later; this GPU is sm_80" in rec["sets"][1]["status"]
        assert [r["status"] for r in rec["sets"]].count("ok") == 1
    finally:
        emu_op.set_emulated_device(8, 0, 163 * 1024)
    sweep = {"n": 8192, "default_set": "sm90", "note": "decide by measurement", "best": {
        "bob_row_kernel": {"set": "sm80", "ms_per_step": 1.0, "shape": "64/32/4", "default_is_best": False}},
        "sets": [{"name": "sm80", "status": "ok", "default": False, "shapes": {"bob_row_kernel": "64/32/4"},
                  "kernels_ms": {"bob_row_kernel": 1.0}, "total_ms": 1.0},
                 {"name": "sm90", "status": "ok", "default": True, "shapes": {"bob_row_kernel": "128/32/8"},
                  "kernels_ms": {"bob_row_kernel": 2.0}, "total_ms": 2.0},
                 {"name": "sm90_half_bn", "status": "skipped (time budget)"}]}
    text = "\n".join(gpu_results._sweep_section(sweep))
    assert "| kernel | sm80 | sm90 (default) |" in text and "| bob_row_kernel | **1.00 (64/32/4)** | 2.00 (128/32/8) |" in text
    assert "| six kernels | 1.00 | 2.00 |" in text
    assert "Not timed: sm90_half_bn: skipped (time budget)." in text


def test_kernel_times_and_both_flop_counts():
    ev = [_Evt("void flashbob::(anonymous namespace)::bob_row_kernel<__nv_bfloat16, 128, flashbob::Tiles<64, 32, 4> >"
               "(...)", 3000.0, 3), _Evt("void flashbob::(anonymous namespace)::fwd_kernel<__nv_bfloat16, 128, "
                                         "flashbob::Tiles<64, 64, 4> >(...)", 600.0, 3),
          _Evt("void at::native::elementwise_kernel<128, 4>(...)", 300.0, 30), _Evt("cudaLaunchKernel", 0.0, 9)]
    t = bfc.kernel_times(ev, reps=3)
    assert t["bob_row_kernel"] == {"ms_per_step": 1.0, "calls_per_step": 1.0}
    assert t["fwd_kernel"]["ms_per_step"] == pytest.approx(0.2) and t["other"]["ms_per_step"] == pytest.approx(0.1)
    for k in bfc.KERNEL_GEMMS:
        t.setdefault(k, {"ms_per_step": 0.0, "calls_per_step": 0.0})
    t = {k: ({"ms_per_step": 1.0, "calls_per_step": 1.0} if k in bfc.KERNEL_GEMMS else v) for k, v in t.items()}
    p = bfc.kernel_profile(t, n=8192, heads_q=32, head_dim=128)
    unit = 8192 ** 2 * 128 * 32 * 0.5
    assert p["useful_flop"] == 50 * unit and p["executed_flop"] == 62 * unit
    assert p["useful_tflops"] == pytest.approx(50 * unit / 6e-3 / 1e12)
    assert p["executed_tflops"] / p["useful_tflops"] == pytest.approx(62 / 50)
    assert p["kernels"]["bob_row_kernel"]["executed_tflops"] == pytest.approx(14 * unit / 1e-3 / 1e12)
    assert "50·N²·D" in p["flop_counts"]["useful"] and "62·N²·D" in p["flop_counts"]["executed"]


def test_kernel_gemm_counts_match_the_kernel_source_header():
    text = (REPO / "ds_ttt/ops/flashbob/csrc/flashbob_cuda_kernel.cu").read_text().split("#ifdef")[0]
    for kernel, gemms in bfc.KERNEL_GEMMS.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(f"//   {kernel} "))
        nums = [int(x) for x in __import__("re").findall(r"\s(\d+)(?: \+ (\d+))?(?: GEMMs per tile pair)?\s*$",
                                                          line)[0] if x]
        assert sum(nums) == gemms, (kernel, line)
    assert bfc.EXECUTED_PER_STEP == 62 and bfc.USEFUL_PER_STEP == 50


# ---- resource usage table from the committed cuobjdump log -------------------------------------------

SAMPLE_DUMP = """
Fatbin elf code:
================
arch = sm_80

Resource usage:
 Function _ZN8flashbob12_GLOBAL__N_114bob_row_kernelI13__nv_bfloat16Li128ENS_5TilesILi128ELi32ELi8ELi900EEEEEvPKT_:
  REG:4 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin elf code:
================
arch = sm_90
code version = [1,8]
host = linux
compile_size = 64bit

Resource usage:
 Common:
  GLOBAL:0
 Function _ZN8flashbob12_GLOBAL__N_114bob_row_kernelI13__nv_bfloat16Li128ENS_5TilesILi64ELi32ELi4ELi800EEEEEvPKT_:
  REG:255 STACK:48 SHARED:0 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN8flashbob12_GLOBAL__N_114bob_row_kernelI6__halfLi128ENS_5TilesILi64ELi32ELi4ELi800EEEEEvPKT_:
  REG:255 STACK:48 SHARED:0 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN8flashbob12_GLOBAL__N_114bob_row_kernelI13__nv_bfloat16Li128ENS_5TilesILi128ELi32ELi8ELi900EEEEEvPKT_:
  REG:232 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN9mma_probe6kernelEv:
  REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:400 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_resource_table_parses_cuobjdump():
    u = rt.parse(SAMPLE_DUMP)
    assert u[("sm_90", "bob_row_kernel", "bf16", 128, "64/32/4")] == {"REG": 255, "STACK": 48, "LOCAL": 0,
                                                                     "SHARED": 0, "stub": 0}
    assert u[("sm_80", "bob_row_kernel", "bf16", 128, "128/32/8")]["stub"] == 1  # an sm_90 shape in sm_80 code
    assert u[("sm_90", "bob_row_kernel", "bf16", 128, "128/32/8")]["stub"] == 0 and len(u) == 4
    table = rt.table(u)
    assert "| bob_row | 128 | 64/32/4 | bf16, fp16 | missing | missing | missing | missing | 255 | 48 | 0 | 0 |" in table
    assert "| bob_row | 128 | 128/32/8 | bf16 | – | – | – | – | 232 | 0 | 0 | 0 |" in table
    assert "| fwd | 64 | ? | bf16, fp16 | missing" in table
    with pytest.raises(ValueError, match="no FlashBoB kernel"):
        rt.table(rt.parse("nothing here"))


def test_docs_table_is_the_one_generated_from_the_committed_log():
    log = REPO / "gpu_check/logs/cuobjdump_resource_usage.txt"
    doc = (REPO / "docs/flashbob.md").read_text()
    usage = rt.parse(log.read_text())
    compiled = {k: v for k, v in usage.items() if not v["stub"]}
    for arch in ("sm_80", "sm_90"):  # every kernel x dtype x head dim has compiled code on both
        have = {k[1:4] for k in compiled if k[0] == arch}
        assert have == {(f, dt, D) for f in rt.FAMILIES for dt in ("bf16", "fp16") for D in (64, 128)}, arch
    assert rt.replace_block(doc, rt.render(log.read_text())) == doc, \
        "docs/flashbob.md is stale: python gpu_check/resource_table.py --write docs/flashbob.md"


def test_no_kernel_of_the_prebuilt_library_spills():
    """The GPU check's review found stack frames in the BoB kernels at D = 128 on sm_80 (row pass 32 B,
    column pass 24 B): local memory in the hottest loops. The committed log of the shipped objects
    must show none for any kernel compiled for real, on either architecture, with every tile set's
    shapes there (the sm90 set's 8-warp blocks on sm_90)."""
    usage = rt.parse((REPO / "gpu_check/logs/cuobjdump_resource_usage.txt").read_text())
    compiled = {k: v for k, v in usage.items() if not v["stub"]}
    spills = {k: (v["STACK"], v["LOCAL"]) for k, v in compiled.items() if v["STACK"] or v["LOCAL"]}
    assert not spills, spills
    assert ("sm_90", "bob_row_kernel", "bf16", 128, "128/32/8") in compiled
    assert ("sm_80", "bob_row_kernel", "fp16", 128, "64/32/4") in compiled
    assert all(v["REG"] <= 255 for v in compiled.values())


# ---- the prebuilt kernels' manifest ------------------------------------------------------------------------

def test_prebuild_check_uses_the_loaders_rule(tmp_path):
    """`prebuild_ops.py --check` says whether the folder is what load_cuda_op would use on an H200: current
    sources' sha256, sm_90 in the archs, the files there (failed on the code before: no such check)."""
    import prebuild_ops
    from ds_ttt.ops.flashbob.builder import sources_digest

    folder = tmp_path / "prebuilt"
    folder.mkdir()
    (folder / "libflashbob_cuda.so").write_bytes(b"\x7fELF")
    entry = {"file": "libflashbob_cuda.so", "abi": "c", "gpu": True}
    manifest = {"torch": "2.14.1+cu130", "python": "3.11", "arch_list": "8.0;9.0", "sources_sha256": sources_digest(),
                "modules": {"ds_ttt_flashbob_cuda": entry, "ds_ttt_mma_probe_cuda": entry}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    ok, lines = prebuild_ops.check_current(folder)
    assert ok and "ds_ttt_flashbob_cuda: current for sm_90" in "\n".join(lines)
    assert not prebuild_ops.check_current(folder, (10, 0))[0]  # no cubin for a newer major
    (folder / "manifest.json").write_text(json.dumps({**manifest, "sources_sha256": "0" * 64}))
    ok, lines = prebuild_ops.check_current(folder)
    assert not ok and "kernel sources changed" in "\n".join(lines)
    (folder / "manifest.json").unlink()
    ok, lines = prebuild_ops.check_current(folder)
    assert not ok and "bash gpu_check/prebuild.sh" in lines[0]
    r = subprocess.run([sys.executable, str(GPU_DIR / "prebuild_ops.py"), "--check", "--out", str(folder)], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert r.returncode == 1 and "STALE" in r.stdout
