"""Run-config and DeepSpeed-JSON validation (every error names the key and the fix), the shipped
ds_configs, the schedule plan vs DeepSpeed's WarmupCosineLR, and the stage-overlap check.

    python -m pytest tests/unit/test_train_config.py
"""

from __future__ import annotations

import copy
import json
import re
import pathlib

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.presets import backbone_config
from ds_ttt.train.deepspeed_config import validate_deepspeed
from ds_ttt.train.layout import resolve_layout
from ds_ttt.train.run_config import RunConfig, load_run_config, parse_ttt_overrides
from ds_ttt.train.schedule import expected_lr, make_plan, resolved_deepspeed

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "ds_configs").glob("*.json"))
DS_CONFIGS = [p for p in CONFIGS if not p.name.startswith("run_")]
RUN_CONFIGS = [p for p in CONFIGS if p.name.startswith("run_")]


def base_ds():
    return json.loads((ROOT / "ds_configs" / "cpu_tiny.json").read_text())


def run_cfg(**kw):
    ttt = kw.pop("ttt", {"adaptive_layers": 2})
    return RunConfig(data="d/manifest.json", output="out", ttt=TTTConfig(**ttt), **kw).validate()


def test_shipped_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"cpu_tiny.json", "run_cpu_tiny.json", "qwen3_8b_pp4.json", "qwen3_8b_pp1_dp4.json", "qwen3_8b_pp2_dp2.json",
            "run_qwen3_8b.json"} <= names  # the three layouts docs/training.md's "Which layout" names


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_shipped_deepspeed_configs_validate(path):
    ds = json.loads(path.read_text())
    if path.name.startswith("qwen3_8b"):
        run = load_run_config(str(ROOT / "ds_configs/run_qwen3_8b.json"), {"data": "d", "output": "o"}, {})
        # the file name states the layout: qwen3_8b_pp{stages}[_dp{data parallel}].json
        stages, dp = (int(x) for x in re.fullmatch(r"qwen3_8b_pp(\d+)(?:_dp(\d+))?\.json", path.name).groups("1"))
        assert ds["bf16"]["enabled"] and ds["zero_optimization"]["stage"] == 1 and ds["pipeline"]["stages"] == stages
        # the presets describe Qwen3-8B; its config comes from the checkpoint dir on GPU machines
        layers, world = backbone_config("qwen3-8b").num_hidden_layers, stages * dp
        layout = validate_deepspeed(run, ds, world, layers)
        assert layout.num_adaptive == 9 and layout.first_adaptive == 27
        assert layout.prefix_per_stage == {1: (), 2: (27,), 4: (9, 9, 9)}[stages]  # one stage: everything on it
    else:
        run = load_run_config(str(ROOT / "ds_configs/run_cpu_tiny.json"), {"data": "d", "output": "o"}, {})
        # cpu_tiny.json: 4 stages on 4 CPU ranks; cpu_tiny_pp{stages}[_dp{dp}].json otherwise
        m = re.fullmatch(r"cpu_tiny(?:_pp(\d+))?(?:_dp(\d+))?\.json", path.name)
        stages, dp = int(m.group(1) or 4), int(m.group(2) or 1)
        layout = validate_deepspeed(run, ds, stages * dp, backbone_config(run.preset).num_hidden_layers)
        assert layout.num_stages == stages and ds.get("bf16", {}).get("enabled", False) is False
    plan = make_plan(run, num_train=1000, retained_rounds=5000, train_batch_size=ds["train_batch_size"])
    sched = resolved_deepspeed(ds, plan)["scheduler"]["params"]
    assert sched["total_num_steps"] == plan.planned_steps and sched["warmup_num_steps"] == plan.warmup_steps


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_shipped_run_configs_load(path):
    run = load_run_config(str(path), {"data": "d", "output": "o"}, {})
    assert run.to_dict()["ttt"] == run.ttt.to_dict()


def mutate(fn):
    ds = base_ds()
    fn(ds)
    return ds


