"""Write the hash-pinned locks that setup.sh installs, from the loose requirement files beside them.

    python requirements/lock.py            # rewrite requirements/{build,cpu,harbor}.lock
    python requirements/lock.py --check    # exit 1 when a lock differs from what pip resolves today

What each lock holds (every package of its environment: `name==version --hash=sha256:...`):
  build.lock   pip and setuptools: installed first, so that deepspeed (an sdist) and ds_ttt build
               with locked tools (`--no-build-isolation`) instead of whatever the index serves that day
  cpu.lock     requirements/cpu.txt resolved for .venv's Python (3.11): the CPU stack
  harbor.lock  requirements/harbor.txt resolved for Harbor's Python (>= 3.12; setup_harbor.sh finds it)

How: `pip install --dry-run --ignore-installed --report` resolves a requirement file exactly as
`pip install -r` would on this machine (same indexes, find-links and constraints), and its report
names each chosen file with its sha256. A lock therefore pins the very files pip would install here;
`pip install --require-hashes -r X.lock` then installs exactly those or refuses. Refresh a lock only
on purpose (a new pin in cpu.txt), then rerun the test suite: tests/unit/test_lock.py checks that the
locks cover the requirement files and that the installed environment equals the lock.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
BUILD_TOOLS = ("pip==26.3", "setuptools==84.2.1")  # setuptools >= 70 builds wheels itself: no `wheel`
# lock file -> (the loose requirements it resolves, the Python that resolves it: the one setup.sh's venv has)
ROOT = HERE.parent
LOCKS = {"build.lock": (None, ROOT / ".venv/bin/python"), "cpu.lock": ("cpu.txt", ROOT / ".venv/bin/python"),
         "harbor.lock": ("harbor.txt", ROOT / ".venv-harbor/bin/python")}


def normalized(name: str) -> str:
    """PEP 503's name normalisation: `Jinja2`, `typing_extensions` -> `jinja2`, `typing-extensions`."""
    return name.lower().replace("_", "-").replace(".", "-")


def resolve(python: str, requirements: list[str]) -> list[tuple[str, str, str]]:
    """(name, version, sha256) of every file `pip install` would take for `requirements` here."""
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), *requirements], check=True)
        items = json.loads(report.read_text())["install"]
    out = []
    for item in items:
        meta, info = item["metadata"], item["download_info"]
        sha = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        if sha is None:
            raise SystemExit(f"lock: pip reports no sha256 for {meta['name']} ({info['url']}): cannot lock it")
        out.append((normalized(meta["name"]), meta["version"], sha))
    return sorted(out)


def render(lock_name: str, source: str | None, python: str, pins: list[tuple[str, str, str]]) -> str:
    what = f"requirements/{source}" if source else "the build tools " + ", ".join(BUILD_TOOLS)
    head = [f"# {lock_name}: {what}, resolved by `pip install --dry-run --report` with {python}.",
            "# Written by requirements/lock.py; do not edit by hand. Install: pip install --require-hashes -r this file."]
    return "\n".join(head + [f"{n}=={v} --hash=sha256:{h}" for n, v, h in pins]) + "\n"


def read_lock(path: pathlib.Path) -> dict[str, tuple[str, str]]:
    """name -> (version, sha256) of a lock file."""
    pins = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        spec, _, digest = line.partition(" --hash=sha256:")
        name, _, version = spec.partition("==")
        if not version or not digest:
            raise ValueError(f"{path}: {line!r} is not `name==version --hash=sha256:...`")
        pins[normalized(name)] = (version, digest.strip())
    return pins


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    ap.add_argument("--python", action="append", default=[], metavar="LOCK=PYTHON",
                    help="the interpreter for one lock, e.g. harbor.lock=~/.pyenv/versions/3.12.1/bin/python")
    args = ap.parse_args()
    pythons = dict(p.split("=", 1) for p in args.python)
    stale = []
    for lock_name, (source, default_python) in LOCKS.items():
        python = str(pythons.get(lock_name, default_python))
        requirements = list(BUILD_TOOLS) if source is None else ["-r", str(HERE / source)]
        version = subprocess.run([python, "-c", "import sys; print('Python %d.%d' % sys.version_info[:2])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        text = render(lock_name, source, version, resolve(python, requirements))
        path = HERE / lock_name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(lock_name)
        else:
            path.write_text(text)
            print(f"[lock] wrote {path} ({text.count(chr(10)) - 2} packages)")
    if stale:
        print(f"[lock] differs from today's resolution: {', '.join(stale)} (rerun python requirements/lock.py)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
