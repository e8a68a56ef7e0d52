"""The pieces of a move to another layout that need no launch (ds_ttt/train/layout_move.py): the
weights_only check of the source, the anchor written into the universal folder, the engine's
universal-load switch. The moves themselves: tests/e2e/test_layout_move.py; the refusals:
tests/unit/test_resume_checks.py.

    python -m pytest tests/unit/test_layout_move_parts.py
"""

from __future__ import annotations

import argparse

import pytest
import torch

from ds_ttt.train.layout_move import (ANCHOR, UNIVERSAL_DIR, check_source_loads_safely, with_universal_load,
                                      write_anchor)


def test_a_source_file_that_unpickles_an_object_is_refused(tmp_path):
    torch.save({"module": {"w": torch.ones(2)}}, tmp_path / "mp_rank_00_model_states.pt")
    check_source_loads_safely(tmp_path)
    torch.save({"x": argparse.Namespace(a=1)}, tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(ValueError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt does not load with "
                                         r"weights_only=True .*move from another checkpoint"):
        check_source_loads_safely(tmp_path)


def test_the_anchor_is_zeros_at_the_other_parameters_step(tmp_path):
    zero = tmp_path / UNIVERSAL_DIR
    (zero / "7.norm.weight").mkdir(parents=True)
    torch.save(torch.tensor(5.0), zero / "7.norm.weight" / "step.pt")
    (zero / ANCHOR).mkdir()  # a source with several anchor stages: replaced
    torch.save({"cat_dim": 0, "param": torch.zeros(3)}, zero / ANCHOR / "fp32.pt")
    write_anchor(zero)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert torch.equal(torch.load(zero / ANCHOR / f"{key}.pt", weights_only=True)["param"], torch.zeros(1))
    assert float(torch.load(zero / ANCHOR / "step.pt", weights_only=True)) == 5.0


def test_the_universal_load_switch_keeps_the_rest_of_the_config():
    ds = {"train_batch_size": 4, "checkpoint": {"tag_validation": "Warn"}}
    assert with_universal_load(ds) == {"train_batch_size": 4,
                                       "checkpoint": {"tag_validation": "Warn", "load_universal": True}}
    assert "load_universal" not in ds["checkpoint"]  # the recorded config is not changed
