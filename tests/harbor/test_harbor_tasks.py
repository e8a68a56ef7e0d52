"""The closed-loop task suite through Harbor's own runner (`harbor run -p SUITE`), unchanged, in the
project's sandbox environment, on a few tasks (a file outcome, an answer outcome, a kind training never shows):

  * Harbor's oracle agent (each task's solution/solve.sh) earns reward 1 on every task, the nop agent 0;
  * TTTAgent against the project's HTTP server runs every task to a verifier reward with no exception,
    and the reply that ended an episode is where the answer tests read it (/logs/agent/answer.txt).

Run: python -m pytest tests/harbor/test_harbor_tasks.py   (needs .venv-harbor: bash setup_harbor.sh)
"""

from __future__ import annotations

import json
import subprocess

import pytest

from ds_ttt.tasks.suite import load_suite, write_suite
from tests.harbor.scripted_agent import HARBOR_VENV, REPO, harbor_env

AGENT = "ds_ttt.serve.frontends.harbor_agent:TTTAgent"
ENVIRONMENT = "ds_ttt.serve.frontends.harbor_env:SandboxEnvironment"
KINDS = ["explore_csv", "recovery_permission", "capture_script"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite") / "tasks"
    write_suite(out, split="dev", num_per_kind=1, kinds=KINDS, progress=False)
    return out


def harbor_job(jobs_dir, name: str, suite, *args: str) -> dict[str, dict]:
    """`harbor run -p SUITE` (every task, 3 at once); returns {task dir name: the trial's result.json}."""
    argv = [str(HARBOR_VENV / "bin" / "harbor"), "run", "-p", str(suite), "--env", ENVIRONMENT, "-o", str(jobs_dir),
            "--job-name", name, "-n", "3", "-q", "-y", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=harbor_env(), cwd=REPO)
    results = {}
    for trial in (jobs_dir / name).iterdir() if (jobs_dir / name).is_dir() else ():
        if (trial / "result.json").is_file():
            r = json.loads((trial / "result.json").read_text())
            results[r["task_name"]] = r | {"_dir": str(trial)}
    assert len(results) == len(KINDS), f"harbor run (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return results


def test_oracle_passes_and_nop_fails_every_task(harbor_python, suite, tmp_path):
    for name, r in harbor_job(tmp_path, "oracle", suite, "--agent", "oracle").items():
        assert r["exception_info"] is None and r["verifier_result"]["rewards"] == {"reward": 1.0}, (name, r)
    for name, r in harbor_job(tmp_path, "nop", suite, "--agent", "nop").items():
        assert r["exception_info"] is None and r["verifier_result"]["rewards"] == {"reward": 0.0}, (name, r)


def test_ttt_agent_runs_the_suite_unchanged(harbor_python, ttt_server, suite, tmp_path):
    _, tasks = load_suite(suite)
    results = harbor_job(tmp_path, "ttt", suite, "--agent", AGENT, "--ak", f"server_url={ttt_server}",
                         "--ak", "max_rounds=3", "--ak", "max_tokens=96")
    assert set(results) == {t.id for t in tasks}
    for name, r in results.items():
        assert r["exception_info"] is None, (name, r["exception_info"])
        assert r["verifier_result"]["rewards"]["reward"] in (0.0, 1.0)
        meta = r["agent_result"]["metadata"]
        if meta["stop"] == "answer":  # the final reply went where the answer tests read it
            from pathlib import Path

            steps = json.loads((Path(r["_dir"]) / "agent" / "trajectory.json").read_text())["steps"]
            assert (Path(r["_dir"]) / "agent" / "answer.txt").read_text() == steps[-1]["message"]
