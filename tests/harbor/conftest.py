"""Fixtures of the Harbor tests: the Harbor venv and the project's HTTP server serving the tiny export that
has memorized one solution of the shipped task (`scripted_export`, tests/conftest.py) on an ephemeral port.

Run: python -m pytest tests/harbor (needs .venv-harbor from `bash setup_harbor.sh`; see docs/harbor.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.harbor.scripted_agent import HARBOR_VENV, REPO, free_port

SERVER_START_TIMEOUT_SEC = 300


@pytest.fixture(scope="session")
def harbor_python() -> Path:
    python = HARBOR_VENV / "bin" / "python"
    if not (HARBOR_VENV / "bin" / "harbor").is_file():
        msg = (f"HARBOR VENV MISSING: {HARBOR_VENV} has no `harbor` CLI, so the Harbor agent test cannot run. "
               "Create it with `bash setup_harbor.sh` (setup.sh does; CI must have it).")
        print(f"\n*** {msg}\n", file=sys.stderr)
        pytest.skip(msg)
    return python


@pytest.fixture(scope="session")
def ttt_server(scripted_export, tmp_path_factory):
    """`python -m ds_ttt.serve.frontends.http` on 127.0.0.1 with an ephemeral port; yields its /v1 base URL."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ds_ttt.serve.frontends.http", "--model", str(scripted_export),
                                 "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_SEC
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not answer /health in {SERVER_START_TIMEOUT_SEC} s:\n"
                                     f"{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
