"""The blind-policy gate runs every policy and every replay from a fresh copy of the task's world: nothing a
run writes (files in /app, /tmp, /var/tmp, /logs, a setup file changed in place, a background process)
is there for the next run, and the task's own environment/ on the host is never changed.

The probe: tasks of one kind whose reference solution first looks for every trace an earlier run could
have left (and writes /app/dirty if it finds one), then leaves those traces; whose test passes when
/app/dirty is there, or when a trace is there in a run that is not a replay (blind policies write none).
With fresh environments every run fails and the gate accepts the suite with no replay solving; a gate
that reuses a sandbox, a working copy or hard links to the setup files, or that restores only some of
the writable directories, makes some run pass. The second test checks that the probe catches such a
gate (a runner carrying /app over from one run to the next).

Run: .venv/bin/python -m pytest -q tests/unit/test_blind_fresh_env.py
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from ds_ttt.evaluation.closed_loop import score_outcome
from ds_ttt.sandbox import Sandbox
from ds_ttt.tasks import blind_policies
from ds_ttt.tasks.blind_policies import BlindPolicyPasses, check_suite
from ds_ttt.tasks.suite import Task

TRACES = ("/app/trace", "/tmp/trace", "/var/tmp/trace", "/logs/trace")
SLEEPER = "sleep 31415"  # a background process a run leaves; no later run of a fresh sandbox can see it

SOLVE = f"""#!/bin/bash
dirty=
for f in {' '.join(TRACES)} /app/dirty; do [ -e "$f" ] && dirty="$dirty $f"; done
grep -q appended /app/seed.txt && dirty="$dirty seed.txt"
for p in /proc/[0-9]*; do tr '\\0' ' ' < "$p/cmdline" 2>/dev/null | grep -qx '{SLEEPER} ' && dirty="$dirty process"; done
[ -n "$dirty" ] && echo "$dirty" > /app/dirty
for f in {' '.join(TRACES)}; do echo run >> "$f"; done
echo appended >> /app/seed.txt
nohup {SLEEPER} > /dev/null 2>&1 &
mkdir -p /logs/agent && echo replay > /logs/agent/answer.txt
"""

TEST = f"""#!/bin/bash
a="$(cat /logs/agent/answer.txt 2>/dev/null)"
trace=0
for f in {' '.join(TRACES)}; do [ -e "$f" ] && trace=1; done
grep -q appended /app/seed.txt && trace=1
mkdir -p /logs/verifier
if [ -e /app/dirty ]; then echo "dirty: $(cat /app/dirty)"; echo 1 > /logs/verifier/reward.txt
elif [ "$a" != replay ] && [ $trace = 1 ]; then echo "a trace of an earlier run"; echo 1 > /logs/verifier/reward.txt
else echo clean; echo 0 > /logs/verifier/reward.txt; fi
"""


def _probe_tasks(root: Path, n: int = 3) -> list[Task]:
    tasks = []
    for i in range(n):
        path = root / f"probe-{i}"
        (path / "environment" / "sub").mkdir(parents=True)
        (path / "environment" / "seed.txt").write_text(f"seed {i}\n")
        (path / "environment" / "sub" / "data.txt").write_text(f"data {i}\n")
        (path / "tests").mkdir()
        (path / "tests" / "test.sh").write_text(TEST)
        (path / "solution").mkdir()
        (path / "solution" / "solve.sh").write_text(SOLVE)
        (path / "instruction.md").write_text("Leave a trace.\n")
        tasks.append(Task(id=f"probe-{i}", kind="probe", family="probe", seen=False, check="state", seed=i, path=path))
    return tasks


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(path)}\0{st.st_mode}\0{st.st_nlink}\0".encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def test_the_probe_itself_fails_clean_and_passes_dirty(tmp_path):
    """A run from the pristine world fails the probe's test; a run after the solution passes it."""
    task = _probe_tasks(tmp_path, 1)[0]
    assert not blind_policies.run_blind(task, ("ls -a >/dev/null",))[0]
    assert not blind_policies.run_blind(task, reply=None, script=SOLVE)[0]
    with Sandbox(timeout=10.0, dirs=("/logs", "/tests")) as sb:
        sb.add_tree(task.environment)
        sb.put(SOLVE.encode(), "/tmp/solve.sh", 0o755)
        sb.run("bash /tmp/solve.sh")
        sb.run("bash /tmp/solve.sh")  # the second run finds the first one's traces
        assert score_outcome(sb, task, None)[0]
    with Sandbox(timeout=10.0, dirs=("/logs", "/tests")) as sb:
        sb.add_tree(task.environment)
        sb.run("echo left > /tmp/trace")  # a trace in a blind policy's run (its reply is not "replay")
        assert score_outcome(sb, task, "")[0]


def test_every_blind_run_starts_from_a_fresh_world(tmp_path):
    tasks = _probe_tasks(tmp_path)
    before = {t.id: _tree_digest(t.environment) for t in tasks}
    found = check_suite(tasks, {"probe": None}, workers=2)
    assert {t: row["replays_solving"] for t, row in found["tasks"].items()} == {t.id: [] for t in tasks}
    assert all(row["blind_policies"] >= 10 for row in found["tasks"].values())
    assert found["kinds"]["probe"]["needs_observation"] is True
    assert {t.id: _tree_digest(t.environment) for t in tasks} == before, "a run changed the task's environment/"


def test_the_probe_catches_a_gate_that_carries_files_over(tmp_path, monkeypatch):
    """An obviously wrong gate: each task's /app is kept from one run to the next (one working copy per
    task). The probe must make it fail (a replay or a blind policy then passes)."""
    carried: dict[str, bytes] = {}

    def carrying_run_blind(task, commands=(), reply="", *, script=None, timeout=blind_policies.COMMAND_TIMEOUT):
        with Sandbox(timeout=timeout, dirs=("/logs", "/tests")) as sb:
            if task.id in carried:
                sb.put_tree(carried[task.id], sb.workdir)
            else:
                sb.add_tree(task.environment)
            if script is not None:
                sb.put(script.encode(), blind_policies.SOLVE_PATH, 0o755)
                commands = (f"bash {blind_policies.SOLVE_PATH}",)
            for c in commands:
                sb.run(c, timeout=timeout)
            carried[task.id] = sb.get_tree(sb.workdir)
            tarfile.open(fileobj=io.BytesIO(carried[task.id])).getmembers()  # a tar archive came back
            return score_outcome(sb, task, reply)

    monkeypatch.setattr(blind_policies, "run_blind", carrying_run_blind)
    tasks = _probe_tasks(tmp_path)  # each task gets two replays: the second finds the first one's traces
    try:
        found = check_suite(tasks, {"probe": None}, workers=1)
    except BlindPolicyPasses:
        return
    assert any(row["replays_solving"] for row in found["tasks"].values())
