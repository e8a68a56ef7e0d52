"""Module boundaries of ds_ttt/: every module is small, and none reaches into another's private names.

    .venv/bin/python -m pytest -q tests/unit/test_module_boundaries.py

Every `*.py` under ds_ttt/ is read with `ast` (nothing is imported). A name is *private* when it starts
with one underscore and is not a dunder (`_state` is private, `__init__` and a bare `_` are not). The rules:

1. Size: no module has more than 500 lines.
2. Reads: no module reads a private name that another module owns. A read is any of
   a. `from x import _name` (any module x, relative or absolute), or `import x._y` (a private
      component of a dotted module name);
   b. `x._name` where `x` is a name the module binds by an import (`import torch`, `from m import Obj`):
      whatever `x` is, it belongs to another module, so its private names are that module's;
   c. `obj._name` for any other expression `obj` except the bare names `self` and `cls`, unless this
      module itself defines `_name`: as a function or class (`def _name`, `class _name`), as a name it
      assigns (`_name = ...`, `_name: T` in a class body, a dataclass field), or as an attribute it
      assigns on `self` or `cls` (`self._name = ...`). A private name a module defines is its own to
      use on any object of its own classes; a name it does not define belongs to someone else
      (`session._state()` in a module without `_state`, `tensor._version`).
3. Writes: no module assigns a private attribute of an object other than `self` or `cls`:
   `obj._attr = ...`, `obj._attr += ...`, `obj._attr: T = ...` (targets inside tuples included) and
   `setattr(obj, "_attr", ...)` with a literal name, whatever module `obj` comes from: an object's
   private state is set by its own methods.
A violation is reported as `path:line: rule: what`. The checkers also run on small made-up sources, to
show they can fail.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
MAX_LINES = 500
OWNERS = ("self", "cls")


def is_private(name: str) -> bool:
    return name.startswith("_") and len(name) > 1 and not (name.startswith("__") and name.endswith("__"))


def modules() -> list[pathlib.Path]:
    return sorted((REPO / "ds_ttt").rglob("*.py"))


def targets(node: ast.AST) -> list[ast.AST]:
    """The assignment targets of a statement, tuples and lists unpacked."""
    if isinstance(node, ast.Assign):
        todo = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        todo = [node.target]
    else:
        return []
    out = []
    while todo:
        t = todo.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            todo += t.elts
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
        else:
            out.append(t)
    return out


def is_owner(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in OWNERS


def defined_private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines (rule 2c): its functions and classes, the names it assigns, and
    the attributes it assigns on self/cls."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        for t in targets(node):
            if isinstance(t, ast.Name):
                out.add(t.id)
            elif isinstance(t, ast.Attribute) and is_owner(t.value):
                out.add(t.attr)
    return {n for n in out if is_private(n)}


def imported_names(tree: ast.Module) -> set[str]:
    """The names a module binds by an import, anywhere in its body (rule 2b)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out |= {a.asname or a.name for a in node.names if a.name != "*"}
    return out


def private_reads(source: str, path: str = "<source>") -> list[str]:
    """Rule 2's violations in one module's source: `path:line: private read: what`."""
    tree = ast.parse(source, path)
    mine, imported = defined_private_names(tree), imported_names(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            where = "." * node.level + (node.module or "")
            out += [f"{path}:{node.lineno}: private read: from {where} import {a.name}"
                    for a in node.names if is_private(a.name)]
        elif isinstance(node, ast.Import):
            out += [f"{path}:{node.lineno}: private read: import {a.name}"
                    for a in node.names if any(is_private(p) for p in a.name.split(".")[1:])]
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and not is_owner(node.value):
            if isinstance(node.ctx, ast.Store):
                continue  # an assignment: rule 3
            of_import = isinstance(node.value, ast.Name) and node.value.id in imported
            if of_import or node.attr not in mine:
                out.append(f"{path}:{node.lineno}: private read: {ast.unparse(node)}")
    return out


def private_writes(source: str, path: str = "<source>") -> list[str]:
    """Rule 3's violations in one module's source: `path:line: private write: what`."""
    out = []
    for node in ast.walk(ast.parse(source, path)):
        for t in targets(node):
            if isinstance(t, ast.Attribute) and is_private(t.attr) and not is_owner(t.value):
                out.append(f"{path}:{node.lineno}: private write: {ast.unparse(t)} = ...")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) >= 2 and not is_owner(node.args[0]) and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and is_private(node.args[1].value)):
            out.append(f"{path}:{node.lineno}: private write: {ast.unparse(node)}")
    return out


def too_long(source: str, path: str = "<source>") -> list[str]:
    n = len(source.splitlines())
    return [f"{path}:{n}: size: {n} lines > {MAX_LINES}"] if n > MAX_LINES else []


def violations(check) -> list[str]:
    out = []
    for p in modules():
        out += check(p.read_text(), str(p.relative_to(REPO)))
    return out


def test_the_modules_are_read():
    names = {str(p.relative_to(REPO)) for p in modules()}
    assert {"ds_ttt/model/qwen3.py", "ds_ttt/serve/session.py", "ds_ttt/ops/flashbob/builder.py"} <= names


def test_no_module_exceeds_500_lines():
    found = violations(too_long)
    assert not found, "modules over the limit:\n" + "\n".join(found)


def test_no_module_reads_another_modules_private_names():
    found = violations(private_reads)
    assert not found, "private names read across modules:\n" + "\n".join(found)


def test_no_module_sets_private_attributes_of_other_objects():
    found = violations(private_writes)
    assert not found, "private attributes set on other objects:\n" + "\n".join(found)


MADE_UP = '''\
import torch
from ds_ttt.serve.session import AgentSession, _State
from ._impl import _helper
import pkg._hidden


class Box:
    def __init__(self):
        self._items = []

    def merge(self, other: "Box"):
        self._items += other._items          # fine: this module defines _items (on self)
        return other._size()                 # read: _size is defined nowhere here


def use(session: AgentSession, box: Box, cache):
    session._state()                         # read: not defined here
    torch._C                                 # read: an imported module's private name
    AgentSession._forward                    # read: an imported object's private name
    box._items                               # fine: defined here
    cache._k = None                          # write
    cache.k, (box._items, x) = 1, (2, 3)     # write, inside a tuple
    cache._n += 1                            # write
    setattr(cache, "_v", 2)                  # write
    setattr(cache, "v", 2)                   # fine: public
    self = box
    self._items = []                         # fine (a name that is self)
'''


def test_the_checker_can_fail():
    reads = sorted(v.split(": ", 2)[2] for v in private_reads(MADE_UP))
    assert reads == sorted(["from ds_ttt.serve.session import _State", "from ._impl import _helper", "import pkg._hidden",
                            "other._size", "session._state", "torch._C", "AgentSession._forward"])
    writes = sorted(v.split(": ", 2)[2] for v in private_writes(MADE_UP))
    assert writes == sorted(["cache._k = ...", "box._items = ...", "cache._n = ...", "setattr(cache, '_v', 2)"])
    assert too_long("x = 1\n" * 501) and not too_long("x = 1\n" * 500)
    clean = "class A:\n    def __init__(self):\n        self._x = 1\n\n    def same(self, o):\n        return o._x\n"
    assert private_reads(clean) == [] and private_writes(clean) == []
