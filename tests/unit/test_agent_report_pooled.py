"""The closed-loop report over several training seeds (ds_ttt/evaluation/agent_report.py) and dynamic
evaluation's tuned inner step (ds_ttt/evaluation/dynamic_eval.py, evals/dynamic_eval_sweep.py):
  * the kind-clustered bootstrap: near-copy tasks within a kind make the task-level interval narrow
    but not the kind-level one; a difference constant across kinds has a zero-width interval; pooled
    over one seed is that seed's interval; the same kinds are drawn for every seed;
  * build_report's `pooled` list (over every task and over the kinds that need the observation; a control
    trained on fewer seeds pooled over those), per-seed rows and pairs, each pair labelled with its own metric;
  * the sweep's pick rule, the `--inner` overrides and the sweep CLI.

Run: python -m pytest tests/unit/test_agent_report_pooled.py
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from ds_ttt.config import TTTConfig
from ds_ttt.evaluation.agent_report import (SCORED_FORMAT, build_report, kind_clustered_difference, markdown,
                                            paired_success_difference)
from ds_ttt.evaluation.closed_loop import EpisodeResult, summarize, task_outcomes
from ds_ttt.evaluation.dynamic_eval import DynamicEvalRecipe, parse_inner_overrides, pick_inner_setting

ROOT = pathlib.Path(__file__).resolve().parents[2]

NUM_KINDS, PER_KIND = 17, 12
KINDS = {f"k{k:02d}-{i}": f"k{k:02d}" for k in range(NUM_KINDS) for i in range(PER_KIND)}
FIXED_SCRIPT_KINDS = {"k15", "k16"}  # a blind replay solves them (suite.json: needs_observation false)
SUITE = {"split": "test", "seed_base": 0, "num_per_kind": PER_KIND, "num_tasks": len(KINDS), "sha256": "x",
         "kinds": {k: {"family": "f", "seen": True, "needs_observation": k not in FIXED_SCRIPT_KINDS}
                   for k in sorted(set(KINDS.values()))}}


def by_kind(solved_kinds: set[str]) -> dict[str, bool]:
    """Outcomes where every task of a kind in `solved_kinds` is solved and no other task."""
    return {t: k in solved_kinds for t, k in KINDS.items()}


def scored(label: str, solved: dict[str, bool], *, seed=None, mode="sft", attempts=1) -> dict:
    """A file as evals/agent_tasks.py writes it, for outcomes `solved` in one mode."""
    episodes = [EpisodeResult(task=t, kind=KINDS[t], family="f", seen=True, attempt=0, success=ok, stop="answer",
                              rounds=1, updates=0, tokens=1, seconds=0.0) for t, ok in solved.items()]
    row = summarize(episodes, model=label, mode=mode, attempts=attempts, seconds=1.0)
    return {"format": SCORED_FORMAT, "label": label, "suite": SUITE, "train_seed": seed,
            "modes": {mode: {"row": row, "outcomes": task_outcomes(episodes),
                             "episodes": [{"task": e.task, "kind": e.kind} for e in episodes]}}}


def width(d: dict) -> float:
    return d["hi"] - d["lo"]


def test_near_copy_tasks_make_the_task_interval_narrow_but_not_the_kind_interval():
    # 6 kinds only a solves, 3 only b solves, 8 neither: every kind's 12 tasks agree
    a = by_kind({f"k{k:02d}" for k in range(0, 6)})
    b = by_kind({f"k{k:02d}" for k in range(6, 9)})
    tasks = paired_success_difference(a, b)
    kinds = kind_clustered_difference([(a, b)], KINDS)
    assert kinds["diff"] == pytest.approx(tasks["diff"]) == pytest.approx(3 / 17)
    assert kinds["kinds"] == NUM_KINDS and kinds["tasks"] == NUM_KINDS * PER_KIND
    assert tasks["lo"] > 0  # the task-level interval calls it significant ...
    assert kinds["lo"] < 0 < kinds["hi"]  # ... 17 independent kinds do not
    assert width(kinds) > 2.5 * width(tasks)


def test_a_difference_constant_over_kinds_has_a_zero_width_interval():
    # in every kind a solves tasks 0-5 and b tasks 6-8: 3 of 12 more per kind, but not the same tasks
    a = {t: int(t.split("-")[1]) < 6 for t in KINDS}
    b = {t: 6 <= int(t.split("-")[1]) < 9 for t in KINDS}
    d = kind_clustered_difference([(a, b)], KINDS)
    assert d["diff"] == d["lo"] == d["hi"] == pytest.approx(0.25)
    assert width(paired_success_difference(a, b)) > 0.1  # resampling tasks sees noise that is not there


def test_pooled_over_one_seed_is_that_seed_and_every_seed_shares_the_drawn_kinds():
    a = by_kind({"k00", "k01", "k02", "k03"})
    b = by_kind({"k04"})
    one = kind_clustered_difference([(a, b)], KINDS)
    assert one["per_seed"] == [one["diff"]] and one["seeds"] == 1 and one["wins"] == 1
    # two identical seeds: the same kinds drawn for both, so the pooled interval equals one seed's
    two = kind_clustered_difference([(a, b), (a, b)], KINDS)
    assert (two["diff"], two["lo"], two["hi"]) == pytest.approx((one["diff"], one["lo"], one["hi"]))
    assert two["wins"] == 2
    # a seed where b is ahead: the mean of the two, one win
    mixed = kind_clustered_difference([(a, b), (b, a)], KINDS)
    assert mixed["diff"] == pytest.approx(0.0, abs=1e-12) and mixed["wins"] == 1
    assert mixed["lo"] == pytest.approx(0.0, abs=1e-12) == mixed["hi"]  # each replicate: d - d
    with pytest.raises(ValueError, match="cover exactly"):
        kind_clustered_difference([(a, {"x": True})], KINDS)


def test_build_report_pools_seeds_and_writes_the_pooled_list():
    main_wins = [by_kind({"k00", "k01", "k02"}), by_kind({"k00", "k01"}), by_kind({"k03"})]
    control = [by_kind({"k00"}), by_kind({"k00"}), by_kind({"k03", "k04"})]
    files = [f for s in range(3) for f in (scored("ttt_current", main_wins[s], seed=s, mode="ttt"),
                                           scored("sft_full", control[s], seed=s))]
    report = build_report(files, command="c", seeds={"train": [0, 1, 2]}, load={})
    assert [(r["seed"], r["model"]) for r in report["rows"]] == [
        (s, m) for s in range(3) for m in ("ttt_current", "sft_full")]
    assert [(p["seed"], p["a"], p["b"]) for p in report["paired"]] == [
        (s, "ttt_current/ttt", "sft_full/sft") for s in range(3)]
    for p in report["paired"]:
        assert p["kinds_lo"] <= p["diff"] <= p["kinds_hi"]
    pooled, observed = report["pooled"]
    assert (pooled["subset"], observed["subset"]) == ("all", "needs_observation")
    assert {"a", "b", "seeds", "diff", "lo", "hi", "wins"} <= set(pooled)
    assert pooled["a"] == "ttt_current/ttt" and pooled["b"] == "sft_full/sft" and pooled["seeds"] == [0, 1, 2]
    assert pooled["per_seed"] == pytest.approx([2 / 17, 1 / 17, -1 / 17])
    assert pooled["diff"] == pytest.approx(2 / 51) and pooled["wins"] == 2
    assert pooled["lo"] <= pooled["diff"] <= pooled["hi"]
    md = markdown(report)
    assert "Pooled over training seeds 0, 1, 2" in md and "| 2/3 |" in md
    assert "| 1 | ttt_current/ttt | sft_full/sft | pass@1 |" in md  # the per-seed pair of seed 1


def test_build_report_refuses_a_later_seed_without_the_headline_or_with_a_new_row_and_a_row_given_twice():
    a = scored("ttt_current", by_kind({"k00"}), seed=0, mode="ttt")
    with pytest.raises(ValueError, match="headline row ttt_current/ttt"):
        build_report([a, scored("sft_full", by_kind(set()), seed=0), scored("sft_full", by_kind(set()), seed=1)],
                     command="", seeds={}, load={})
    with pytest.raises(ValueError, match="no row that seed 0 lacks"):
        build_report([a, scored("ttt_current", by_kind(set()), seed=1, mode="ttt"),
                      scored("sft_full", by_kind(set()), seed=1)], command="", seeds={}, load={})
    with pytest.raises(ValueError, match="given twice"):
        build_report([a, a], command="", seeds={}, load={})


def test_a_control_trained_on_the_first_seed_only_is_pooled_over_that_seed_alone():
    # sft_full on three seeds, sft_full_compute on seed 0 only (a control measured once)
    files = [scored("ttt_current", by_kind({"k00", "k01"}), seed=s, mode="ttt") for s in range(3)]
    files += [scored("sft_full", by_kind({"k00"}), seed=s) for s in range(3)]
    files.append(scored("sft_full_compute", by_kind(set()), seed=0))
    report = build_report(files, command="", seeds={}, load={})
    pooled = {(p["b"], p["subset"]): p for p in report["pooled"] if p["a"] == "ttt_current/ttt"}
    assert pooled[("sft_full/sft", "all")]["seeds"] == [0, 1, 2]
    assert pooled[("sft_full_compute/sft", "all")]["seeds"] == [0]
    assert pooled[("sft_full_compute/sft", "all")]["per_seed"] == pytest.approx([2 / 17])
    assert [(p["seed"], p["b"]) for p in report["paired"] if p["b"] == "sft_full_compute/sft"] == [
        (0, "sft_full_compute/sft")]
    assert "| ttt_current/ttt | sft_full_compute/sft | pass@1 | all | 1 |" in markdown(report)


def test_pooled_also_rests_on_the_kinds_that_need_the_observation():
    # a wins only on the fixed-script kinds k15, k16: ahead over all tasks, level where it counts
    files = [f for s in range(3) for f in (scored("ttt_current", by_kind({"k00", "k15", "k16"}), seed=s, mode="ttt"),
                                           scored("sft_full", by_kind({"k00"}), seed=s))]
    report = build_report(files, command="", seeds={}, load={})
    pooled = {p["subset"]: p for p in report["pooled"]}
    assert set(pooled) == {"all", "needs_observation"}
    assert pooled["all"]["diff"] == pytest.approx(2 / 17) and pooled["all"]["wins"] == 3
    observed = pooled["needs_observation"]
    assert observed["kinds"] == NUM_KINDS - 2 and observed["tasks"] == (NUM_KINDS - 2) * PER_KIND
    assert observed["diff"] == observed["lo"] == observed["hi"] == 0.0 and observed["wins"] == 0
    assert "| ttt_current/ttt | sft_full/sft | pass@1 | needs_observation | 3 | 15 | +0.000" in markdown(report)


def test_each_pair_is_labelled_with_its_own_metric():
    # the headline row is pass@1; the extra pair compares two pass@3 rows
    files = [scored("ttt_current", by_kind({"k00"}), mode="ttt"),
             scored("ttt_sampled", by_kind({"k00", "k01"}), mode="ttt", attempts=3),
             scored("sft_sampled", by_kind({"k01"}), attempts=3)]
    report = build_report(files, command="", seeds={}, load={}, pairs=[("ttt_sampled/ttt", "sft_sampled/sft")])
    metric = {(p["a"], p["b"]): p["metric"] for p in report["paired"]}
    assert metric[("ttt_sampled/ttt", "sft_sampled/sft")] == "pass@3"
    assert metric[("ttt_current/ttt", "ttt_sampled/ttt")] == "pass@1 vs pass@3"
    assert {p["metric"] for p in report["pooled"]} == {"pass@1 vs pass@3", "pass@3"}


def test_the_sweep_picks_the_best_dev_success_and_breaks_ties_toward_the_gentler_step():
    grid = [{"inner_lr": lr, "inner_max_norm": n, "success": s}
            for lr, n, s in ((0.03, 1.0, 0.2), (0.3, 5.0, 0.4), (0.1, 5.0, 0.4), (0.1, 1.0, 0.4), (1.0, 5.0, 0.3))]
    assert pick_inner_setting(grid) == {"inner_lr": 0.1, "inner_max_norm": 1.0, "success": 0.4}
    no_clip = [{"inner_lr": 0.1, "inner_max_norm": 0.0, "success": 0.5}, {"inner_lr": 0.1, "inner_max_norm": 5.0,
                                                                          "success": 0.5}]
    assert pick_inner_setting(no_clip)["inner_max_norm"] == 5.0  # no clipping is the largest step
    with pytest.raises(ValueError):
        pick_inner_setting([])


def test_inner_overrides_replace_only_the_inner_step():
    overrides = parse_inner_overrides(["inner_lr=0.3", "inner_max_norm=5"])
    assert overrides == {"inner_lr": 0.3, "inner_max_norm": 5}
    recipe = TTTConfig(adaptive_layers=2, inner_lr=1.0, inner_max_norm=1.0, fast_matrices="down")
    tuned = DynamicEvalRecipe("runs/ttt_full", overrides).inner(recipe)
    assert (tuned.inner_lr, tuned.inner_max_norm, tuned.fast_matrices) == (0.3, 5, "down")
    assert recipe.inner_lr == 1.0  # the recipe itself is untouched
    with pytest.raises(ValueError, match="inner_lr"):
        parse_inner_overrides(["adaptive_layers=3"])
    with pytest.raises(ValueError, match="key=value"):
        parse_inner_overrides(["inner_lr"])
    with pytest.raises(ValueError, match="only the inner step"):
        DynamicEvalRecipe("runs/ttt_full", {"context_policy": "full"})
    with pytest.raises(ValueError, match="inner_lr"):
        DynamicEvalRecipe("runs/ttt_full", {"inner_lr": -1.0}).inner(recipe)


def test_the_sweep_cli_writes_the_grid_and_prints_the_choice(tmp_path):
    files = []
    for lr, norm, solved in ((0.1, 1.0, {"k00"}), (1.0, 5.0, {"k00", "k01"}), (0.3, 5.0, {"k00", "k01"})):
        s = scored("dyn_sft_full", by_kind(solved), mode="ttt")
        s["provenance"] = {"dynamic_eval_from": "runs/ttt_full",
                           "dynamic_eval_inner": {"inner_lr": lr, "inner_max_norm": norm}}
        files.append(tmp_path / f"lr{lr}_norm{norm}.json")
        files[-1].write_text(json.dumps(s))
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, "evals/dynamic_eval_sweep.py", "--scored", *map(str, files),
                           "--label", "dyn_sft_full", "--out", str(out), "--train-seed", "1"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "inner_lr=0.3 inner_max_norm=5.0"
    sweep = json.loads(out.read_text())
    assert sweep["chosen"] == {"inner_lr": 0.3, "inner_max_norm": 5.0} and sweep["seed"] == 1
    assert [g["solved"] for g in sweep["grid"]] == [PER_KIND, 2 * PER_KIND, 2 * PER_KIND]
    report = build_report([scored("sft_full", by_kind(set()))], command="", seeds={}, load={}, sweeps=[sweep])
    assert "| dyn_sft_full | 1 | 204 | 12/204 | 24/204 | 24/204 | lr 0.3, norm 5 |" in markdown(report)


def test_agent_tasks_cli_refuses_inner_overrides_it_cannot_apply(capsys):
    sys.path.insert(0, str(ROOT / "evals"))
    try:
        import agent_tasks
    finally:
        sys.path.pop(0)
    base = ["--model", "m", "--tasks", "t", "--label", "x", "--out", "o.json"]
    with pytest.raises(SystemExit):
        agent_tasks.main(base + ["--inner", "inner_lr=0.3"])
    assert "needs --dynamic-eval-from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        agent_tasks.main(base + ["--dynamic-eval-from", "runs/ttt_full", "--inner", "window=3"])
    assert "--inner expects key=value with key one of" in capsys.readouterr().err


def test_each_row_splits_success_into_kinds_that_need_the_observation_and_fixed_script_kinds():
    report = build_report([scored("ttt_current", by_kind({"k00", "k15", "k16"}), mode="ttt")],
                          command="c", seeds={}, load={})
    (row,) = report["rows"]
    needs, fixed = row["by_observation"]["needs_observation"], row["by_observation"]["fixed_script"]
    assert (needs["n"], needs["solved"], fixed["n"], fixed["solved"]) == (15 * PER_KIND, PER_KIND, 2 * PER_KIND, 2 * PER_KIND)
    md = markdown(report)
    assert "| needs observation | fixed script |" in md
    assert f"| 12/180 = {100 * 12 / 180:.1f}% [" in md and "| 24/24 = 100.0% [" in md


def test_the_episodes_cli_commits_what_the_agent_ran_per_seed_and_mode(tmp_path):
    import dataclasses

    episodes = [EpisodeResult(task=t, kind=KINDS[t], family="f", seen=True, attempt=0, success=t.endswith("-0"),
                              stop="answer", rounds=2, updates=1, tokens=9, seconds=0.1, test_log=f"log {t}",
                              actions=['{"command": "ls"}', f'{{"command": "cat {t}"}}'])
                for t in sorted(KINDS, reverse=True)]
    row = summarize(episodes, model="ttt_current", mode="ttt", attempts=1, seconds=1.0)
    s = {"format": SCORED_FORMAT, "label": "ttt_current", "suite": SUITE, "train_seed": 2,
         "modes": {"ttt": {"row": row, "outcomes": task_outcomes(episodes),
                           "episodes": [dataclasses.asdict(e) for e in episodes]}}}
    (tmp_path / "scored.json").write_text(json.dumps(s))
    proc = subprocess.run([sys.executable, "evals/agent_episodes.py", "--scored", str(tmp_path / "scored.json"),
                           "--out", str(tmp_path / "episodes")], cwd=ROOT, capture_output=True, text=True, check=True)
    dest = tmp_path / "episodes" / "seed2" / "ttt_current.ttt.jsonl"
    assert f"{dest}: {len(KINDS)} episodes, {NUM_KINDS} solved" in proc.stdout
    lines = [json.loads(line) for line in dest.read_text().splitlines()]
    assert [e["task"] for e in lines] == sorted(KINDS)  # sorted by task, whatever the scoring order
    assert lines[0] == {"task": "k00-0", "kind": "k00", "attempt": 0, "success": True, "stop": "answer", "rounds": 2,
                        "updates": 1, "actions": ['{"command": "ls"}', '{"command": "cat k00-0"}'],
                        "test_log": "log k00-0"}
    # a file scored without the commands is refused, naming it, and nothing is written for it
    (tmp_path / "old.json").write_text(json.dumps(scored("sft_full", by_kind(set()), seed=2)))
    bad = subprocess.run([sys.executable, "evals/agent_episodes.py", "--scored", str(tmp_path / "old.json"),
                          "--out", str(tmp_path / "episodes")], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "old.json: sft_full/sft: episodes without" in bad.stderr
    assert not (tmp_path / "episodes" / "seed2" / "sft_full.sft.jsonl").exists()
