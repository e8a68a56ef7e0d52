"""No import cycle among the modules of ds_ttt/data/ and ds_ttt/sandbox/: each concept imports only those below it.

    .venv/bin/python -m pytest -q tests/unit/test_import_graph.py

Every `import` and `from ... import` of each module is read with `ast`, function-level ones included
(an import moved into a function only postpones a cycle: the modules still need each other), and
resolved to the ds_ttt module it names: `from .x import y` is module x, or module x.y where y is a
submodule. A package's own import of its parent (`import ds_ttt.sandbox.caps` runs
ds_ttt/sandbox/__init__.py first) is not an edge: Python finishes that chain without a cycle. The
graph starts at these two folders and follows every edge into the rest of ds_ttt, so a cycle through
another package (data -> serve -> data) is found too. Standard-library and third-party imports are
not followed. The checker also runs on a small made-up graph, to show it can fail.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
ROOTS = ("ds_ttt/data", "ds_ttt/sandbox")


def module_file(name: str) -> pathlib.Path | None:
    """The file of ds_ttt module `name` (a package's __init__.py), None if there is none."""
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(name: str, path: pathlib.Path) -> set[str]:
    """The ds_ttt modules that module `name` (at `path`) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            targets = [f"{mod}.{a.name}" if module_file(f"{mod}.{a.name}") else mod for a in node.names]
        else:
            continue
        out |= {t for t in targets if t == "ds_ttt" or t.startswith("ds_ttt.")}
    return {t for t in out if module_file(t) is not None} - {name}


def import_graph(roots=ROOTS) -> dict[str, set[str]]:
    todo = [module_name(p) for root in roots for p in sorted((REPO / root).glob("*.py"))]
    graph: dict[str, set[str]] = {}
    while todo:
        name = todo.pop()
        if name not in graph:
            graph[name] = imports_of(name, module_file(name))
            todo += sorted(graph[name] - graph.keys())
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for d in sorted(graph.get(n, ())):
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


def test_data_and_sandbox_modules_import_without_a_cycle():
    graph = import_graph()
    assert {"ds_ttt.data.generator", "ds_ttt.sandbox.shell", "ds_ttt.sandbox.probe"} <= graph.keys()
    assert "ds_ttt.sandbox" in graph["ds_ttt.data.generator"]  # the edges are read (not an empty graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_checker_can_fail(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    # an import at the bottom of a module, or inside a function, is an edge like any other
    src = "def f():\n    from .shell import Shell\nfrom . import files\n"
    (tmp_path / "m.py").write_text(src)
    assert imports_of("ds_ttt.sandbox.probe", tmp_path / "m.py") == {"ds_ttt.sandbox.shell", "ds_ttt.sandbox.files"}
