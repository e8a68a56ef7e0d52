"""Probe of the Harbor verifier on ds_ttt.serve.frontends.harbor_env.SandboxEnvironment, run in the Harbor venv: each
policy's commands run in the trial's persistent shell (as ds_ttt's Harbor agent runs tool calls), then
Harbor's own shared-mode `Verifier` grades the shipped count-lines task; prints {policy: reward or error}
as one JSON object, which tests/harbor/test_harbor_verifier.py checks.

    .venv-harbor/bin/python tests/harbor/verifier_probe.py POLICIES.json SCRATCH_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths
from harbor.verifier.verifier import Verifier

from ds_ttt.serve.frontends.harbor_env import SandboxEnvironment

TASK_DIR = Path(__file__).resolve().parents[1] / "assets" / "harbor" / "count-lines"


async def grade(name: str, command: str, scratch: Path) -> float | str:
    paths = TrialPaths(scratch / name)
    paths.mkdir()
    env = SandboxEnvironment(environment_dir=TASK_DIR / "environment", environment_name="verifier-probe",
                             session_id=f"verifier-probe-{name}", trial_paths=paths,
                             task_env_config=EnvironmentConfig(workdir="/app"),
                             network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
    await env.start(force_build=False)
    try:
        await env.shell(command, timeout_sec=10)
        result = await Verifier(task=Task(TASK_DIR), trial_paths=paths, environment=env).verify()
        return float(result.rewards["reward"])
    except Exception as e:  # a verifier that cannot run is no success: reported, checked as not 1
        return f"{type(e).__name__}: {e}"
    finally:
        await env.stop(delete=True)


async def main(policies: dict[str, str], scratch: Path) -> dict:
    return {name: await grade(name, command, scratch) for name, command in policies.items()}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))))
