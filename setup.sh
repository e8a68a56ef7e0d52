#!/usr/bin/env bash
# Set up ds_ttt on a fresh machine: a virtual environment in .venv with the CPU stack and the
# package installed in editable mode. Idempotent; ~1 minute (torch 2.13.0 CPU comes from local disk).
#
#   bash setup.sh            # then use .venv/bin/python, .venv/bin/deepspeed
#
# The CUDA stack is separate: requirements/gpu.txt (see README.md, "GPU machines").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PYTHON="${PYTHON:-python3}"
setup_t0=$(date +%s)
# bubblewrap: the sandbox of every model-written command (ds_ttt/sandbox/, docs/sandbox.md)
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq bubblewrap
  else
    echo "[setup] bwrap not found: install bubblewrap (sudo apt-get install bubblewrap), or run the generator and the" \
         "serve runner with --no-isolation" >&2
    exit 1
  fi
fi
# iproute2: the two-node test makes each node a network namespace (tests/e2e/test_multinode.py)
if ! command -v ip >/dev/null 2>&1 && [ ! -x /usr/sbin/ip ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq iproute2
  else
    echo "[setup] ip not found: the two-node test skips without it (sudo apt-get install iproute2)" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Installed as locked (requirements/lock.py writes the locks): every package at its version and sha256, the
# build tools first so that deepspeed (an sdist) and ds_ttt build with them, not with the index's newest.
.venv/bin/python -m pip install -q --require-hashes -r requirements/build.lock
.venv/bin/python -m pip install -q --require-hashes --no-build-isolation -r requirements/cpu.lock
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
.venv/bin/python -c "import torch, deepspeed, transformers; print(f'[setup] torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}')"
# each sandbox's cgroup (docs/sandbox.md): the sandbox refuses where none can be made; say so now, with the fix
.venv/bin/python -c "from ds_ttt.sandbox import cgroup_problem; p = cgroup_problem(); print('[setup] per-episode cgroup caps: ' + ('available' if p is None else 'UNAVAILABLE, sandboxes will refuse: ' + p))"
# launch/main.sh counts this in the main command's wall time when it starts right after setup
echo $(( $(date +%s) - setup_t0 )) > .venv/.setup_seconds
# The Harbor venv (.venv-harbor, Python >= 3.12) for the Harbor agent and its test; see docs/harbor.md
bash setup_harbor.sh