# (mutation of cpu_tiny.json, world size, words the error must contain)
DS_ERRORS = [
    (lambda d: d.update(train_batch_size=6), 4, ["train_batch_size=6", "gradient_accumulation_steps=4"]),
    (lambda d: d.pop("gradient_accumulation_steps") and d.update(train_batch_size=3), 8, ["not divisible", "multiple of 2"]),
    (lambda d: d.pop("train_micro_batch_size_per_gpu"), 4, ["train_micro_batch_size_per_gpu"]),
    (lambda d: d.pop("pipeline"), 4, ['"pipeline"', "stages"]),
    (lambda d: d["pipeline"].update(stages="auto"), 4, ["stages"]),
    (lambda d: d["pipeline"].update(partition="best"), 4, ["unknown key", "partition"]),
    (lambda d: d["pipeline"].update(stages=3), 4, ["pipeline.stages=3", "divide the world size 4"]),
    (lambda d: d["pipeline"].update(use_reentrant=True), 4, ["use_reentrant=false"]),
    (lambda d: d["zero_optimization"].update(stage=2), 4, ["zero_optimization.stage=2", "set zero_optimization.stage to 1"]),
    (lambda d: d["zero_optimization"].update(stage=3), 4, ["zero_optimization.stage=3"]),
    (lambda d: d.update(fp16={"enabled": True}), 4, ["fp16", "bf16"]),
    (lambda d: d["zero_optimization"].update(stage=0), 4, ["gradient_clipping", "stage 0's gradients", "stage=1"]),
    (lambda d: d.pop("gradient_clipping") and d["zero_optimization"].update(stage=0), 4, ["gradient_clipping=1.0"]),
    (lambda d: d["optimizer"].update(type="Adam"), 4, ["optimizer.type", "AdamW"]),
    (lambda d: d.pop("scheduler"), 4, ["scheduler.type", "WarmupCosineLR"]),
    (lambda d: d["scheduler"].update(type="WarmupLR"), 4, ["scheduler.type='WarmupLR'"]),
    (lambda d: d["scheduler"]["params"].update(warmup_min_ratio=0.1), 4, ["warmup_min_ratio=0"]),
    (lambda d: d["scheduler"]["params"].update(total_num_steps=100), 4, ["total_num_steps", "plan"]),
    (lambda d: d["scheduler"]["params"].update(warmup_num_steps=10), 4, ["warmup_num_steps", "plan"]),
    (lambda d: d["scheduler"]["params"].update(cos_min_ratio=0.2), 4, ["cos_min_ratio", "min_lr_ratio"]),
]


@pytest.mark.parametrize("mutation,world,words", DS_ERRORS)
def test_deepspeed_config_errors(mutation, world, words):
    with pytest.raises(ValueError) as e:
        validate_deepspeed(run_cfg(), mutate(mutation), world, 8)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_clipping_without_zero_is_fine_when_disabled_or_bf16():
    validate_deepspeed(run_cfg(), mutate(lambda d: d.update(gradient_clipping=0.0) or d["zero_optimization"].update(stage=0)), 4, 8)
    validate_deepspeed(run_cfg(), mutate(lambda d: d.update(bf16={"enabled": True}) or d["zero_optimization"].update(stage=0)), 4, 8)


def test_model_and_layout_errors():
    with pytest.raises(ValueError, match=r"pipeline.stages=4 needs at least 3 non-adaptive .* lower pipeline.stages or ttt.adaptive_layers"):
        validate_deepspeed(run_cfg(ttt={"adaptive_layers": 6}), base_ds(), 4, 8)
    with pytest.raises(ValueError, match="exceeds the model's num_hidden_layers"):
        validate_deepspeed(run_cfg(ttt={"adaptive_layers": 9}), base_ds(), 4, 8)
    with pytest.raises(ValueError, match=r"partition \[2, 2, 3\] sums to 7 .* put adaptive layers on a non-last stage"):
        validate_deepspeed(run_cfg(partition=[2, 2, 3]), base_ds(), 4, 8)
    with pytest.raises(ValueError, match="leave non-adaptive layers on the last stage"):
        validate_deepspeed(run_cfg(partition=[1, 2, 2]), base_ds(), 4, 8)
    with pytest.raises(ValueError, match="partition has 2 entries"):
        validate_deepspeed(run_cfg(partition=[3, 3]), base_ds(), 4, 8)
    assert validate_deepspeed(run_cfg(partition=[1, 2, 3]), base_ds(), 4, 8).spec_parts() == [0, 2, 4, 7, 8]
    with pytest.raises(ValueError, match="trains nothing"):
        validate_deepspeed(run_cfg(ttt={"adaptive_layers": 0, "trainable_scope": "prime"}), base_ds(), 4, 8)
    # SFT baseline: no adaptive layers, the last stage holds norm + head only
    lay = validate_deepspeed(run_cfg(ttt={"adaptive_layers": 0, "trainable_scope": "all"}), base_ds(), 4, 8)
    assert lay.num_adaptive == 0 and lay.spec_parts()[-1] == 10


def test_dtype_vs_attention_backend():
    bf16 = mutate(lambda d: d.update(bf16={"enabled": True}))
    with pytest.raises(ValueError, match="attention_backend='cpu'.*float32/float64"):
        validate_deepspeed(run_cfg(ttt={"adaptive_layers": 2, "attention_backend": "cpu"}), bf16, 4, 8)
    with pytest.raises(ValueError, match="attention_backend='cuda' needs bf16"):
        validate_deepspeed(run_cfg(ttt={"adaptive_layers": 2, "attention_backend": "cuda"}), base_ds(), 4, 8)
    validate_deepspeed(run_cfg(ttt={"adaptive_layers": 2, "attention_backend": "cuda"}), bf16, 4, 8)


