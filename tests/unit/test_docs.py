"""Docs that match the repository: README.md and docs/*.md checked against committed results and the tree.

    .venv/bin/python -m pytest -q tests/unit/test_docs.py

1. Main-job numbers. A prose block (a paragraph, a list item, a table row or a heading; fenced code is
   not read) that names the main job ("main job", "main-job", `launch/main.sh` or `runs/main`) and states a
   duration, a step count or a rate ("957 s", "15.9 min", "1,000 steps", "1.26 steps/s") must carry
   a tag naming the committed result each number comes from:

       <!-- results: adaptation.json:main_seconds adaptation.json:seeds.max_steps -->

   Each spec is FILE:KEY, FILE relative to benchmarks/results/ (a .jsonl file gives one value per
   record), KEY a dotted path; its unit comes from its name (`*seconds`, `*minutes`, `*steps`,
   `*steps_per_s`). Every number with a unit in a tagged block must equal one of its keys (in any
   unit of the same quantity, to the number's printed precision), and every key must be stated.
   Thresholds ("<= 25 min", "under 60 min") are targets, not measurements, and are skipped.
2. README's layout block (the fence under "## Layout") names only paths that exist, and names every
   top-level folder of the committed tree (`git ls-tree HEAD`, dot-folders aside) and every package
   of ds_ttt/.
3. docs/training.md's rule for ds_ttt/train: its modules' module-level imports form layers, never a cycle.
4. Every repository path that docs/glossary.md names exists, and README links the glossary.
5. No two test modules under pyproject's testpaths share a file name: the test folders are not packages,
   so pytest imports each module by its bare name and refuses the whole run at collection when two
   collide (tests/unit/test_layout_move.py beside tests/e2e/test_layout_move.py did once).
6. The tree stands on its own: README.md, docs/*.md and the sources (.py, .sh, .cpp, .cu, .cuh, .h) under
   ds_ttt/, launch/, evals/, data_prep/, benchmarks/, gpu_check/ and tests/ name no issue number of the
   team's tracker (a clone cannot look it up: name the feature instead) and no path of one machine (the
   team's sibling shared folder, the `/work` or `/home` trees).
Each checker also runs on a changed copy of the real text, to show it can fail.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# ---------------------------------------------------------------------------------------------------
# 1. main-job numbers against benchmarks/results
# ---------------------------------------------------------------------------------------------------
MAIN_JOB = re.compile(r"main[ -]job|launch/main\.sh|runs/main\b", re.IGNORECASE)
TAG = re.compile(r"<!--\s*results:\s*(.*?)\s*-->")
NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNITS = {"steps/s": "rate", "steps per second": "rate", "s / step": "s/step", "s/step": "s/step",
         "steps": "steps", "seconds": "time", "s": "time", "minutes": "time", "min": "time"}
TO_BASE = {"seconds": 1.0, "s": 1.0, "minutes": 60.0, "min": 60.0}  # time in seconds
CLAIM = re.compile(r"(?<![\w.\-/])(" + NUM + r")(?:\s*[–-]\s*(" + NUM + r"))?\s*("
                   + "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True)) + r")(?![\w/])")
THRESHOLD = re.compile(r"(≤|≥|<=|>=|<|>|under|at most|at least|up to|within)\s*$")
LIST_ITEM = re.compile(r"^\s*([-*]|\d+\.)\s")


def blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each prose block; fenced code is skipped."""
    out, cur, start, fenced = [], [], 0, False

    def flush():
        nonlocal cur
        if cur:
            out.append((start, "\n".join(cur)))
        cur = []

    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced or not line.strip():
            flush()
            continue
        if line.lstrip().startswith(("|", "#")) or LIST_ITEM.match(line):
            flush()
            start, cur = i, [line]
            if line.lstrip().startswith(("|", "#")):
                flush()
            continue
        if not cur:
            start = i
        cur.append(line)
    flush()
    return out


