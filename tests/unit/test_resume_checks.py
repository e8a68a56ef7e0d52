"""--resume refuses what it cannot reproduce and tells an exact resume from a move: a changed global
batch (train_batch_size) is refused in one line that names the key, the saved and the new value and
the fix; a changed micro batch, gradient accumulation, data-parallel size or pipeline (stages,
partition) is a move to another layout (check_reproducible returns True), which keeps every TTT
setting but the implementation choices and the seed, writes a new RUN_DIR and needs ZeRO partitions
(ds_ttt/train/layout_move.py); the unchanged case is an exact resume in place. The saved sample cursor
is read and checked against the step counts.

    python -m pytest tests/unit/test_resume_checks.py
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from ds_ttt.config import TTTConfig
from ds_ttt.model.presets import backbone_config
from ds_ttt.train import checkpoint as ck
from ds_ttt.train.layout import resolve_layout
from ds_ttt.train.layout_move import IMPLEMENTATION_TTT, check_movable, check_target_zero
from ds_ttt.train.resume_checks import DATA_ORDER_KEYS, check_reproducible, check_resume_source, resume_cursor
from ds_ttt.train.run_config import RunConfig
from ds_ttt.train.run_record import RUN_CONFIG, RunInfo, resolved_config

TTT = TTTConfig(adaptive_layers=2)
SAVED_ORDER = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
               "data_parallel_size": 2}


def saved_info(tmp_path, *, step=6, stage_start_step=0, data_order=SAVED_ORDER, zero_stage=1):
    backbone = backbone_config("tiny")
    layout = resolve_layout(2, backbone.num_hidden_layers, TTT)
    run = RunConfig(data="x/manifest.json", output=str(tmp_path), ttt=TTT)
    ds = {"pipeline": {"stages": 2}, "zero_optimization": {"stage": zero_stage}}
    res = resolved_config(run=run, backbone=backbone, ds=ds, plan=None,
                          layout=layout, manifest_path="x/manifest.json", manifest_sha256="abc",
                          stage_start_step=stage_start_step, data_order=data_order)
    d = tmp_path / ck.tag_for(step)
    d.mkdir()
    (d / RUN_CONFIG).write_text(json.dumps({**res, "step": step}))
    (d / ck.COMPLETE).write_text("")
    return RunInfo.read(d), backbone.num_hidden_layers


def test_unchanged_layout_resumes_in_place(tmp_path):
    info, num_layers = saved_info(tmp_path)
    assert check_reproducible(info, dict(SAVED_ORDER), resolve_layout(2, num_layers, TTT)) is False


def test_changed_global_batch_is_refused(tmp_path):
    info, num_layers = saved_info(tmp_path)
    with pytest.raises(ValueError) as e:
        check_reproducible(info, {**SAVED_ORDER, "train_batch_size": 16}, resolve_layout(2, num_layers, TTT))
    msg = str(e.value)
    assert "\n" not in msg
    assert f"--resume: train_batch_size is 16 now but 8 in {info.checkpoint / RUN_CONFIG}" in msg
    assert "set train_batch_size=8 in the DeepSpeed config" in msg and "--start-stage-from" in msg


@pytest.mark.parametrize("change", [
    {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4},
    {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
    {"data_parallel_size": 4, "gradient_accumulation_steps": 1},
    {"data_parallel_size": 1, "gradient_accumulation_steps": 4},
])
def test_changed_split_of_the_global_batch_is_a_move(tmp_path, change):
    info, num_layers = saved_info(tmp_path)
    assert check_reproducible(info, {**SAVED_ORDER, **change}, resolve_layout(2, num_layers, TTT)) is True


def test_changed_pipeline_stages_are_a_move(tmp_path):
    info, num_layers = saved_info(tmp_path)
    assert check_reproducible(info, dict(SAVED_ORDER), resolve_layout(4, num_layers, TTT)) is True
    assert check_reproducible(info, dict(SAVED_ORDER), resolve_layout(1, num_layers, TTT)) is True


def test_changed_partition_is_a_move(tmp_path):
    n = backbone_config("tiny").num_hidden_layers  # 8: 6 non-adaptive layers over 3 non-last stages
    info, _ = saved_info(tmp_path)
    raw = json.loads((info.checkpoint / RUN_CONFIG).read_text())
    raw["layout"] = resolve_layout(4, n, TTT).to_dict()  # saved: 4 stages, default partition [2, 2, 2]
    (info.checkpoint / RUN_CONFIG).write_text(json.dumps(raw))
    info = RunInfo.read(info.checkpoint)
    assert check_reproducible(info, dict(SAVED_ORDER), resolve_layout(4, n, TTT, partition=[2, 2, 2])) is False
    assert check_reproducible(info, dict(SAVED_ORDER), resolve_layout(4, n, TTT, partition=[3, 2, 1])) is True


def run_like(info: RunInfo, output, **changes) -> RunConfig:
    """The run config a --resume of `info` builds (its own run record), with `changes` applied."""
    run = RunConfig.from_dict(info.run)
    ttt = changes.pop("ttt", {})
    return dataclasses.replace(run, output=str(output), ttt=dataclasses.replace(run.ttt, **ttt), **changes)


def test_a_move_writes_a_new_run_dir(tmp_path):
    info, _ = saved_info(tmp_path)
    manifest = types.SimpleNamespace(sha256="abc")
    with pytest.raises(ValueError, match=r"another layout writes a new RUN_DIR .*pass --output NEW_RUN_DIR"):
        check_resume_source(run_like(info, tmp_path), info, manifest, moving=True)
    check_resume_source(run_like(info, tmp_path / "moved"), info, manifest, moving=True)
    (tmp_path / "moved").mkdir()
    (tmp_path / "moved" / ck.LATEST).write_text("step_00000002")
    with pytest.raises(ValueError, match="already holds a run"):
        check_resume_source(run_like(info, tmp_path / "moved"), info, manifest, moving=True)


@pytest.mark.parametrize("changes,named", [
    ({"ttt": {"inner_lr": 0.5}}, "ttt.inner_lr=0.5 but"),
    ({"ttt": {"context_policy": "current_round"}}, "ttt.context_policy='current_round' but"),
    ({"ttt": {"obs_loss_weight": 1.0}}, "ttt.obs_loss_weight=1.0 but"),
    ({"seed": 3}, "seed=3 but"),
])
def test_a_move_refuses_another_computation_by_name(tmp_path, changes, named):
    info, _ = saved_info(tmp_path)
    with pytest.raises(ValueError) as e:
        check_movable(run_like(info, tmp_path / "moved", **changes), info, dict(SAVED_ORDER))
    msg = str(e.value)
    assert "\n" not in msg and named in msg and str(info.checkpoint / RUN_CONFIG) in msg, msg


def test_a_move_may_change_the_implementation_only(tmp_path):
    info, _ = saved_info(tmp_path)
    for key in IMPLEMENTATION_TTT:
        value = {"attention_backend": "cpu", "checkpoint_events": not TTT.checkpoint_events}[key]
        check_movable(run_like(info, tmp_path / "moved", ttt={key: value}), info, dict(SAVED_ORDER))


def test_a_move_needs_zero_partitions(tmp_path):
    info, _ = saved_info(tmp_path, zero_stage=0)
    with pytest.raises(ValueError, match=r"zero_optimization\.stage=0.*continue it in its own layout"):
        check_movable(run_like(info, tmp_path / "moved"), info, dict(SAVED_ORDER))
    with pytest.raises(ValueError, match=r"zero_optimization\.stage=0 in the DeepSpeed config.*set zero_optimization"):
        check_target_zero({"zero_optimization": {"stage": 0}})
    check_target_zero({"zero_optimization": {"stage": 1}})


def test_checkpoint_without_a_recorded_order_is_refused(tmp_path):
    info, n = saved_info(tmp_path, data_order=None)
    with pytest.raises(ValueError, match=r"records no batch layout \(data_order\).*--start-stage-from"):
        check_reproducible(info, dict(SAVED_ORDER), resolve_layout(2, n, TTT))


def test_sample_cursor_is_read_and_checked(tmp_path):
    info, _ = saved_info(tmp_path, step=6)
    client = {"stage_step": 6, "cursor": {"epoch": 1, "batch": 2, "samples": 48}}
    assert resume_cursor(client, info, steps_per_epoch=4, train_batch_size=8) == 6
    for bad in ({"epoch": 1, "batch": 1, "samples": 40},  # cursor behind the step
                {"epoch": 1, "batch": 2, "samples": 40}):  # sample count disagrees
        with pytest.raises(ValueError, match="saved data cursor .* disagrees"):
            resume_cursor({**client, "cursor": bad}, info, steps_per_epoch=4, train_batch_size=8)
    with pytest.raises(ValueError, match="disagrees"):  # the epoch length changed (another train split size)
        resume_cursor(client, info, steps_per_epoch=3, train_batch_size=8)
    with pytest.raises(ValueError, match="no data cursor"):
        resume_cursor({"stage_step": 6}, info, steps_per_epoch=4, train_batch_size=8)


def test_data_order_keys_are_what_the_trainer_records():
    assert set(DATA_ORDER_KEYS) == set(SAVED_ORDER)


@pytest.mark.parametrize("drop,named", [
    (("layout", "tied_embeddings"), "layout.tied_embeddings"),
    (("ttt", "key_shift"), "ttt.key_shift"),
    (("manifest", "sha256"), "manifest.sha256"),
    (("plan",), "plan"),
])
def test_a_record_without_a_field_is_refused_by_name(tmp_path, drop, named):
    """A run_config.json lacking a field the trainer always writes is refused, naming the file and the
    field; no field takes a default (an untied layout or the default key_shift were assumed before, so
    a resume could rebuild another model than the one saved)."""
    info, _ = saved_info(tmp_path)
    path = info.checkpoint / RUN_CONFIG
    d = json.loads(path.read_text())
    parent = d
    for k in drop[:-1]:
        parent = parent[k]
    del parent[drop[-1]]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        RunInfo.read(info.checkpoint)
    msg = str(e.value)
    assert msg.startswith(f"{path}: missing {named};") and "start a new run" in msg, msg


def test_a_record_that_is_not_json_is_refused_by_name(tmp_path):
    info, _ = saved_info(tmp_path)
    path = info.checkpoint / RUN_CONFIG
    path.write_text(path.read_text()[:-20])  # cut short
    with pytest.raises(ValueError, match=rf"^{path}: not valid JSON \(.*line 1 column"):
        RunInfo.read(info.checkpoint)


def test_a_field_added_later_reads_as_the_value_every_older_run_had(tmp_path):
    """ttt.first_order came after runs were written: such a record reads as second order (what every
    run before the field was), while any other missing field is still refused."""
    from ds_ttt.train.run_record import FIELDS_ADDED

    info, _ = saved_info(tmp_path)
    path = info.checkpoint / RUN_CONFIG
    d = json.loads(path.read_text())
    assert d["ttt"]["first_order"] is False  # the trainer writes it
    del d["ttt"]["first_order"]
    path.write_text(json.dumps(d))
    assert RunInfo.read(info.checkpoint).ttt_config().first_order is False
    assert FIELDS_ADDED == {"ttt": {"first_order": False}}
    del d["ttt"]["inner_steps"]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"missing ttt\.inner_steps;"):
        RunInfo.read(info.checkpoint)
