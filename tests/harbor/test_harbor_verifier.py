"""Harbor's own verifier on the project's Harbor environment cannot be graded by the agent: the hostile
policies of tests/unit/test_verifier.py run in the trial's shell, then Harbor's shared-mode `Verifier`
grades the shipped count-lines task (tests/harbor/verifier_probe.py, in the Harbor venv). Each scores 0
(or the verifier refuses to run); a real solution still scores 1.

Run: python -m pytest tests/harbor/test_harbor_verifier.py (needs .venv-harbor: `bash setup_harbor.sh`)
"""

from __future__ import annotations

import json
import os
import subprocess

from tests.harbor.scripted_agent import REPO
from tests.unit.test_verifier import HOSTILE_POLICIES

SOLUTION = "wc -l < notes.txt > answer.txt"


def test_harbor_verifier_cannot_be_graded_by_the_agent(harbor_python, tmp_path):
    policies = dict(HOSTILE_POLICIES, solution=SOLUTION)
    (tmp_path / "policies.json").write_text(json.dumps(policies))
    proc = subprocess.run([str(harbor_python), str(REPO / "tests" / "harbor" / "verifier_probe.py"),
                           str(tmp_path / "policies.json"), str(tmp_path / "trials")],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rewards = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rewards.pop("solution") == 1.0, rewards
    assert all(r != 1.0 for r in rewards.values()), rewards
