"""The hostile-command suite (tests/unit/hostile.py) through Harbor's `SandboxEnvironment`.

    .venv/bin/python -m pytest tests/harbor/test_harbor_hostile.py -q

The host-side targets (sentinel tree, Unix-socket and loopback servers, the secret in this process's
environment) live in this process; tests/harbor/hostile_probe.py runs every attack in the Harbor venv
through the environment's `exec` and its persistent `shell`, each attack in a fresh trial. Every
attack must fail in both. The same suite run against the environment of before the bubblewrap sandbox (a chroot
in a user namespace where the task is root, read from git) finds its escapes: the chroot escape reads
the host's secret — so these checks can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harbor.scripted_agent import REPO

sys.path.insert(0, str(REPO / "tests" / "unit"))
from hostile import ATTACKS, HostTargets, command, extra_check  # noqa: E402

OLD_ENV_COMMIT = "2e37d67"  # the last commit before the bubblewrap sandbox


def probe(harbor_python, tmp_path, targets, names, env_file=None) -> dict:
    cmds = {n: command(n, targets.fields(os.getpid())) for n in names}
    (tmp_path / "cmds.json").write_text(json.dumps(cmds))
    argv = [str(harbor_python), str(REPO / "tests" / "harbor" / "hostile_probe.py"), str(tmp_path / "cmds.json"),
            str(tmp_path / "scratch")] + ([str(env_file)] if env_file else [])
    (tmp_path / "scratch").mkdir()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_every_attack_fails_through_harbor(harbor_python, tmp_path):
    with HostTargets() as targets:
        got = probe(harbor_python, tmp_path, targets, sorted(ATTACKS))
        problems = {}
        for name, res in got.items():
            for way in ("exec", "shell"):
                out = res[way]
                bad = targets.failures(out) + ([] if extra_check(name, out) else ["its own check failed"])
                if bad:
                    problems[f"{name}/{way}"] = (bad, out[-1500:])
            if not res["alive"].startswith("alive"):
                problems[f"{name}/alive"] = res["alive"][-500:]
    assert problems == {}, json.dumps(problems, indent=1)[-6000:]


@pytest.mark.parametrize("cgroup_caps", ["required", "none"])
def test_every_trial_runs_in_a_cgroup_of_its_own_unless_declined(harbor_python, tmp_path, cgroup_caps):
    """The resource attacks of tests/unit/hostile.py run against the same `Sandbox` in
    test_sandbox_hostile.py; here: a Harbor trial's commands (exec and the persistent shell) are members
    of the trial's own cgroup, whose caps that suite checks; `--ek cgroup_caps=none` declines it."""
    from ds_ttt.sandbox import cgroup_problem

    if cgroup_caps == "required" and cgroup_problem() is not None:
        pytest.skip(f"no cgroup can be made here: {cgroup_problem()}")
    (tmp_path / "cmds.json").write_text(json.dumps({"cgroup": "cat /proc/self/cgroup"}))
    (tmp_path / "scratch").mkdir()
    proc = subprocess.run([str(harbor_python), str(REPO / "tests" / "harbor" / "hostile_probe.py"),
                           str(tmp_path / "cmds.json"), str(tmp_path / "scratch")], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                                                      "DS_TTT_PROBE_ENV_KWARGS": json.dumps({"cgroup_caps": cgroup_caps})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout)["cgroup"]
    for way in ("exec", "shell"):
        lines = got[way].splitlines()
        memory = [line for line in lines if ":memory:" in line] or [line for line in lines if line.startswith("0::")]
        assert memory, got[way]
        # the trial's own cgroup (v1: the memory line; v2: the unified line), or none when declined
        assert ("/ds_ttt_sbx_" in memory[0]) == (cgroup_caps == "required"), got[way]


def test_the_old_environment_is_caught_escaping(harbor_python, tmp_path):
    old = tmp_path / "old_harbor_env.py"
    text = subprocess.run(["git", "show", f"{OLD_ENV_COMMIT}:ds_ttt/serve/harbor_env.py"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout
    # it imported the sandbox's environment variables from the module that is now ds_ttt/sandbox/shell.py
    old_import = "from ds_ttt.data.sandbox import SANDBOX_ENV"
    assert old_import in text
    old.write_text(text.replace(old_import, "from ds_ttt.sandbox.shell import SANDBOX_ENV"))
    with HostTargets() as targets:
        got = probe(harbor_python, tmp_path, targets, ["chroot_escape", "read_host_files"], env_file=old)
        assert "the secret token appeared in the output" in targets.failures(got["chroot_escape"]["exec"]), got
        assert targets.failures(got["read_host_files"]["exec"]) == []  # a plain read was already blocked there