def test_run_config_errors(tmp_path):
    with pytest.raises(ValueError, match="exactly one of `preset`"):
        run_cfg(preset=None)
    with pytest.raises(ValueError, match="exactly one of `preset`"):
        run_cfg(model="/m")
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        run_cfg(max_steps=0)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        run_cfg(min_lr_ratio=2.0)
    with pytest.raises(ValueError, match="ttt.context_policy"):
        run_cfg(ttt={"context_policy": "everything"})
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"preset": "tiny", "learning_rate": 1}))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['learning_rate'\]"):
        load_run_config(str(f), {"data": "d", "output": "o"}, {})
    f.write_text(json.dumps({"ttt": {"inner_lrr": 1}}))
    with pytest.raises(ValueError, match="inner_lrr"):
        load_run_config(str(f), {"data": "d", "output": "o"}, {})
    with pytest.raises(ValueError, match="`data` is required"):
        load_run_config(None, {"output": "o"}, {})
    with pytest.raises(ValueError, match="key=value"):
        parse_ttt_overrides(["inner_lr"])
    run = load_run_config(None, {"data": "d", "output": "o", "model": "/m"},
                          parse_ttt_overrides(["adaptive_layers=0", "trainable_scope=all", "inner_lr=0.5"]))
    assert run.model == "/m" and run.preset is None and run.ttt.adaptive_layers == 0 and run.ttt.inner_lr == 0.5


def test_plan_errors_and_values():
    run = run_cfg(epochs=3)
    plan = make_plan(run, num_train=40, retained_rounds=120, train_batch_size=4)
    assert (plan.steps_per_epoch, plan.planned_steps, plan.warmup_steps) == (10, 30, 3)
    assert make_plan(run_cfg(max_steps=200), 40, 120, 4).planned_steps == 200
    with pytest.raises(ValueError, match="fewer than train_batch_size=4"):
        make_plan(run, num_train=3, retained_rounds=3, train_batch_size=4)
    with pytest.raises(ValueError, match="at least 3"):
        make_plan(run_cfg(max_steps=2), 40, 120, 4)


@pytest.mark.parametrize("planned", [3, 10, 57])
def test_deepspeed_scheduler_follows_the_plan(planned):
    """DeepSpeed's WarmupCosineLR, configured from the plan and started like the engine does, runs
    step 1 at 0, step W+1 at the peak and the last planned step at the floor (schedule.expected_lr)."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    plan = make_plan(run_cfg(max_steps=planned, min_lr_ratio=0.1), 100, 100, 1)
    params = resolved_deepspeed(base_ds(), plan)["scheduler"]["params"]
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2.0)
    sched = WarmupCosineLR(opt, **params)
    sched.step()  # schedule.start_schedule
    got = []
    for _ in range(planned):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [expected_lr(plan, 2.0, s) for s in range(1, planned + 1)]
    assert got == pytest.approx(want, abs=1e-9)
    assert got[0] == 0.0 and got[-1] == pytest.approx(0.2)
    if planned >= 10:  # long enough for the cosine to start near the peak
        assert max(got) == pytest.approx(2.0, rel=0.05) and got.index(max(got)) == plan.warmup_steps


def test_stage_overlap_is_rejected():
    from ds_ttt.train.resume_checks import check_no_overlap

    class M:
        def __init__(self, train, test):
            self._ids = {"train": set(train), "test": set(test)}

        def ids(self, split):
            return self._ids[split]

    history = [{"data_stage": 0, "manifest": "old/manifest.json", "train": ["a", "b"], "test": ["t1"]}]
    check_no_overlap(history, M(["c"], ["t2"]), "new")
    check_no_overlap(history, M(["a", "c"], ["t1"]), "new")  # re-using old train / old test ids is fine
    with pytest.raises(ValueError, match=r"1 train trajectories .*'t1'.* test split of data stage 0"):
        check_no_overlap(history, M(["c", "t1"], ["t2"]), "new")
    with pytest.raises(ValueError, match=r"1 test trajectories .*'b'.* train split"):
        check_no_overlap(history, M(["c"], ["b"]), "new")


def test_layout_copy_is_deterministic():
    a = resolve_layout(4, 36, TTTConfig())
    assert a == copy.deepcopy(a)


def test_launch_reports_config_errors_in_one_line(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_train", ROOT / "launch" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--deepspeed_config", str(ROOT / "ds_configs/cpu_tiny.json"), "--data", "d", "--output", "o",
                   "--ttt", "trainable_scope=everything"])
    assert rc == 2
    assert "ttt.trainable_scope must be one of" in capsys.readouterr().err
