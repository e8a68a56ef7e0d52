"""--resume refuses what it cannot reproduce: a changed batch layout (train_batch_size, micro batch,
gradient accumulation, data-parallel size) or pipeline (stages, partition) is refused in one line that
names the key, the saved and the new value and the fix; the unchanged case passes. The saved sample
cursor is read and checked against the step counts.

    python -m pytest tests/unit/test_resume_checks.py
"""

from __future__ import annotations

import json

import pytest

from ds_ttt.config import TTTConfig
from ds_ttt.model.presets import backbone_config
from ds_ttt.train import checkpoint as ck
from ds_ttt.train.layout import resolve_layout
from ds_ttt.train.resume_checks import DATA_ORDER_KEYS, check_reproducible, resume_cursor
from ds_ttt.train.run_config import RunConfig
from ds_ttt.train.run_record import RUN_CONFIG, RunInfo, resolved_config

TTT = TTTConfig(adaptive_layers=2)
SAVED_ORDER = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
               "data_parallel_size": 2}


def saved_info(tmp_path, *, step=6, stage_start_step=0, data_order=SAVED_ORDER):
    backbone = backbone_config("tiny")
    layout = resolve_layout(2, backbone.num_hidden_layers, TTT)
    run = RunConfig(data="x/manifest.json", output=str(tmp_path), ttt=TTT)
    res = resolved_config(run=run, backbone=backbone, ds={"pipeline": {"stages": 2}}, plan=None,
                          layout=layout, manifest_path="x/manifest.json", manifest_sha256="abc",
                          stage_start_step=stage_start_step, data_order=data_order)
    d = tmp_path / ck.tag_for(step)
    d.mkdir()
    (d / RUN_CONFIG).write_text(json.dumps({**res, "step": step}))
    (d / ck.COMPLETE).write_text("")
    return RunInfo.read(d), backbone.num_hidden_layers


def test_unchanged_layout_resumes(tmp_path):
    info, num_layers = saved_info(tmp_path)
    check_reproducible(info, dict(SAVED_ORDER), resolve_layout(2, num_layers, TTT))


@pytest.mark.parametrize("key,new,fix", [
    ("train_batch_size", 16, "set train_batch_size=8 in the DeepSpeed config"),
    ("train_micro_batch_size_per_gpu", 1, "set train_micro_batch_size_per_gpu=2 in the DeepSpeed config"),
    ("gradient_accumulation_steps", 4, "set gradient_accumulation_steps=2 in the DeepSpeed config"),
    ("data_parallel_size", 1, "launch with world size = pipeline.stages x 2"),
])
def test_changed_data_order_is_refused(tmp_path, key, new, fix):
    info, num_layers = saved_info(tmp_path)
    with pytest.raises(ValueError) as e:
        check_reproducible(info, {**SAVED_ORDER, key: new}, resolve_layout(2, num_layers, TTT))
    msg = str(e.value)
    assert "\n" not in msg
    assert f"--resume: {key} is {new} now but {SAVED_ORDER[key]} in {info.checkpoint / RUN_CONFIG}" in msg
    assert fix in msg and "--start-stage-from" in msg


def test_changed_pipeline_stages_are_refused(tmp_path):
    info, num_layers = saved_info(tmp_path)
    with pytest.raises(ValueError, match=r"--resume: pipeline\.stages is 4 now but 2 in .*set pipeline\.stages=2"):
        check_reproducible(info, dict(SAVED_ORDER), resolve_layout(4, num_layers, TTT))


def test_changed_partition_is_refused(tmp_path):
    n = backbone_config("tiny").num_hidden_layers  # 8: 6 non-adaptive layers over 3 non-last stages
    info, _ = saved_info(tmp_path)
    raw = json.loads((info.checkpoint / RUN_CONFIG).read_text())
    raw["layout"] = resolve_layout(4, n, TTT).to_dict()  # saved: 4 stages, default partition [2, 2, 2]
    (info.checkpoint / RUN_CONFIG).write_text(json.dumps(raw))
    info = RunInfo.read(info.checkpoint)
    check_reproducible(info, dict(SAVED_ORDER), resolve_layout(4, n, TTT, partition=[2, 2, 2]))
    with pytest.raises(ValueError, match=r"--resume: partition is \[3, 2, 1\] now but \[2, 2, 2\] in .*"
                                         r"set partition=\[2, 2, 2\] in the run config"):
        check_reproducible(info, dict(SAVED_ORDER), resolve_layout(4, n, TTT, partition=[3, 2, 1]))


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
