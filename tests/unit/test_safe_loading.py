"""Safe loading only: no code of the project unpickles arbitrary objects.

An `ast` scan of ds_ttt/, launch/, evals/, data_prep/ and benchmarks/ fails on any `torch.load`
without a literal `weights_only=True` (including `weights_only=False`), any `pickle.load(s)` (also
cPickle / dill / joblib) and any `numpy.load(..., allow_pickle=True)`. DeepSpeed's own checkpoint
loader is switched to weights_only=True with only its few objects allow-listed (checkpoint.py,
use_safe_loading): tested here on what it must load and what it must refuse.

    python -m pytest tests/unit/test_safe_loading.py
"""

from __future__ import annotations

import ast
import pathlib
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = ("ds_ttt", "launch", "evals", "data_prep", "benchmarks", "gpu_check")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle"}


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return "?"


def is_true(call: ast.Call, key: str) -> bool | None:
    """True / False for a literal keyword, None when absent; a non-literal value counts as unsafe."""
    for kw in call.keywords:
        if kw.arg == key:
            return isinstance(kw.value, ast.Constant) and kw.value.value is True
    return None


def unsafe_loads(source: str, filename: str = "<src>") -> list[tuple[int, str, str]]:
    """(line, call, why) for every unsafe load in `source`, resolving `import x as y` and
    `from x import load` aliases."""
    tree = ast.parse(source, filename)
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        head, _, rest = name.partition(".")
        full = alias.get(head, head) + ("." + rest if rest else "")
        text = ast.unparse(node)
        if full in ("torch.load", "torch.serialization.load"):
            if is_true(node, "weights_only") is not True:
                found.append((node.lineno, text, "torch.load without weights_only=True"))
        elif full.split(".")[0] in PICKLE_MODULES and full.rsplit(".", 1)[-1] in ("load", "loads", "Unpickler"):
            found.append((node.lineno, text, "unpickling"))
        elif full == "numpy.load" and any(kw.arg == "allow_pickle" and not (
                isinstance(kw.value, ast.Constant) and kw.value.value is False) for kw in node.keywords):
            found.append((node.lineno, text, "numpy.load with allow_pickle"))
    return found


def test_scanner_catches_every_unsafe_form():
    bad = """
import torch, pickle, numpy as np
import torch as T
from torch import load
from pickle import loads as L
torch.load(f)
torch.load(f, weights_only=False)
T.load(f, map_location="cpu")
load(f)
torch.load(f, weights_only=flag)
pickle.load(f)
L(b)
np.load(f, allow_pickle=True)
torch.serialization.load(f)
"""
    assert [line for line, _, _ in unsafe_loads(bad)] == list(range(6, 15))
    good = """
import torch, numpy as np, json
torch.load(f, weights_only=True)
torch.load(f, map_location="cpu", weights_only=True)
np.load(f)
np.load(f, allow_pickle=False)
json.load(f)
"""
    assert unsafe_loads(good) == []


def test_project_loads_nothing_unsafely():
    problems = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, text, why in unsafe_loads(path.read_text(), rel):
                problems.append(f"{rel}:{line}: {text}: {why}")
    assert not problems, "unsafe loads (use weights_only=True, safetensors, or plain JSON):\n" + "\n".join(problems)


class Arbitrary:  # any class that is not allow-listed: a weights_only load must refuse it
    pass


def test_deepspeed_loader_is_weights_only_with_its_objects_allowed(tmp_path):
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from ds_ttt.train.safe_loading import use_safe_loading

    engine = types.SimpleNamespace(checkpoint_engine=TorchCheckpointEngine(None), _config=None)
    use_safe_loading(engine)
    # what a ZeRO-1 optimizer file holds besides tensors
    torch.save({"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.optimizer_states,
                "w": torch.ones(2)}, tmp_path / "optim.pt")
    loaded = engine.checkpoint_engine.load(str(tmp_path / "optim.pt"))
    assert loaded["loss_scaler"].cur_scale == 1.0 and torch.equal(loaded["w"], torch.ones(2))
    torch.save({"obj": Arbitrary()}, tmp_path / "evil.pt")
    TorchCheckpointEngine(None).load(str(tmp_path / "evil.pt"))  # DeepSpeed's own loader unpickles anything
    with pytest.raises(Exception, match="Weights only load failed"):
        engine.checkpoint_engine.load(str(tmp_path / "evil.pt"))


def test_other_checkpoint_engines_are_refused():
    from ds_ttt.train.safe_loading import use_safe_loading

    class NebulaLike:
        pass

    with pytest.raises(ValueError, match="checkpoint engine NebulaLike"):
        use_safe_loading(types.SimpleNamespace(checkpoint_engine=NebulaLike(), _config=None))