def claims(text: str) -> list[tuple[float, int, str]]:
    """(value, decimals, unit) of every measured number with a unit; thresholds are left out."""
    out = []
    for m in CLAIM.finditer(text):
        if THRESHOLD.search(text[max(0, m.start() - 12):m.start()]):
            continue
        for num in filter(None, (m.group(1), m.group(2))):
            plain = num.replace(",", "")
            out.append((float(plain), len(plain.split(".")[1]) if "." in plain else 0, m.group(3)))
    return out


def key_unit(key: str) -> str:
    name = key.split(".")[-1]
    for suffix, unit in (("steps_per_s", "steps/s"), ("seconds", "s"), ("minutes", "min"), ("steps", "steps")):
        if name == suffix or name.endswith("_" + suffix):
            return unit
    raise ValueError(f"{key}: no unit in its name (expected *seconds, *minutes, *steps or *steps_per_s)")


def lookup(spec: str, results: pathlib.Path) -> tuple[str, list[float]]:
    """FILE:KEY -> (unit, values); a .jsonl file gives one value per record."""
    file, _, key = spec.partition(":")
    path = results / file
    if not key or not path.is_file():
        raise ValueError(f"results spec {spec!r}: expected FILE:KEY with FILE under {results}")
    text = path.read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()] if file.endswith(".jsonl") \
        else [json.loads(text)]
    values = []
    for rec in records:
        for part in key.split("."):
            if not isinstance(rec, dict) or part not in rec:
                raise ValueError(f"results spec {spec!r}: {file} has no key {key!r}")
            rec = rec[part]
        values.append(float(rec))
    return key_unit(key), values


def same_quantity(value: float, decimals: int, unit: str, key_unit_: str, key_value: float) -> bool:
    if UNITS[unit] != UNITS[key_unit_]:
        return False
    if UNITS[unit] == "time":
        key_value = key_value * TO_BASE[key_unit_] / TO_BASE[unit]
    return abs(value - key_value) <= 0.5 * 10.0 ** -decimals + 1e-9


def check_main_job_numbers(name: str, text: str, results: pathlib.Path = RESULTS) -> list[str]:
    """Problems (empty when the text agrees with the committed results)."""
    problems = []
    for line, block in blocks(text):
        where = f"{name}:{line}"
        specs = [s for tag in TAG.findall(block) for s in tag.split()]
        found = claims(TAG.sub(" ", block))
        if not specs:
            if found and MAIN_JOB.search(block):
                problems.append(f"{where}: names the main job and states {[f'{v:g} {u}' for v, _, u in found]} "
                                "without a <!-- results: FILE:KEY ... --> tag naming where the numbers come from")
            continue
        try:
            keys = [(spec, *lookup(spec, results)) for spec in specs]
        except ValueError as e:
            problems.append(f"{where}: {e}")
            continue
        used = set()
        for value, decimals, unit in found:
            hits = [spec for spec, ku, values in keys if any(same_quantity(value, decimals, unit, ku, kv) for kv in values)]
            if not hits:
                problems.append(f"{where}: '{value:g} {unit}' matches none of "
                                f"{[f'{spec} = {values}' for spec, _, values in keys]}")
            used.update(hits)
        for spec, _, values in keys:
            if spec not in used:
                problems.append(f"{where}: the tag names {spec} = {values}, but the block states no such number")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_main_job_numbers_match_committed_results(path):
    assert check_main_job_numbers(path.name, path.read_text()) == []


def test_main_job_checker_can_fail():
    readme = (REPO / "README.md").read_text()
    seconds = json.loads((RESULTS / "adaptation.json").read_text())["main_seconds"]
    assert f"{seconds} s" in readme and check_main_job_numbers("README.md", readme) == []
    changed = check_main_job_numbers("README.md", readme.replace(f"{seconds} s", f"{seconds + 60} s", 1))
    assert any(f"'{seconds + 60:g} s' matches none" in p for p in changed)
    untagged = check_main_job_numbers("README.md", TAG.sub("", readme))
    assert untagged and all("without a <!-- results" in p for p in untagged)
    assert check_main_job_numbers("x.md", "The main job takes 12 min.") != []
    assert check_main_job_numbers("x.md", "The main job must take <= 25 min.") == []  # a target
    wrong_key = check_main_job_numbers("x.md", "<!-- results: adaptation.json:no_such_seconds --> 957 s")
    assert wrong_key and "no key" in wrong_key[0]


