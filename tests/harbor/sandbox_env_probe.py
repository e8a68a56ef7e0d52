"""Probe of ds_ttt.serve.frontends.harbor_env.SandboxEnvironment's contract, run in the Harbor venv (Harbor is not
importable from the project's venv); prints one JSON object of observations that
tests/harbor/test_harbor_agent.py checks.

    .venv-harbor/bin/python tests/harbor/sandbox_env_probe.py TASK_ENVIRONMENT_DIR SCRATCH_DIR
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from ds_ttt.sandbox.kill import process_tree
from ds_ttt.serve.frontends.harbor_env import SandboxEnvironment


def make_env(environment_dir: Path, scratch: Path, name: str, mode: NetworkMode) -> SandboxEnvironment:
    paths = TrialPaths(scratch / name)
    paths.mkdir()
    return SandboxEnvironment(environment_dir=environment_dir, environment_name="probe", session_id=f"probe-{name}",
                              trial_paths=paths, task_env_config=EnvironmentConfig(workdir="/app"),
                              network_policy=NetworkPolicy(network_mode=mode))


def alive(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists()]


async def probe(environment_dir: Path, scratch: Path) -> dict:
    out: dict = {}
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    connect = f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo reachable || echo unreachable"

    env = make_env(environment_dir, scratch, "public", NetworkMode.PUBLIC)
    await env.start(force_build=False)
    base = env.sandbox.base
    out["pwd"] = (await env.exec("pwd")).stdout
    out["notes"] = (await env.exec("cat notes.txt")).stdout
    out["home_uid"] = (await env.exec("echo $HOME $(id -u)")).stdout
    usr = await env.exec("touch /usr/ds_ttt_probe")
    out["usr_write"] = [usr.return_code, usr.stderr]
    out["absolute_write"] = (await env.exec("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
                                            "cat /logs/verifier/reward.txt")).stdout
    await env.download_file("/logs/verifier/reward.txt", scratch / "reward.txt")
    out["lands_in_root"] = (scratch / "reward.txt").read_text()
    out["exit_code"] = (await env.exec("exit 7")).return_code
    out["stderr"] = (await env.exec("echo oops >&2")).stderr
    out["env"] = (await env.exec("echo $FOO", env={"FOO": "bar"})).stdout
    pid = (await env.exec("sleep 300 > /dev/null 2>&1 & echo $!")).stdout.strip()
    out["background_alive"] = (await env.exec(f"kill -0 {pid} && echo alive")).stdout
    t0 = time.monotonic()
    try:
        await env.exec("sleep 30", timeout_sec=1)
        out["timeout"] = "no error"
    except RuntimeError as e:
        out["timeout"] = str(e)
    out["timeout_sec"] = time.monotonic() - t0
    out["public_network"] = (await env.exec(connect)).stdout
    await env.shell("cd /tmp && export KEPT=yes")
    out["shell"] = (await env.shell("echo $PWD $KEPT")).output
    out["shell_timeout"] = (await env.shell("sleep 30; echo never", timeout_sec=1)).timed_out
    out["shell_after"] = (await env.shell("echo $PWD $KEPT")).output
    # the TTT agent's commands go through that persistent shell: a `cd` or export carries to its next command
    from ds_ttt.serve.frontends.harbor_agent import EnvironmentTools, TTTAgent

    agent = TTTAgent(logs_dir=scratch / "agent-logs", server_url="http://127.0.0.1:9/v1")
    tools = EnvironmentTools(env, agent.settings)
    await tools.run_command("cd /var/tmp && export AGENT_KEPT=1")
    out["agent_shell"] = await tools.run_command("echo $PWD $AGENT_KEPT")

    src = scratch / "upload"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.txt").write_text("A")
    (src / "run.sh").write_text("#!/bin/bash\necho ran\n")
    (src / "run.sh").chmod(0o755)
    await env.upload_dir(src, "/tests")
    out["uploaded_dir"] = (await env.exec("cat /tests/sub/a.txt; /tests/run.sh")).stdout
    await env.upload_file(src / "sub" / "a.txt", "/tmp/deep/new/b.txt")
    out["uploaded_file"] = (await env.exec("cat /tmp/deep/new/b.txt")).stdout
    try:  # only the sandbox's writable mounts take files; / itself is read-only
        await env.upload_file(src / "sub" / "a.txt", "/deep/b.txt")
        out["upload_outside"] = "accepted"
    except RuntimeError as e:
        out["upload_outside"] = str(e)
    await env.exec("mkdir -p /logs/agent/d && echo X > /logs/agent/d/x.txt && ln -s /etc/passwd /logs/agent/leak")
    down = scratch / "download"
    await env.download_dir("/logs/agent", down)
    out["downloaded"] = sorted(str(p.relative_to(down)) for p in down.rglob("*"))
    await env.download_file("/tmp/deep/new/b.txt", scratch / "b.txt")
    out["downloaded_file"] = (scratch / "b.txt").read_text()
    pids = [env.sandbox.pid] + [p for p, _ in process_tree(env.sandbox.pid)]
    out["processes_before_stop"] = len(alive(pids))
    await env.stop(delete=True)
    time.sleep(0.2)
    out["processes_after_stop"] = len(alive(pids))
    out["root_removed"] = not base.exists()

    isolated = make_env(environment_dir, scratch, "isolated", NetworkMode.NO_NETWORK)
    out["disable_internet"] = isolated.capabilities.disable_internet
    await isolated.start(force_build=False)
    out["no_network"] = (await isolated.exec(connect)).stdout
    await isolated.stop(delete=True)
    listener.close()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(probe(Path(sys.argv[1]), Path(sys.argv[2])))))
