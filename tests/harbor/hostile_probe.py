"""Runs the hostile-command suite's commands through a Harbor environment, in the Harbor venv; prints
{attack: {"exec": output, "shell": output}} as JSON for tests/harbor/test_harbor_hostile.py to judge.

    .venv-harbor/bin/python tests/harbor/hostile_probe.py COMMANDS_JSON SCRATCH_DIR [ENV_MODULE_FILE]
    DS_TTT_PROBE_ENV_KWARGS='{"cgroup_caps": "none"}' ...   # extra environment kwargs, as Harbor's --ek passes them

COMMANDS_JSON maps attack names to shell commands (tests/unit/hostile.py fills them in). Each attack
gets a fresh environment (one trial) and runs once through `exec` (what Harbor and its agents call)
and once through the persistent `shell`. ENV_MODULE_FILE loads `SandboxEnvironment` from another
file (the test passes the environment of before the bubblewrap sandbox, to show the suite catches its escape); the
old environment has no `shell`, so only `exec` runs there.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path

from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths


def load_env_class(path: str | None):
    if path is None:
        from ds_ttt.serve.frontends.harbor_env import SandboxEnvironment

        return SandboxEnvironment
    spec = importlib.util.spec_from_file_location("old_harbor_env", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SandboxEnvironment


async def run_all(commands: dict[str, str], scratch: Path, env_cls, env_kwargs: dict) -> dict:
    out = {}
    empty = scratch / "environment"
    empty.mkdir(exist_ok=True)
    for i, (name, command) in enumerate(sorted(commands.items())):
        paths = TrialPaths(scratch / f"trial{i}")
        paths.mkdir()
        env = env_cls(environment_dir=empty, environment_name="hostile", session_id=f"hostile-{i}", trial_paths=paths,
                      task_env_config=EnvironmentConfig(workdir="/app"),
                      network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK), **env_kwargs)
        await env.start(force_build=False)
        try:
            res = {}
            try:
                r = await env.exec(f"exec 2>&1\n{command}", timeout_sec=15)
                res["exec"] = (r.stdout or "") + (r.stderr or "")
            except RuntimeError as e:
                res["exec"] = f"[error: {e}]"
            if hasattr(env, "shell"):
                res["shell"] = (await env.shell(command, timeout_sec=15)).output
                res["alive"] = (await env.shell("echo alive")).output
            out[name] = res
        finally:
            await env.stop(delete=True)
    return out


if __name__ == "__main__":
    cmds = json.loads(Path(sys.argv[1]).read_text())
    cls = load_env_class(sys.argv[3] if len(sys.argv) > 3 else None)
    kwargs = json.loads(os.environ.get("DS_TTT_PROBE_ENV_KWARGS", "{}"))
    print(json.dumps(asyncio.run(run_all(cmds, Path(sys.argv[2]), cls, kwargs))))
