# Sourced by launch/main.sh and benchmarks/adaptation_baselines.sh (from the checkout's root):
#     source launch/same_checkout.sh && require_same_checkout "$PY"
# setup.sh installs ds_ttt in editable mode, so a Python of another checkout (a worktree whose .venv
# is a link to main's, say) imports THAT checkout's package: this tree's scripts would then run
# another tree's library without a word. require_same_checkout refuses it, naming both trees and the fix.
require_same_checkout() {
  local py="$1" here found
  here="$(pwd -P)"
  # -P: no current directory on sys.path, as for `python script.py` (it would hide the editable install)
  found="$("$py" -P -c 'import os, ds_ttt; print(os.path.dirname(os.path.dirname(os.path.realpath(ds_ttt.__file__))))')" || {
    echo "error: $py cannot import ds_ttt; run 'bash setup.sh' in $here" >&2; return 1; }
  if [ "$found" != "$here" ]; then
    echo "error: $py imports ds_ttt from $found, not from this checkout ($here); run 'bash setup.sh' here" \
         "(its own .venv), or set PYTHONPATH=$here to run this tree's package with that Python" >&2
    return 1
  fi
}