# ---------------------------------------------------------------------------------------------------
# 2. README's layout block
# ---------------------------------------------------------------------------------------------------
PATHLIKE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+(?:\.(?:py|sh|json|md|txt|toml|cpp|cu|cuh|h|jinja)|/))(?![\w/])")


def layout_block(readme: str) -> str:
    m = re.search(r"^## Layout\s*\n+```[^\n]*\n(.*?)\n```", readme, re.MULTILINE | re.DOTALL)
    assert m, "README.md has no fenced block under '## Layout'"
    return m.group(1)


def layout_paths(block: str) -> list[str]:
    """Every path the block names: a row's first column, and the file or folder names in its description,
    which are relative to that row's folder (or to the folder of the row's file)."""
    paths, base = [], ""
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            first, _, rest = line.partition(" ")
            paths.append(first)
            base = first if first.endswith("/") else (first.rpartition("/")[0] + "/" if "/" in first else "")
        else:
            rest = line
        paths += [p if p.startswith(base) else base + p for p in PATHLIKE.findall(rest)]
    return paths


def tracked_top_level() -> set[str]:
    """The committed tree's top-level folders (HEAD: what a checkout has), dot-folders aside."""
    try:
        out = subprocess.run(["git", "ls-tree", "-z", "--name-only", "-d", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"the layout check needs git's committed tree: {e}")
    return {name + "/" for name in out.split("\0") if name and not name.startswith(".")}


def check_layout(block: str, root: pathlib.Path, required: set[str]) -> list[str]:
    paths = layout_paths(block)
    problems = [f"README layout names {p}, which does not exist" for p in paths if not (root / p).exists()]
    named = set()  # a folder counts as named when it or a path inside it is
    for p in paths:
        parts = p.rstrip("/").split("/")
        named |= {"/".join(parts[:i]) + "/" for i in range(1, len(parts) + p.endswith("/"))}
    problems += [f"README layout does not name {d}" for d in sorted(required) if d not in named]
    return problems


def required_layout_entries() -> set[str]:
    packages = {f"ds_ttt/{p.name}/" for p in (REPO / "ds_ttt").iterdir() if (p / "__init__.py").is_file()}
    return tracked_top_level() | packages


def test_readme_layout_matches_tree():
    block = layout_block((REPO / "README.md").read_text())
    assert check_layout(block, REPO, required_layout_entries()) == []


def test_layout_checker_can_fail():
    block = layout_block((REPO / "README.md").read_text())
    required = required_layout_entries()
    assert any("does not exist" in p for p in check_layout(block + "\nno_such_dir/   gone", REPO, required))
    without = "\n".join(line for line in block.splitlines() if not line.startswith("launch/"))
    assert "README layout does not name launch/" in check_layout(without, REPO, required)
    # a file named in a row's description is looked up in that row's folder
    renamed = block.replace("main.sh", "nothing.sh", 1)
    assert "README layout names launch/nothing.sh, which does not exist" in check_layout(renamed, REPO, required)


# ---------------------------------------------------------------------------------------------------
# 3. ds_ttt/train imports in layers (docs/training.md, "Module map")
# ---------------------------------------------------------------------------------------------------
def module_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported (top level, or inside a top-level if/try)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try)):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]


