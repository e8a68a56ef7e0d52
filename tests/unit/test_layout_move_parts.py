"""The pieces of a move to another layout that need no launch (ds_ttt/train/layout_move.py): the
weights_only check of the source, the anchor written into the universal folder, the engine's
universal-load switch, and the conversion of a source of every preset x every stage count the trainer
accepts (a stage count it does not accept is refused at startup, naming the fix). The moves
themselves: tests/e2e/test_layout_move.py; the refusals: tests/unit/test_resume_checks.py.

Conversion matrix: for each preset (ds_ttt/model/presets.py), with the default ttt.adaptive_layers and
those of the shipped run configs (the main recipe: tiny-mem with 2), every pipeline.stages from 1 to
P + 1 (P non-adaptive layers; layout.py accepts no more) gets a ZeRO-1 checkpoint in DeepSpeed 0.19.8's
file format, written here with one small parameter per pipeline layer (its values name it): the layer
files of that layout, one model-state and one optimizer file per stage (mp_rank_NN_model_states.pt with
checkpoint_parallel_dimensions and param_shapes; zero_pp_rank_0_mp_rank_NN_optim_states.pt with the
flat fp32 partition, the AdamW state and the fragment addresses). `convert_for_move` (rank 0's part of
a move) must turn it into a universal checkpoint holding every parameter with its value, AdamW moments
and step, and copy every layer file. Before the conversion read a view without the layer files, the
largest stage count of every preset (P = stages - 1, e.g. the main recipe's 4-stage tiny-mem) raised
ZeroDivisionError in DeepSpeed's layer map, so those cases fail on that code. The e2e moves convert
checkpoints the trainer wrote.

    python -m pytest tests/unit/test_layout_move_parts.py       (60 cases, ~15 s)
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections import OrderedDict

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.presets import PRESETS, backbone_config
from ds_ttt.train.checkpoint import COMPLETE
from ds_ttt.train.layout import Layout, resolve_layout
from ds_ttt.train.layout_move import (ANCHOR, LAYER_FILES, UNIVERSAL_DIR, Move, check_source_loads_safely,
                                      convert_for_move, link_conversion_input, with_universal_load, write_anchor)
from ds_ttt.train.rng_state import RNG_DIR
from ds_ttt.train.run_record import DATA_IDS, RUN_CONFIG


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


# ---- conversion of every preset x every accepted stage count -------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUMEL = 3  # elements of the one parameter per pipeline layer
ADAM_STEP = 4.0


def shipped_adaptive_layers(preset: str) -> set[int]:
    """ttt.adaptive_layers of every shipped run config (ds_configs/run_*.json) that names `preset`
    (the main recipe run_cpu_tiny.json: tiny-mem with 2)."""
    out = set()
    for path in sorted((ROOT / "ds_configs").glob("run_*.json")):
        run = json.loads(path.read_text())
        if run.get("preset") == preset and run.get("ttt", {}).get("adaptive_layers") is not None:
            out.add(run["ttt"]["adaptive_layers"])
    return out


def accepted_layouts() -> list[tuple[str, int, int]]:
    """(preset, adaptive_layers, stages) for every stage count layout.py accepts, with the default
    adaptive_layers and those of the shipped run configs, plus, per preset and adaptive_layers, the
    first stage count it refuses (stages = P + 2: marked by a negative count here)."""
    cases = set()
    for preset in sorted(PRESETS):
        num_layers = backbone_config(preset).num_hidden_layers
        for adaptive in sorted({TTTConfig().num_adaptive(num_layers)} | shipped_adaptive_layers(preset)):
            num_prefix = num_layers - adaptive
            cases.update((preset, adaptive, stages) for stages in range(1, num_prefix + 2))
            cases.add((preset, adaptive, -(num_prefix + 2)))
    return sorted(cases)


def param_value(spec_idx: int) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) + 100.0 * spec_idx


def write_zero1_checkpoint(ckpt: pathlib.Path, layout: Layout) -> list[str]:
    """A ZeRO-1 checkpoint of `layout` (dp 1) in DeepSpeed's format, one parameter `<spec>.w` per
    pipeline layer that saves a file; returns the parameter names."""
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    ckpt.mkdir(parents=True)
    parts, names = layout.spec_parts(), []
    for stage in range(layout.num_stages):
        specs = [i for i in range(parts[stage], parts[stage + 1]) if i <= layout.last_spec]
        stage_names = [f"{i}.w" for i in specs]
        names += stage_names
        flat = torch.cat([param_value(i) for i in specs])
        for i in specs:
            torch.save({"w": param_value(i)}, ckpt / f"layer_{i:02d}-model_states.pt")
        torch.save({"module": None, "buffer_names": [], "global_steps": int(ADAM_STEP), "ds_version": "0.19.8",
                    "param_shapes": [OrderedDict((n, torch.Size([NUMEL])) for n in stage_names)],
                    "checkpoint_parallel_dimensions": {"pp_degree": layout.num_stages, "tp_degree": 1},
                    "ds_config": {"zero_optimization": {"stage": 1}}},
                   ckpt / f"mp_rank_{stage:02d}_model_states.pt")
        optimizer = {
            "base_optimizer_state": {"state": {0: {"step": torch.tensor(ADAM_STEP), "exp_avg": flat / 10,
                                                   "exp_avg_sq": flat ** 2 / 100}},
                                     "param_groups": [{"lr": 1e-3, "params": [0]}]},
            "single_partition_of_fp32_groups": [flat], "zero_stage": ZeroStageEnum.optimizer_states,
            "group_paddings": [0], "partition_count": [1], "ds_version": "0.19.8",
            "param_slice_mappings": [OrderedDict((n, fragment_address(numel=NUMEL, start=NUMEL * j))
                                                 for j, n in enumerate(stage_names))]}
        torch.save({"optimizer_state_dict": optimizer, "ds_version": "0.19.8"},
                   ckpt / f"zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt")
    (ckpt / RNG_DIR).mkdir()
    torch.save({"rank": 0}, ckpt / RNG_DIR / "rank_00000.pt")
    for name in (RUN_CONFIG, DATA_IDS, COMPLETE):
        (ckpt / name).write_text(json.dumps({}))
    return names


@pytest.mark.parametrize("preset,adaptive,stages", accepted_layouts(),
                         ids=lambda v: str(v) if not isinstance(v, int) or v >= 0 else f"refused{-v}")
def test_every_accepted_layout_converts_for_a_move(tmp_path, preset, adaptive, stages):
    num_layers = backbone_config(preset).num_hidden_layers
    ttt = TTTConfig(adaptive_layers=adaptive)
    if stages < 0:  # more stages than layout.py accepts: refused at startup (validate_deepspeed), naming the fix
        with pytest.raises(ValueError, match=rf"pipeline.stages={-stages} needs at least {-stages - 1} "
                                             r"non-adaptive decoder layers.*lower pipeline.stages"):
            resolve_layout(-stages, num_layers, ttt)
        return
    layout = resolve_layout(stages, num_layers, ttt)
    source = tmp_path / "run" / "step_00000004"
    names = write_zero1_checkpoint(source, layout)
    assert len(list(source.glob(LAYER_FILES))) == layout.last_spec + 1 == len(names)

    moved = convert_for_move(Move(source=source, source_world=stages, old=f"pp{stages}", new="any"),
                             tmp_path / "new_run", rank=0)

    zero = moved / UNIVERSAL_DIR
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == sorted(names + [ANCHOR])
    for name in names:
        value = param_value(int(name.split(".")[0]))
        got = {k: torch.load(zero / name / f"{k}.pt", weights_only=True)["param"] for k in
               ("fp32", "exp_avg", "exp_avg_sq")}
        assert torch.equal(got["fp32"], value) and torch.equal(got["exp_avg"], value / 10), name
        assert torch.equal(got["exp_avg_sq"], value ** 2 / 100), name
        assert float(torch.load(zero / name / "step.pt", weights_only=True)) == ADAM_STEP, name
    assert sorted(p.name for p in moved.glob(LAYER_FILES)) == sorted(p.name for p in source.glob(LAYER_FILES))
    assert sorted(p.name for p in moved.glob("mp_rank_*_model_states.pt")) == \
        [f"mp_rank_{s:02d}_model_states.pt" for s in range(stages)]
    assert not (moved / ".conversion-input").exists()


def test_the_conversion_input_holds_every_deepspeed_file_but_the_layer_files(tmp_path):
    source = tmp_path / "ckpt"
    names = write_zero1_checkpoint(source, resolve_layout(4, 5, TTTConfig(adaptive_layers=2)))
    assert names == ["0.w", "1.w", "2.w", "3.w", "4.w"]  # tiny-mem in 4 stages: 5 layer files
    linked = link_conversion_input(source, tmp_path / "view")
    assert linked == [f"mp_rank_{s:02d}_model_states.pt" for s in range(4)] + \
        [f"zero_pp_rank_0_mp_rank_{s:02d}_optim_states.pt" for s in range(4)]
    assert all((tmp_path / "view" / n).resolve() == (source / n).resolve() for n in linked)
