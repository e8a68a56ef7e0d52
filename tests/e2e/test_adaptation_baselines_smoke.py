"""benchmarks/adaptation_baselines.sh end to end at smoke size (SMOKE=1): data, held-out sets, the test
and dev task suites, the six trained models of training seed 0 through the real deepspeed launcher
(2 CPU ranks each) and the two dynamic-evaluation controls with their inner step swept on the dev suite,
teacher-forced scoring, the closed-loop tasks, both reports with their schema (per-seed pairs, `pooled`,
the sweeps). Then the same command again: every step and row is found complete and skipped (the resume
after a kill), and the report is rebuilt from what is there. Last, the closed-loop report over two seeds
(seed 0's scored files relabelled as seed 1): pooled over identical seeds equals the one seed.

    python -m pytest tests/e2e/test_adaptation_baselines_smoke.py        (~4 min on 2 idle cores)
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from ds_ttt.evaluation.comparison import ROW_METRICS

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ("ttt_current", "ttt_full", "sft_full", "sft_current", "ttt_first_order", "sft_full_compute", "dyn_sft_full",
          "dyn_sft_current")
pytestmark = pytest.mark.slow


def test_baselines_smoke_writes_every_row_with_intervals(tmp_path):
    work = tmp_path / "work"
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path / "report"), "OUT_TASKS": str(tmp_path / "agent_tasks")}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/adaptation_baselines.sh"), str(work)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seed0 = work / "seed_0"
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
        row = json.loads((seed0 / f"{name}.row.json").read_text())
        assert row["adaptive_layers"] == adaptive
    assert json.loads((seed0 / "ttt_first_order.row.json").read_text())["ttt"]["first_order"] is True
    # the main recipe's run config: the round address wherever current_round allows it, off elsewhere
    ttt_of = {name: json.loads((seed0 / f"{name}.row.json").read_text())["ttt"]
              for name in ("ttt_current", "ttt_first_order", "ttt_full", "sft_full", "sft_current")}
    assert ttt_of["ttt_current"]["round_address"] and ttt_of["ttt_first_order"]["round_address"]
    assert not any(ttt_of[n]["round_address"] for n in ("ttt_full", "sft_full", "sft_current"))
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
    assert {p["seed"] for p in tasks["paired"]} == {0}
    pooled = {(p["a"], p["b"]): p for p in tasks["pooled"] if p["subset"] == "all"}
    assert {(p["a"], p["b"]) for p in tasks["paired"]} == set(pooled)
    observed = [p for p in tasks["pooled"] if p["subset"] == "needs_observation"]  # only when some kind is fixed-script
    fixed_script = [k for k, v in tasks["suite"]["kinds"].items() if v.get("needs_observation") is False]
    assert len(observed) == (len(pooled) if fixed_script else 0)
    assert all(p["kinds"] == pooled[(p["a"], p["b"])]["kinds"] - len(fixed_script) for p in observed)
    for p in tasks["paired"]:  # one seed: pooled is that seed's difference and kind-resampling interval
        q = pooled[(p["a"], p["b"])]
        assert q["seeds"] == [0] and (q["diff"], q["lo"], q["hi"]) == pytest.approx((p["diff"], p["kinds_lo"], p["kinds_hi"]))
        assert q["wins"] == int(p["diff"] > 0) and q["metric"] == "pass@1"
    # dynamic evaluation: a dev sweep per SFT model, the chosen setting is the one scored on the test suite
    assert [(s["label"], s["seed"], len(s["grid"])) for s in tasks["dynamic_eval_sweep"]] == [
        ("dyn_sft_full", 0, 2), ("dyn_sft_current", 0, 2)]
    for sweep in tasks["dynamic_eval_sweep"]:
        assert sweep["suite"]["split"] == "dev" and {g["inner_lr"] for g in sweep["grid"]} == {0.1, 1.0}
        test_run = json.loads((seed0 / f"{sweep['label']}.tasks.json").read_text())
        inner = test_run["provenance"]["dynamic_eval_inner"]
        assert {k: inner[k] for k in sweep["chosen"]} == sweep["chosen"] == {
            k: test_run["provenance"]["dynamic_eval_overrides"][k] for k in sweep["chosen"]}
    assert "Pooled over training seeds 0" in (tmp_path / "agent_tasks.md").read_text()
    # what every model ran, episode by episode: one JSONL per closed-loop row, its commands in each line
    logs = sorted(p.name for p in (work / "episodes" / "seed0").iterdir())
    assert logs == sorted(f"{r['model']}.{r['mode']}.jsonl" for r in tasks["rows"])
    lines = [json.loads(x) for x in (work / "episodes" / "seed0" / "ttt_current.ttt.jsonl").read_text().splitlines()]
    assert len(lines) == tasks["suite"]["num_tasks"] and [e["task"] for e in lines] == sorted(e["task"] for e in lines)
    scored = json.loads((seed0 / "ttt_current.tasks.json").read_text())["modes"]["ttt"]["episodes"]
    assert {e["task"]: e["actions"] for e in lines} == {e["task"]: e["actions"] for e in scored}  # (smoke models: often none)

    # the same command again, as after the main job (MAIN: its data, sets, suite and model, the seed read from
    # its run config): everything is there, so every step is skipped and only the reports are rebuilt
    main = tmp_path / "main"
    main.mkdir()
    for name, target in (("data", work / "data"), ("sets", work / "sets"), ("tasks", work / "tasks"),
                         ("run", seed0 / "ttt_current")):
        (main / name).symlink_to(target)
    again = subprocess.run(["bash", str(ROOT / "benchmarks/adaptation_baselines.sh"), str(work)], cwd=ROOT,
                           env={**env, "MAIN": str(main)}, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"[baselines] data: {main}/data/manifest.json" in again.stdout
    skipped = [line for line in (again.stdout + again.stderr).splitlines() if line.endswith("exists, skipped")]
    assert "[baselines] seed 0 ttt_current (the main job's model, " in "\n".join(skipped)
    assert len(skipped) == 3 + 6 + 8 + 2 * 2 + 8, "\n".join(skipped)  # sets, 2 suites; rows; scores; sweeps; tasks
    steps = [line for line in again.stdout.splitlines() if line.startswith("=== ")]
    assert not [line for line in steps if ": train " in line or ": resume " in line], steps
    assert json.loads((tmp_path / "agent_tasks.json").read_text())["pooled"] == tasks["pooled"]

    # two seeds in one report: seed 0's files again as seed 1 (grouped by their train_seed)
    twin = tmp_path / "seed_1"
    twin.mkdir()
    scored = []
    for name in MODELS:  # the headline row first
        f = seed0 / f"{name}.tasks.json"
        s = json.loads(f.read_text())
        scored.append(str(f))
        (twin / f.name).write_text(json.dumps({**s, "train_seed": 1}))
        scored.append(str(twin / f.name))
    subprocess.run([str(ROOT / ".venv/bin/python"), "evals/agent_tasks_report.py", "--scored", *scored,
                    "--out", str(tmp_path / "two_seeds")], cwd=ROOT, check=True, capture_output=True, timeout=120)
    two = json.loads((tmp_path / "two_seeds.json").read_text())
    assert {r["seed"] for r in two["rows"]} == {0, 1}
    one_seed = {(p["a"], p["b"], p["subset"]): p for p in tasks["pooled"]}
    for p in two["pooled"]:
        q = one_seed[(p["a"], p["b"], p["subset"])]
        assert p["seeds"] == [0, 1] and (p["diff"], p["lo"], p["hi"]) == pytest.approx((q["diff"], q["lo"], q["hi"]))
        assert p["wins"] == 2 * q["wins"]
    assert report["load"]["start"] is not None and report["load"]["end"] is not None
    assert "adaptation_baselines.sh" in report["command"] and report["seeds"]["max_steps"] == 4
    sets = report["sets"]["files"]
    assert sets["memory_worlds"]["num"] == 4 and sets["recovery_episodes"]["recovery_rounds"] >= 3
    assert sets["memory_worlds_train_pool"]["num"] == 4
