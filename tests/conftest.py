"""Shared pytest fixtures: tiny seeded Qwen3-architecture configs and models (nothing is downloaded).

Run the suite with `python -m pytest` from the repository root (see README.md).
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture
def tiny_qwen3_config():
    """8 layers (divisible by 4), hidden 64, 4 q / 2 kv heads, head_dim 16, vocab 256."""
    from ds_ttt.model.presets import tiny_qwen3_config as make

    return make(num_hidden_layers=8, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=256)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module whose models are tiny (thread start-up dominates on 2 cores);
    use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def scripted_export(tmp_path_factory) -> pathlib.Path:
    """A tiny TTT export that has memorized one solution of the shipped Harbor task count-lines (one bash
    call, then an answer: tests/harbor/scripted_agent.py). Session-wide: the Harbor tests serve it, the
    closed-loop tests run it on the task in process."""
    from ds_ttt.data.tokenizer import load_tokenizer
    from ds_ttt.export import export_model
    from tests.harbor.scripted_agent import train_scripted_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = load_tokenizer()
        out = tmp_path_factory.mktemp("harbor") / "scripted-export"
        export_model(train_scripted_model(tok), out, tokenizer=tok)
    finally:
        torch.set_num_threads(threads)
    return out
