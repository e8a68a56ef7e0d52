#!/usr/bin/env bash
# Set up the Harbor venv, .venv-harbor: Harbor (Python >= 3.12) with ds_ttt installed editable and
# without its dependencies (the Harbor agent and environment import no torch). The project's own venv
# (.venv, Python 3.11) is separate; setup.sh calls this script. Idempotent: a second run with the same
# requirements/harbor.txt only checks the imports (~2 s); a fresh install takes ~40 s. See docs/harbor.md.
#
#   bash setup_harbor.sh                      # then .venv-harbor/bin/harbor run ... (docs/harbor.md)
#   HARBOR_PYTHON=/path/to/python3.12 bash setup_harbor.sh
#   DS_TTT_SKIP_HARBOR=1 bash setup.sh        # an explicit opt-out: no Harbor venv, its test skips
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if [ "${DS_TTT_SKIP_HARBOR:-0}" = "1" ]; then
  echo "[setup_harbor] DS_TTT_SKIP_HARBOR=1: not creating .venv-harbor (tests/harbor will skip)"
  exit 0
fi
t0=$(date +%s)
VENV=.venv-harbor

is_py312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
  local candidates=()
  [ -n "${HARBOR_PYTHON:-}" ] && candidates+=("$HARBOR_PYTHON")
  candidates+=(python3.12 python3.13 python3)  # the pins were resolved on 3.12
  if command -v pyenv >/dev/null 2>&1; then
    local root; root=$(pyenv root)
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.[0-9]+)?$' | sort -V); do
      candidates+=("$root/versions/$v/bin/python")
    done
  fi
  for c in "${candidates[@]}"; do
    if command -v "$c" >/dev/null 2>&1 && is_py312 "$c"; then command -v "$c"; return 0; fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! is_py312 "$VENV/bin/python"; then
  if ! PY=$(find_python); then
    echo "[setup_harbor] error: Harbor needs Python >= 3.12 and none was found (tried \$HARBOR_PYTHON, python3.13," \
         "python3.12, python3, pyenv versions). Install one (e.g. 'pyenv install 3.12') and set HARBOR_PYTHON," \
         "or opt out with DS_TTT_SKIP_HARBOR=1." >&2
    exit 1
  fi
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.requirements.sha256"
want=$(sha256sum requirements/build.lock requirements/harbor.lock pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # as locked (requirements/lock.py): versions and sha256 of every package, build tools first
  "$VENV/bin/python" -m pip install -q --require-hashes -r requirements/build.lock
  "$VENV/bin/python" -m pip install -q --require-hashes --no-build-isolation -r requirements/harbor.lock
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" -c "import sys, harbor, openai, importlib.metadata as m; import ds_ttt.sandbox; \
assert 'torch' not in sys.modules; \
print(f'[setup_harbor] {sys.executable}: Python {sys.version.split()[0]}, harbor {m.version(\"harbor\")}, openai {openai.__version__}, ds_ttt {m.version(\"ds_ttt\")}')"
echo "[setup_harbor] $(( $(date +%s) - t0 )) s"
