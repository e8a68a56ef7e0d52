"""benchmarks/adaptation_baselines.sh end to end at smoke size (SMOKE=1): data, held-out sets, the task
suite, the six trained models through the real deepspeed launcher (2 CPU ranks each) and the two
dynamic-evaluation controls, teacher-forced scoring, the closed-loop tasks, both reports with their schema.

    python -m pytest tests/e2e/test_adaptation_baselines_smoke.py        (~3 min on 2 cores)
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from ds_ttt.evaluation.comparison import ROW_METRICS

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_baselines_smoke_writes_every_row_with_intervals(tmp_path):
    work = tmp_path / "work"
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path / "report"), "OUT_TASKS": str(tmp_path / "agent_tasks")}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/adaptation_baselines.sh"), str(work)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "report.md").read_text().startswith("# TTT against the ordinary agent")
    assert (tmp_path / "report.png").stat().st_size > 10_000
    got = {(r["model"], r["mode"]) for r in report["rows"]}
    ttt_rows = {(m, mode) for m in ("ttt_current", "ttt_full", "ttt_first_order") for mode in ("ttt", "frozen")}
    dyn_rows = {(m, mode) for m in ("dyn_sft_full", "dyn_sft_current") for mode in ("ttt", "frozen")}
    assert got == ttt_rows | dyn_rows | {("sft_full", "sft"), ("sft_current", "sft"), ("sft_full_compute", "sft")}
    for r in report["rows"]:
        assert r["eval_policy"] == r["train_policy"] and r["ablation"] == (r["mode"] == "frozen")
        if r["model"].startswith("dyn_"):  # dynamic evaluation: its frozen mode is the SFT model itself
            sft = next(x for x in report["rows"] if x["model"] == r["model"][4:])
            if r["mode"] == "frozen":
                assert r["action_nll"] == pytest.approx(sft["action_nll"], rel=1e-6)
        for k in ROW_METRICS:
            assert k in r and f"{k}_lo" in r and f"{k}_hi" in r
        assert r["recovery_nll"] > 0 and r["recovery_nll_lo"] <= r["recovery_nll_hi"]
    # the SFT rows really have no adaptive layers and the TTT rows do (the trainer's run record)
    for name, adaptive in (("sft_full", 0), ("ttt_current", 2), ("dyn_sft_full", 2)):
        row = json.loads((work / f"{name}.row.json").read_text())
        assert row["adaptive_layers"] == adaptive
    assert json.loads((work / "ttt_first_order.row.json").read_text())["ttt"]["first_order"] is True
    assert {p["metric"] for p in report["paired_differences"]} == {"action_nll", "recovery_nll"}
    assert len(report["paired_differences"]) == 2 * 28  # every pair of the eight models, two metrics
    assert report["sft_full_compute_steps"] >= 1
    tasks = json.loads((tmp_path / "agent_tasks.json").read_text())
    assert {(r["model"], r["mode"]) for r in tasks["rows"]} == ttt_rows | {
        ("dyn_sft_full", "ttt"), ("dyn_sft_current", "ttt"), ("sft_full", "sft"), ("sft_current", "sft"),
        ("sft_full_compute", "sft")}
    for r in tasks["rows"]:
        assert r["tasks"] == tasks["suite"]["num_tasks"] and r["success_lo"] <= r["success_hi"]
    assert {(p["a"], p["b"]) for p in tasks["paired"]} >= {("ttt_full/ttt", "dyn_sft_full/ttt"),
                                                           ("ttt_current/ttt", "ttt_first_order/ttt")}
    assert report["load"]["start"] is not None and report["load"]["end"] is not None
    assert "adaptation_baselines.sh" in report["command"] and report["seeds"]["max_steps"] == 4
    sets = report["sets"]["files"]
    assert sets["memory_worlds"]["num"] == 4 and sets["recovery_episodes"]["recovery_rounds"] >= 3
    assert sets["memory_worlds_train_pool"]["num"] == 4