def train_imports(package: pathlib.Path) -> dict[str, set[str]]:
    """module -> the sibling modules it imports at module level."""
    mods = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    prefix = "ds_ttt.train"
    graph = {}
    for m in mods:
        deps = set()
        for node in module_level_imports(ast.parse((package / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = node.module if node.level == 0 else ".".join(filter(None, (prefix, node.module)))
                if mod == prefix:
                    deps.update(a.name for a in node.names)
                elif mod and mod.startswith(prefix + "."):
                    deps.add(mod.split(".")[2])
            else:
                deps.update(a.name.split(".")[2] for a in node.names if a.name.startswith(prefix + "."))
        graph[m] = (deps & mods) - {m}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_train_modules_import_in_layers():
    graph = train_imports(REPO / "ds_ttt" / "train")
    assert find_cycle(graph) is None, f"import cycle in ds_ttt/train: {' -> '.join(find_cycle(graph))}"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# ---------------------------------------------------------------------------------------------------
# 4. the glossary
# ---------------------------------------------------------------------------------------------------
REPO_PATH = re.compile(r"`((?:ds_ttt|launch|evals|data_prep|benchmarks|tests|ds_configs|docs|gpu_check)/[\w./-]*)`")


def test_glossary_paths_exist_and_readme_links_it():
    text = (REPO / "docs" / "glossary.md").read_text()
    paths = REPO_PATH.findall(text)
    assert len(paths) > 10
    missing = [p for p in paths if not (REPO / p).exists()]
    assert missing == [], f"docs/glossary.md names paths that do not exist: {missing}"
    assert "](docs/glossary.md)" in (REPO / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------
# 5. test module names
# ---------------------------------------------------------------------------------------------------
def colliding_test_modules(paths: list[str]) -> dict[str, list[str]]:
    """{file name: its paths} for every test_*.py name that more than one path uses."""
    by_name: dict[str, list[str]] = {}
    for path in paths:
        name = pathlib.PurePosixPath(path).name
        if name.startswith("test_") and name.endswith(".py"):
            by_name.setdefault(name, []).append(path)
    return {name: found for name, found in by_name.items() if len(found) > 1}


def test_test_module_names_are_unique():
    testpaths = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    files = [str(p.relative_to(REPO)) for root in testpaths for p in (REPO / root).rglob("test_*.py")]
    assert len(files) > 40
    assert colliding_test_modules(files) == {}, "rename one of each pair: pytest imports test modules by bare name"
    assert colliding_test_modules(["tests/unit/test_a.py", "tests/e2e/test_a.py", "tests/e2e/test_b.py"]) == {
        "test_a.py": ["tests/unit/test_a.py", "tests/e2e/test_a.py"]
    }


# ---------------------------------------------------------------------------------------------------
# 6. a tree that stands on its own: no tracker issue numbers, no paths of one machine
# ---------------------------------------------------------------------------------------------------
STANDALONE_ROOTS = ("ds_ttt", "launch", "evals", "data_prep", "benchmarks", "gpu_check", "tests")
STANDALONE_SUFFIXES = {".py", ".sh", ".cpp", ".cu", ".cuh", ".h"}
# Not read: generated output (benchmark results and logs record what ran, where it ran), the test
# fixtures (recorded shell sessions, whose home directories are the sandboxed task's) and prebuilt objects.
NOT_STANDALONE_CHECKED = ("benchmarks/results/", "gpu_check/logs/", "gpu_check/prebuilt/", "tests/assets/")

# An issue number of the team's tracker (N being digits): "issue N", "Issue N", "issue-N", "issueN",
# "issue #N", "issues N and M", or "#N" standing alone in prose (after a space or a bracket). Not flagged:
# a verb ("the k-step issues 3·MT loads": a plural without a list after its number), a hex colour
# (written in quotes, "#1f77b4" / "#000000", or with letters after its digits), a Markdown heading
# ("## Use") and an upstream project's issue URL (".../issues/123"): a link anyone can follow is a
# citation, while a bare number only means something inside this team's tracker.
ISSUE_NUMBER = re.compile(
    r"\bissues?[\s_-]*#\d+"
    r"|\bissue[\s_-]*\d+\b"
    r"|\bissues\s+\d+(?=\s*(?:,|and\b|&|/|\)|;|\.(?!\d)|$))"
    r"|(?<![^\s(\[])#\d+\b",
    re.IGNORECASE | re.MULTILINE)
# A path of one machine: the team's sibling folder, or an absolute path into /work or /home (a slash on
# each side; "/tmp/..." scratch paths are any machine's, and "net/work/" is not absolute).
MACHINE_PATH = re.compile(r"\.\./shared\b|(?<![\w.~-])/(?:work|home)/")
PATH_WORD = re.compile(r"[^\s`'\"()<>]+")  # the whole path, for the message


def standalone_files(root: pathlib.Path = REPO) -> list[str]:
    """Repository-relative paths of every file section 6 reads."""
    out = [str(p.relative_to(root)) for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]]
    for top in STANDALONE_ROOTS:
        for p in sorted((root / top).rglob("*")):
            rel = p.relative_to(root).as_posix()
            if (p.suffix in STANDALONE_SUFFIXES and p.is_file() and not rel.startswith(NOT_STANDALONE_CHECKED)
                    and not any(part == "__pycache__" or part.startswith(".") for part in p.relative_to(root).parts)):
                out.append(rel)
    return out


def standalone_problems(name: str, text: str) -> list[str]:
    """'FILE:LINE: what' for every issue number and machine path in the text."""
    found = [(m.start(), f"issue number {m.group(0)!r}") for m in ISSUE_NUMBER.finditer(text)]
    found += [(m.start(), f"machine path {PATH_WORD.match(text, m.start()).group(0)!r}")
              for m in MACHINE_PATH.finditer(text)]
    return [f"{name}:{text.count(chr(10), 0, start) + 1}: {what}" for start, what in sorted(found)]


def test_no_issue_numbers_or_machine_paths():
    problems = [p for rel in standalone_files()
                for p in standalone_problems(rel, (REPO / rel).read_text(errors="replace"))]
    assert problems == [], ("name the feature instead of its issue number, and use repository-relative "
                            "paths:\n" + "\n".join(problems))


def test_standalone_checker_can_fail():
    files = standalone_files()
    for expected in ("README.md", "docs/flashbob_math.md", "launch/main.sh", "evals/heldout_sets.py",
                     "data_prep/generate.py", "ds_ttt/ops/flashbob/csrc/flashbob_cpu.cpp",
                     "ds_ttt/ops/flashbob/csrc/flashbob_cuda_kernel.cu", "gpu_check/run.sh", "tests/unit/test_docs.py"):
        assert expected in files
    assert not any(f.startswith(NOT_STANDALONE_CHECKED) or "__pycache__" in f for f in files)
    readme = (REPO / "README.md").read_text()
    assert standalone_problems("README.md", readme) == []
    n = "2" + "9"  # built, so that this file names no issue number itself
    for bad in (f"(issue {n})", f"Issue {n}'s fix", f"the issue-{n} targets", f"issue{n}/", f"issue #{n}",
                f"issues {n} and 30", f"see #{n}.", f"(#{n})", f"as issue\n{n} reports"):
        changed = standalone_problems("README.md", readme.replace("## Layout", f"## Layout {bad}", 1))
        assert len(changed) == 1 and "issue number" in changed[0], bad
    for bad in ("../" + "shared/design/flashbob_math.md", "cd /" + "work/main &&", "`/" + "home/me/x`"):
        changed = standalone_problems("README.md", readme.replace("## Layout", f"## Layout {bad}", 1))
        assert len(changed) == 1 and "machine path" in changed[0], bad
    assert standalone_problems("x.md", f"## Layout\nsee #{n}\n") == [f"x.md:2: issue number '#{n}'"]
    for fine in ('colors = ["#1f77b4", "#000000"]', "k-step issues 3·MT + 4·NB/2 ldmatrix", "no open issues",
                 "https://github.com/containers/bubblewrap/issues/123", "--out /tmp/fb.json", "net/work/x",
                 "## Use", "x = 1  # a comment", "ls /work /root /home 2>&1", "tissue 3"):
        assert standalone_problems("x", fine) == [], fine
