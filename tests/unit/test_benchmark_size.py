"""No Python file under benchmarks/ is longer than 450 lines.

    .venv/bin/python -m pytest -q tests/unit/test_benchmark_size.py

A longer script is split by concept: helper modules beside it (flashbob.py and flashbob_step.py,
memory_ceiling.py and memory_ceiling_keys.py / memory_ceiling_report.py) or a package of its own
(pipeline_balance/). The checker also runs on made-up files, to show it can fail.
"""

from __future__ import annotations

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
MAX_LINES = 450


def long_files(root: pathlib.Path) -> list[tuple[str, int]]:
    """(path relative to root, number of lines) of every .py file below root longer than MAX_LINES."""
    sizes = ((p, len(p.read_text().splitlines())) for p in sorted(root.rglob("*.py")))
    return [(str(p.relative_to(root)), n) for p, n in sizes if n > MAX_LINES]


def test_no_benchmark_file_is_longer_than_450_lines():
    assert long_files(REPO / "benchmarks") == []


def test_the_checker_can_fail(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "deep.py").write_text("x = 1\n" * (MAX_LINES + 100))
    (tmp_path / "fits.py").write_text("x = 1\n" * MAX_LINES)
    assert long_files(tmp_path) == [("long.py", MAX_LINES + 1), ("pkg/deep.py", MAX_LINES + 100)]
