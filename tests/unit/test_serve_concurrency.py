"""benchmarks/serve_concurrency.py's record of what it ran on and its --against ratios, on made-up levels.

    .venv/bin/python -m pytest -q tests/unit/test_serve_concurrency.py

No server is started: the paired rounds are synthetic, so the ratios are known exactly.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "serve_concurrency.py"


@pytest.fixture(scope="module")
def sc():
    spec = importlib.util.spec_from_file_location("serve_concurrency", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def level(decode: float, tokens_per_s: float = 1.0) -> dict:
    return {"decode_tokens_per_s": decode, "tokens_per_s": tokens_per_s}


def test_against_gives_the_scaling_ratio_and_the_rate_over_rev(sc):
    # this tree: 100 tok/s alone, 600 at 8 sessions (x6); REV: 100 alone, 400 at 8 (x4); three rounds alike
    paired = {"batched": {1: [level(100)] * 3, 8: [level(600)] * 3},
              "against": {1: [level(100)] * 3, 8: [level(400)] * 3}}
    got = sc.against(paired, [1, 8], "main", "f" * 40)
    assert got["scaling_ratio_over_against"][8]["median"] == pytest.approx(1.5)
    assert got["decode_over_against"][8]["median"] == pytest.approx(1.5)
    assert got["decode_over_against"][1]["median"] == pytest.approx(1.0)
    assert got["paired_decode_speedup"][8]["median"] == pytest.approx(4.0)
    lo, hi = got["scaling_ratio_over_against"][8]["lo"], got["scaling_ratio_over_against"][8]["hi"]
    assert lo == hi == pytest.approx(1.5)  # equal rounds: a zero-width interval


def test_the_interval_spans_the_rounds(sc):
    out = sc.median_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert out["median"] == 3.0 and 1.0 <= out["lo"] < 3.0 < out["hi"] <= 5.0


def test_the_markdown_says_what_it_ran_on(sc):
    res = {"model": {"preset": "tiny-mem", "num_layers": 5, "hidden": 128, "vocab_size": 1216}, "shape": "qwen3-0.6b",
           "max_tokens": 4, "repeats": 1, "table": {"batched": {1: {"tokens_per_s": 9.0, "p50_ms": 1.0, "p95_ms": 2.0,
                                                                     "decode_tokens_per_s": 50.0}}},
           "base_commit": "0" * 40, "same_replies": True, "levels": [1], "pairs": 2,
           "machine": sc.machine("cpu"), "one_session_decode_tokens_per_s": 50.0,
           "load_start": [0.5, 0.7, 1.6], "load_end": [0.9, 0.8, 1.5], "cpu_count": 2,
           "speedup_vs_one": {1: {"median": 1.0, "min": 1.0, "max": 1.0}},
           "decode_speedup_vs_one": {1: {"median": 1.0, "min": 1.0, "max": 1.0}},
           "speedup_vs_best_one": {1: {"median": 1.0, "min": 1.0, "max": 1.0}}, "speedup_vs_today": {},
           "paired_decode_speedup": {1: sc.median_interval([1.0, 1.0])},
           "paired_speedup": {1: sc.median_interval([1.0, 1.0])},
           "against": sc.against({"batched": {1: [level(50)] * 2}, "against": {1: [level(40)] * 2}}, [1], "HEAD~1",
                                 "a" * 40)}
    md = sc.markdown(res)
    assert res["machine"]["cpu_model"] and res["machine"]["gpu"] is None
    assert f"Ran on: {res['machine']['cpu_model']}" in md and "one-session decode rate (batched server) 50.0 tokens/s" in md
    assert "(1, 5, 15 min) 0.50, 0.70, 1.60 at the start, 0.90, 0.80, 1.50 at the end" in md
    assert "with the qwen3-0.6b backbone" in md and "decode tokens/s, this tree over HEAD~1 | x1.25 [1.25, 1.25]" in md
