"""The GPU check's serve_concurrency phase, without CUDA: the flags it gives benchmarks/serve_concurrency.py
(parsed by the script's own parser), its rows, ratios and targets from the script's JSON, a timeout, the
runner's command and its place in the plan, and the whole path run for real on the CPU with the tiny
backbone (`--device cpu --tiny`: the script, its server in its own process, the phase file, the summary).

    .venv/bin/python -m pytest gpu_check/tests/test_gpu_serve_phase.py -q
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_DIR = REPO / "gpu_check"
sys.path.insert(0, str(GPU_DIR))

import bench_serve_concurrency as bsc  # noqa: E402
import gpu_check  # noqa: E402
import gpu_results  # noqa: E402


def _arg(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def _script():
    spec = importlib.util.spec_from_file_location("serve_concurrency", REPO / "benchmarks" / "serve_concurrency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_phase_flags_are_serve_concurrency_flags():
    cmd = bsc.serve_command("/py", Path("/tmp/unused"), 90.0, sandboxed=False)
    args = _script().parse_args(cmd[2:])
    assert (args.device, args.shape, args.level_list, args.only_batched) == ("cuda", "qwen3-0.6b", [1, 8, 32], True)
    assert (args.max_tokens, args.repeats, args.pairs, args.no_isolation) == (bsc.MAX_TOKENS, 0, bsc.PAIRS, True)
    assert args.budget_s == 90.0 - bsc.SHUTDOWN_S and args.max_load > 100
    tiny = _script().parse_args(bsc.serve_command("/py", Path("/tmp/unused"), 90.0, device="cpu", tiny=True)[2:])
    assert (tiny.device, tiny.shape, tiny.max_tokens, tiny.no_isolation) == ("cpu", "tiny-mem", 4, False)
    assert _script().SHAPES["qwen3-0.6b"] == {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                                              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}


def _result(decode: dict[int, list[float]]) -> dict:
    """serve_concurrency's JSON (as json.dumps writes it: level keys are strings) for made-up paired rounds."""
    sc = _script()
    levels = sorted(decode)
    rounds = {n: [{"decode_tokens_per_s": v, "tokens_per_s": v / 2} for v in vs] for n, vs in decode.items()}
    table = {n: {"tokens_per_s": vs[0] / 2, "p50_ms": 10.0, "p95_ms": 12.0, "decode_tokens_per_s": vs[0],
                 "mean_batch": float(n)} for n, vs in decode.items()}
    res = {"levels": levels, "table": {"batched": table}, "pairs": len(decode[1]),
           "paired_decode_speedup": sc.paired_ratios(rounds, levels, "decode_tokens_per_s"),
           "machine": {"cpu_model": "Test CPU", "gpu": "Test GPU", "device": "cuda"},
           "one_session_decode_tokens_per_s": decode[1][0]}
    return json.loads(json.dumps(res))


def test_the_phase_turns_the_script_output_into_rows_and_targets(tmp_path, capsys):
    res = _result({1: [30.0, 30.0, 30.0], 8: [210.0, 210.0, 210.0], 32: [450.0, 450.0, 450.0]})

    def fake(cmd, *, timeout, log, prefix="", **_):
        out_dir = Path(_arg(cmd, "--out"))
        (out_dir / "serve_concurrency_qwen3-0.6b.json").write_text(json.dumps(res))
        return {"rc": 0, "timed_out": False, "seconds": 60.0, "tail": ""}
    out = tmp_path / "serve_concurrency_gpu.json"
    bsc.run(out=str(out), budget_s=90, python="/py", runner=fake)
    data = json.loads(out.read_text())
    assert data["status"] == "ok" and [r["sessions"] for r in data["rows"]] == [1, 8, 32]
    assert [r["decode_vs_one"] for r in data["rows"]] == pytest.approx([1.0, 7.0, 15.0])
    assert [(t["sessions"], t["met"]) for t in data["targets"]] == [(8, True), (32, False)]  # x7 >= 6, x15 < 16
    printed = capsys.readouterr().out
    assert "8 sessions vs one: x7.00 [7.00, 7.00] over 3 paired rounds; target >= x6: met" in printed
    assert "32 sessions vs one: x15.00 [15.00, 15.00] over 3 paired rounds; target >= x16: NOT met" in printed
    assert gpu_results.failed_checks(tmp_path) == []  # a missed target is not a failed check
    summary = gpu_results.render_summary(tmp_path)
    assert "## Serving concurrency on the GPU" in summary and "Ran on Test GPU" in summary


def test_the_phase_records_a_timeout(tmp_path):
    def fake(cmd, *, timeout, log, prefix="", **_):
        return {"rc": -9, "timed_out": True, "seconds": timeout, "tail": "round 1 ..."}
    out = tmp_path / "serve_concurrency_gpu.json"
    bsc.run(out=str(out), budget_s=60, python="/py", runner=fake)
    data = json.loads(out.read_text())
    assert data["status"] == "timeout" and not data["checks"][0]["ok"]
    assert "timed out after 60 s" in data["checks"][0]["detail"]


def test_the_runner_builds_the_phase_and_plans_it_after_the_trainer(tmp_path):
    cmd = gpu_check.phase_command("/py", "serve_concurrency", tmp_path, 90.0, gpu_check.FULL)
    assert cmd[1] == str(GPU_DIR / "bench_serve_concurrency.py") and _arg(cmd, "--budget-s") == "85"
    assert _arg(cmd, "--out") == str(tmp_path / "serve_concurrency_gpu.json")
    phases = gpu_check.parse_args([]).phases
    assert phases.index("trainer") + 1 == phases.index("serve_concurrency") and "serve_concurrency" in gpu_check.NEEDS_MINIMUM
    plan = gpu_check.describe_plan(gpu_check.parse_args([]))
    assert "serve_concurrency limit    90 s; reserved minimum  60 s" in plan and "warning" not in plan
    assert "warning: these phases write 9 files" in gpu_check.describe_plan(
        gpu_check.parse_args(["--phases", ",".join(gpu_check.PHASES)]))


@pytest.mark.slow
def test_the_phase_runs_on_the_cpu_with_the_tiny_backbone(tmp_path):
    """The real path: benchmarks/serve_concurrency.py and its server on the CPU, 1 / 8 / 32 sessions of
    4-token replies, 2 paired rounds; the phase file holds every level and what it ran on."""
    out = tmp_path / "serve_concurrency_gpu.json"
    rec = bsc.run(out=str(out), budget_s=280, device="cpu", tiny=True)
    data = json.loads(out.read_text())
    assert rec.data["status"] == data["status"] == "ok", data["checks"]
    assert [r["sessions"] for r in data["rows"]] == [1, 8, 32] and all(r["decode_tokens_per_s"] > 0 for r in data["rows"])
    assert data["machine"]["device"] == "cpu" and data["machine"]["cpu_model"] and data["pairs"] >= 1
    assert [t["sessions"] for t in data["targets"]] == [8, 32]
