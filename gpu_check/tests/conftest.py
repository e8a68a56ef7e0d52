"""The GPU check's CPU tests share the suite's fixtures and environment (tests/conftest.py: tiny seeded
Qwen3 configs, DS_ACCELERATOR=cpu, the project-local extensions cache).

    .venv/bin/python -m pytest gpu_check/tests -q
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `tests` is imported from the repository root, as `python -m pytest` sees it
    sys.path.insert(0, str(REPO))

from tests.conftest import _seed, one_torch_thread, tiny_qwen3_config  # noqa: E402,F401
