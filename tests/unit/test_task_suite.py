"""The closed-loop task suite: every kind's test passes its reference solution and fails doing nothing,
no blind policy passes any task and the replays are recorded, no expected answer is in a setup file or
the instruction, each kind's test checks every file it should, checks judge outcomes (not commands),
the suite is deterministic per seed with dev and test apart, and it is written in Harbor's task layout
and read back strictly.

Run: python -m pytest tests/unit/test_task_suite.py
"""

from __future__ import annotations

import json
import tomllib

import pytest

from ds_ttt.evaluation.agent_report import success_by_observation
from ds_ttt.evaluation.closed_loop import verify_task
from ds_ttt.tasks import checks as ck
from ds_ttt.tasks.blind_policies import check_suite, run_blind
from ds_ttt.tasks.kinds import KINDS
from ds_ttt.tasks.suite import TASK_SEEDS, build_task, load_suite, write_suite

NUM_PER_KIND = 2  # the least that replays one instance's solution on another; evals/task_suite.py writes 12


@pytest.fixture(scope="module")
def dev_suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks") / "dev"
    write_suite(out, split="dev", num_per_kind=NUM_PER_KIND, progress=False, guess_draws=3, check_blind=check_suite)
    return out


def _first(dev_suite, kind):
    return next(t for t in load_suite(dev_suite)[1] if t.kind == kind)


def test_every_kind_is_valid_oracle_passes_and_nop_fails(dev_suite):
    meta, tasks = load_suite(dev_suite)
    assert {t.kind for t in tasks} == set(KINDS) and len(tasks) == NUM_PER_KIND * len(KINDS)
    for t in (t for t in tasks if t.id.endswith("-000")):  # one per kind keeps it short
        got = verify_task(t)
        assert got["oracle"], (t.id, got["oracle_log"])
        assert not got["nop"], (t.id, got["nop_log"])


def test_the_suite_covers_every_generator_family_and_unseen_kinds():
    from ds_ttt.data.generator import FAMILY_NAMES

    assert {k.family for k in KINDS.values() if k.seen} == set(FAMILY_NAMES)
    unseen = [k for k in KINDS.values() if not k.seen]
    assert len(unseen) >= 2 and len({k.family for k in unseen}) >= 2


def test_no_blind_policy_passes_and_the_replays_are_recorded(dev_suite):
    meta, tasks = load_suite(dev_suite)
    assert meta["blind_checked"] and meta["blind_policies"]["copy_everything_into:*"]["runs"] > 0
    assert all(v["solved"] == 0 for v in meta["blind_policies"].values()), meta["blind_policies"]
    assert all(isinstance(t.needs_observation, bool) for t in tasks)
    kinds = meta["kinds"]
    assert all(isinstance(v["needs_observation"], bool) and 0 <= v["replay_rate"] <= 1 for v in kinds.values())
    # one fixed command line totals any notes/; the flag of background_flag is named only in its script
    assert not kinds["line_total"]["needs_observation"] and kinds["line_total"]["replay_rate"] == 1
    assert kinds["background_flag"]["needs_observation"] and kinds["memory_world"]["needs_observation"]


def test_no_expected_answer_is_in_the_instruction_or_a_setup_file(dev_suite):
    """An answer of 3 characters or more (a shorter one, a small count, is in any file by chance) is never
    in the instruction, nor in a setup file unless the kind is a lookup (`answer_in_world`)."""
    _, tasks = load_suite(dev_suite)
    for t in tasks:
        setup = [p.read_text() for p in t.environment.rglob("*") if p.is_file()]
        for answer in (a for a in t.answers if len(a) >= 3):
            assert answer not in t.instruction, (t.id, answer)
            if not KINDS[t.kind].answer_in_world:
                assert not any(answer in text for text in setup), (t.id, answer)
    permission = _first(dev_suite, "recovery_permission")
    assert permission.answers and permission.answers[0].endswith(" done")  # the line is computed by the script


