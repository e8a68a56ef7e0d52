"""The FlashBoB benchmark's honesty rules (benchmarks/flashbob.py, its child processes in
benchmarks/flashbob_step.py): a wrong result, a rate above the run's measured peak, or more CPU time
than the threads allow is reported as an error.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/unit/test_flashbob_benchmark.py -q

The checker is run in-process on a tiny shape with outputs taken from the reference itself
(must pass) and with one element perturbed (must fail); the judge on synthetic rows.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    """A benchmark script as a module; benchmarks/ on sys.path for the driver's `import flashbob_step`."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load("flashbob")


@pytest.fixture(scope="module")
def step():
    return _load("flashbob_step")


def _row(**kw):
    row = dict(ok=True, impl="cpu", gflops=50.0, flop=50e9, times_s=[1.0, 1.0, 1.0],
               cpu_s=[1.5, 1.5, 1.5], threads=2, unchecked=False,
               check=dict(ok=True, results=[]))
    row.update(kw)
    return row


PEAK = dict(wall_gflops=90.0, cpu_gflops_per_cpu_s=60.0)


def test_judge_accepts_an_honest_row(bench):
    assert bench._judge(_row(), PEAK, "cpu") == []


@pytest.mark.parametrize("change, words", [
    (dict(gflops=179.2), "above the run's measured fp32 matmul peak"),
    (dict(cpu_s=[0.5, 0.5, 0.5]), "GFLOP per CPU-second is above"),
    (dict(cpu_s=[2.5, 2.5, 2.5]), "exceeds the 2 threads"),
    (dict(check=dict(ok=False, results=[dict(errors=dict(
        kbar=dict(err=1.0, tol=1e-6, ok=False)))])), "check against the reference failed"),
    (dict(check=dict(ok=False, error="checker exit 1")), "checker exit 1"),
], ids=["above_peak", "above_peak_per_cpu_second", "impossible_parallelism", "wrong_result",
        "checker_crashed"])
def test_judge_flags(bench, change, words):
    errors = bench._judge(_row(**change), PEAK, "cpu")
    assert any(words in e for e in errors), errors


def test_unchecked_rows_are_not_called_checked(bench):
    row = _row(unchecked=True)
    del row["check"]
    assert bench._judge(row, PEAK, "cpu") == []


def _saved_reference(step, tmp_path, N, Hq, Hkv, D, perturb=None):
    x = step.inputs("cpu", torch.float32, N, Hq, Hkv, D, "bhnd")
    outs = {n: t.float() for n, t in step.reference(x, Hq, Hkv, torch.float64).items()}
    if perturb:
        outs[perturb][0, 0, 3, 1] += 1e-3 * outs[perturb].abs().max()
    path = tmp_path / f"out_{perturb}.pt"
    torch.save(outs, path)
    return [dict(path=str(path), fingerprint="x", repeats=[0])]


@pytest.mark.parametrize("perturb", [None, "kbar", "o"])
def test_checker_catches_a_wrong_output(step, tmp_path, perturb):
    N, Hq, Hkv, D = 96, 4, 2, 16
    saved = _saved_reference(step, tmp_path, N, Hq, Hkv, D, perturb)
    res = step.checker(dict(device="cpu", N=N, Hq=Hq, Hkv=Hkv, D=D, threads=1,
                            saved=dict(cpu=saved)))["cpu"]
    assert res["ok"] == (perturb is None), res
    if perturb:
        assert not res["results"][0]["errors"][perturb]["ok"]
        assert all(e["ok"] for n, e in res["results"][0]["errors"].items() if n != perturb)
