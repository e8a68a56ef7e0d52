"""The closed-loop task suite: every kind's test passes its reference solution and fails doing nothing,
checks judge outcomes (not commands), the suite is deterministic per seed with dev and test apart, and
it is written in Harbor's task layout and read back strictly.

Run: python -m pytest tests/unit/test_task_suite.py
"""

from __future__ import annotations

import json
import tomllib

import pytest

from ds_ttt.sandbox import Sandbox
from ds_ttt.evaluation.closed_loop import score_outcome, verify_task
from ds_ttt.tasks import checks as ck
from ds_ttt.tasks.kinds import KINDS
from ds_ttt.tasks.suite import TASK_SEEDS, load_suite, write_suite


@pytest.fixture(scope="module")
def dev_suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks") / "dev"
    write_suite(out, split="dev", num_per_kind=1, progress=False)
    return out


def test_every_kind_is_valid_oracle_passes_and_nop_fails(dev_suite):
    meta, tasks = load_suite(dev_suite)
    assert {t.kind for t in tasks} == set(KINDS) and len(tasks) == len(KINDS)
    for t in tasks:
        got = verify_task(t)
        assert got["oracle"], (t.id, got["oracle_log"])
        assert not got["nop"], (t.id, got["nop_log"])


def test_the_suite_covers_every_generator_family_and_unseen_kinds():
    from ds_ttt.data.generator import FAMILY_NAMES

    assert {k.family for k in KINDS.values() if k.seen} == set(FAMILY_NAMES)
    unseen = [k for k in KINDS.values() if not k.seen]
    assert len(unseen) >= 2 and len({k.family for k in unseen}) >= 2


def test_checks_judge_outcomes_not_commands():
    """Two different correct solutions pass; a near miss (a number inside a bigger one, a wrong file) fails."""
    checks = [ck.file_equals("answer.txt", "12"), ck.answer_contains("12")]
    script = ck.test_script(checks)

    def reward(commands: list[str], answer: str) -> bool:
        with Sandbox(timeout=10.0, dirs=("/logs", "/tests")) as sb:
            for c in commands:
                sb.run(c)
            ok, _ = score_outcome(sb, _FakeTask(script), answer)
            return ok

    assert reward(["echo 12 > answer.txt"], "The total is 12.")
    assert reward(["printf '  12\\n\\n' > answer.txt"], "12")  # whitespace around the value is not the outcome
    assert not reward(["echo 123 > answer.txt"], "12")
    assert not reward(["echo 12 > answer.txt"], "The total is 123.")  # a whole word, not a substring
    assert not reward([], "12")


class _FakeTask:
    def __init__(self, test: str):
        self.test = test


def test_suite_is_deterministic_and_dev_test_apart(tmp_path, dev_suite):
    kinds = ["explore_csv", "memory_world", "capture_script"]
    a = write_suite(tmp_path / "a", split="dev", num_per_kind=2, kinds=kinds, progress=False)
    b = write_suite(tmp_path / "b", split="dev", num_per_kind=2, kinds=kinds, progress=False)
    t = write_suite(tmp_path / "t", split="test", num_per_kind=2, kinds=kinds, progress=False)
    assert a["sha256"] == b["sha256"]
    assert {x["seed"] for x in a["tasks"]}.isdisjoint({x["seed"] for x in t["tasks"]})
    assert TASK_SEEDS["dev"] + 10_000 < TASK_SEEDS["test"]
    texts = lambda root, s: {(root / x["id"] / "instruction.md").read_text() + (root / x["id"] / "tests" / "test.sh").read_text()  # noqa: E731
                             for x in s["tasks"]}
    assert texts(tmp_path / "a", a).isdisjoint(texts(tmp_path / "t", t))
    with pytest.raises(FileExistsError, match="not empty"):
        write_suite(tmp_path / "a", split="dev", num_per_kind=1, kinds=kinds, progress=False)


def test_harbor_layout_and_strict_reading(dev_suite, tmp_path):
    meta, tasks = load_suite(dev_suite)
    t = next(x for x in tasks if x.kind == "recovery_permission")
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