def test_each_kind_checks_every_file_it_should(dev_suite):
    """Over-broad or half-done outcomes that the old tests passed fail now."""
    backup = _first(dev_suite, "memory_filename")
    assert not run_blind(backup, ("cp backups/* restore/",))[0]
    assert run_blind(backup, reply=None, script=(backup.path / "solution" / "solve.sh").read_text())[0]
    largest = _first(dev_suite, "explore_largest")
    assert not run_blind(largest, ("mv data/* archive/",))[0]
    biggest = max((p for p in (largest.environment / "data").iterdir()), key=lambda p: p.stat().st_size).name
    assert not run_blind(largest, (f"mv data/{biggest} archive/ && echo x > archive/{biggest}",))[0]
    assert run_blind(largest, (f"mv data/{biggest} archive/",))[0]
    capture = _first(dev_suite, "capture_script")
    name = next(p.name for p in capture.environment.iterdir())
    assert not run_blind(capture, (f"sh {name} > {name[:-3]}.txt",))[0]  # right output, never made runnable
    assert run_blind(capture, (f"chmod +x {name} && ./{name} > {name[:-3]}.txt",))[0]


def test_background_flag_varies_with_the_seed():
    """shell_background's instruction and solution were one for every seed; its replacement's are not."""
    specs = [build_task("background_flag", TASK_SEEDS["dev"] + i) for i in range(6)]
    assert len({s.instruction for s in specs}) > 1 and len({tuple(s.solution) for s in specs}) == len(specs)
    assert "shell_background" not in KINDS


def test_success_splits_by_needs_observation():
    row = {"per_kind": {"a": {"n": 4, "solved": 3}, "b": {"n": 4, "solved": 1}, "c": {"n": 2, "solved": 2}}}
    kinds = {"a": {"needs_observation": True}, "b": {"needs_observation": False}, "c": {"needs_observation": True}}
    split = success_by_observation(row, kinds)
    assert split["needs_observation"]["solved"] == 5 and split["needs_observation"]["n"] == 6
    assert split["fixed_script"]["rate"] == 0.25


def test_suite_is_deterministic_and_dev_test_apart(tmp_path, dev_suite):
    kinds = ["explore_csv", "memory_world", "capture_script"]
    a = write_suite(tmp_path / "a", split="dev", num_per_kind=2, kinds=kinds, progress=False, guess_draws=2)
    b = write_suite(tmp_path / "b", split="dev", num_per_kind=2, kinds=kinds, progress=False, guess_draws=2)
    t = write_suite(tmp_path / "t", split="test", num_per_kind=2, kinds=kinds, progress=False, guess_draws=2)
    assert a["sha256"] == b["sha256"]
    assert {x["seed"] for x in a["tasks"]}.isdisjoint({x["seed"] for x in t["tasks"]})
    assert TASK_SEEDS["dev"] + 10_000 < TASK_SEEDS["test"]
    texts = lambda root, s: {(root / x["id"] / "instruction.md").read_text() + (root / x["id"] / "tests" / "test.sh").read_text()  # noqa: E731
                             for x in s["tasks"]}
    assert texts(tmp_path / "a", a).isdisjoint(texts(tmp_path / "t", t))
    with pytest.raises(FileExistsError, match="not empty"):
        write_suite(tmp_path / "a", split="dev", num_per_kind=1, kinds=kinds, progress=False, guess_draws=2)


def test_harbor_layout_and_strict_reading(dev_suite, tmp_path):
    meta, tasks = load_suite(dev_suite)
    t = _first(dev_suite, "recovery_permission")
    d = t.path
    assert {p.name for p in d.iterdir()} == {"task.toml", "instruction.md", "environment", "tests", "solution"}
    cfg = tomllib.loads((d / "task.toml").read_text())
    assert cfg["environment"]["workdir"] == "/app"
    assert cfg["metadata"]["ds_ttt_kind"] == "recovery_permission" and cfg["metadata"]["ds_ttt_check"] == "answer"
    script = next(p for p in (d / "environment").iterdir() if p.suffix == ".sh")
    assert script.stat().st_mode & 0o777 == 0o644  # the world's modes are kept (this task is about one)
    assert t.instruction.startswith("Run ./") and ck.ANSWER_PATH in t.test

    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(FileNotFoundError, match="suite.json not found"):
        load_suite(bad)
    (bad / "suite.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="format 'other'"):
        load_suite(bad)
