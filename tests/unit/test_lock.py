"""The locks (requirements/*.lock, written by requirements/lock.py) cover what setup.sh installs, and the
environments were installed as locked.

    python -m pytest tests/unit/test_lock.py
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"
_spec = importlib.util.spec_from_file_location("requirements_lock", REQ / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)


def loose_requirements(path: pathlib.Path) -> list[Requirement]:
    return [Requirement(line.split("#")[0].strip()) for line in path.read_text().splitlines()
            if line.split("#")[0].strip()]


@pytest.mark.parametrize("lock_name", sorted(lock.LOCKS))
def test_every_line_of_a_lock_pins_one_version_and_one_sha256(lock_name):
    path = REQ / lock_name
    pins = lock.read_lock(path)
    assert pins, f"{path} is empty"
    for name, (version, digest) in pins.items():
        assert re.fullmatch(r"[0-9a-f]{64}", digest), f"{path}: {name} has no sha256"
        assert version and not any(c in version for c in "<>=*, "), f"{path}: {name} is not one version"


def test_read_lock_refuses_an_unhashed_line(tmp_path):
    bad = tmp_path / "x.lock"
    bad.write_text("torch==2.13.0\n")
    with pytest.raises(ValueError, match=r"x\.lock: 'torch==2\.13\.0' is not"):
        lock.read_lock(bad)


@pytest.mark.parametrize("lock_name,source", [("cpu.lock", "cpu.txt"), ("harbor.lock", "harbor.txt")])
def test_the_lock_satisfies_every_loose_requirement(lock_name, source):
    pins = lock.read_lock(REQ / lock_name)
    for req in loose_requirements(REQ / source):
        name = lock.normalized(req.name)
        assert name in pins, f"{lock_name} lacks {req.name} (requirements/{source}): rerun requirements/lock.py"
        assert req.specifier.contains(pins[name][0], prereleases=True), \
            f"{lock_name} pins {name}=={pins[name][0]}, outside requirements/{source}'s {req}"


def test_the_build_lock_pins_the_build_tools_it_names():
    pins = lock.read_lock(REQ / "build.lock")
    for tool in lock.BUILD_TOOLS:
        name, version = tool.split("==")
        assert pins.get(name, (None,))[0] == version


def test_setup_installs_only_the_locks_with_their_hashes():
    for script, lock_name in (("setup.sh", "cpu.lock"), ("setup_harbor.sh", "harbor.lock")):
        installs = [line for line in (ROOT / script).read_text().splitlines()
                    if "pip install" in line and not line.lstrip().startswith("#")]
        assert any("--require-hashes" in line and "requirements/build.lock" in line for line in installs), script
        assert any("--require-hashes" in line and f"requirements/{lock_name}" in line for line in installs), script
        others = [line for line in installs if "--require-hashes" not in line]
        assert all("--no-deps" in line and line.rstrip().endswith("-e .") for line in others), \
            f"{script} installs something unlocked: {others}"


def installed(python: str) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout
    return {lock.normalized(k): v for k, v in json.loads(out).items()}


@pytest.mark.parametrize("lock_name,venv", [("cpu.lock", ".venv"), ("harbor.lock", ".venv-harbor")])
def test_the_environment_equals_its_lock(lock_name, venv):
    python = ROOT / venv / "bin" / "python"
    if lock_name == "cpu.lock" and pathlib.Path(sys.prefix).resolve() != (ROOT / venv).resolve():
        pytest.skip(f"the tests run outside {venv} ({sys.prefix}): setup.sh's environment is not the one under test")
    if not python.exists():
        pytest.skip(f"{venv} does not exist (setup_harbor.sh was skipped with DS_TTT_SKIP_HARBOR=1)")
    want = {n: v for n, (v, _) in lock.read_lock(REQ / lock_name).items()}
    want.update({n: v for n, (v, _) in lock.read_lock(REQ / "build.lock").items()})
    have = installed(str(python))
    have.pop("ds-ttt", None)  # the project itself, editable
    assert have == want, (f"{venv} is not {lock_name}: "
                          f"differ {sorted((n, have.get(n), want.get(n)) for n in set(have) | set(want) if have.get(n) != want.get(n))}"
                          " (rerun setup.sh)")
    assert importlib.metadata.version("ds_ttt")  # installed editable, no deps
