"""benchmarks/main_job_repro.py: two work directories that differ only in where and how fast they ran are
the same run; a changed weight, metric or trajectory is found and named.

    .venv/bin/python -m pytest tests/unit/test_main_job_repro.py -q
"""
import hashlib
import importlib.util
import json
import pathlib

import torch

from ds_ttt.loading import checkpoint_sha256

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "main_job_repro.py"


def load_script():
    spec = importlib.util.spec_from_file_location("main_job_repro", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(root: pathlib.Path, *, step_time: float, weight: float = 1.0, nll: float = 0.25,
             trajectory: str = "ls\n") -> pathlib.Path:
    """A miniature main-job tree: its files name their own directory, as the real ones do."""
    (root / "data").mkdir(parents=True)
    (root / "raw").mkdir()
    (root / "raw" / "trajectories.jsonl").write_text(json.dumps({"action": trajectory}) + "\n")
    (root / "data" / "manifest.json").write_text(json.dumps({"inputs": [f"{root}/raw/trajectories.jsonl"]}))
    step = root / "run" / "step_00000001"
    step.mkdir(parents=True)
    torch.save({"weight": torch.full((3,), weight)}, step / "layer_00-model_states.pt")
    torch.save({"module": {"w": torch.full((2,), weight)}, "data": f"{root}/data/manifest.json"},
               step / "mp_rank_00_model_states.pt")
    (step / "run_config.json").write_text(json.dumps({"output": f"{root}/run"}))
    (root / "run" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "loss": 1.0 / i, "step_time_s": step_time, "tokens_per_s": 100 / step_time}) + "\n"
        for i in range(1, 13)))
    manifest_sha = hashlib.sha256((root / "data" / "manifest.json").read_bytes()).hexdigest()
    (root / "heldout_row.json").write_text(json.dumps({
        "action_nll": nll, "created": str(step_time),
        "provenance": {"checkpoint": f"{root}/run", "sha256": checkpoint_sha256(step), "manifest": manifest_sha[:16]}}))
    (root / "report.md").write_text(f"took {step_time} s\n")
    return root


def test_same_run_elsewhere_and_slower_is_identical(tmp_path):
    script = load_script()
    a = fake_run(tmp_path / "runs" / "before", step_time=1.0)
    b = fake_run(tmp_path / "other" / "runs" / "after", step_time=1.5)
    result = script.compare(a, b, "before", "after")
    assert result["identical"], result
    assert result["files_skipped_reports"] == 1
    assert result["files_identical"] == 7
    assert (result["a"]["median_step_seconds"], result["b"]["median_step_seconds"]) == (1.0, 1.5)
    assert "after 1.500 s" in script.render(result)


def test_a_changed_weight_metric_or_trajectory_is_named(tmp_path):
    script = load_script()
    a = fake_run(tmp_path / "a", step_time=1.0)
    cases = {"weight": dict(weight=1.0 + 2 ** -20), "nll": dict(nll=0.2500001), "trajectory": dict(trajectory="ls -l\n")}
    found = {}
    for name, change in cases.items():
        found[name] = script.compare(a, fake_run(tmp_path / name, step_time=1.0, **change))
    assert not any(r["identical"] for r in found.values())
    # the checkpoint hash in heldout_row.json is a placeholder on both sides: the weights behind it are
    # compared as files, and those are what is named
    assert found["weight"]["files_different"] == [
        "run/step_00000001/layer_00-model_states.pt", "run/step_00000001/mp_rank_00_model_states.pt"]
    assert found["nll"]["files_different"] == ["heldout_row.json"]
    assert found["trajectory"]["files_different"] == ["raw/trajectories.jsonl"]


def test_a_file_missing_from_one_run_is_a_difference(tmp_path):
    script = load_script()
    a = fake_run(tmp_path / "a", step_time=1.0)
    b = fake_run(tmp_path / "b", step_time=1.0)
    (b / "raw" / "extra.jsonl").write_text("{}\n")
    result = script.compare(a, b)
    assert not result["identical"] and result["files_in_one_run_only"] == ["raw/extra.jsonl"]


def test_task_data_is_compared_as_bytes_and_progress_logs_are_skipped(tmp_path):
    """A task of the suite may ship a file that only looks like JSON (a recovery task's broken config.json):
    the tasks/ folder is compared byte for byte, never parsed; a step's .log (progress bars with times) is
    skipped like a report (failed on the code before: the broken config.json raised JSONDecodeError and the
    two task_suite.log files were named different)."""
    script = load_script()
    runs = []
    for name, when in (("a", "1.0s/task"), ("b", "2.5s/task")):
        root = fake_run(tmp_path / name, step_time=1.0)
        env = root / "tasks" / "test-recovery_missing_file-000" / "environment"
        env.mkdir(parents=True)
        (env / "config.json").write_text("name: harbor\nthreads: 4\n")
        (root / "task_suite.log").write_text(f"tasks: 100% 17/17 [{when}]\n")
        runs.append(root)
    result = script.compare(*runs)
    assert result["identical"] and result["files_skipped_reports"] == 2, result
    (runs[1] / "tasks" / "test-recovery_missing_file-000" / "environment" / "config.json").write_text("name: x\n")
    assert script.compare(*runs)["files_different"] == ["tasks/test-recovery_missing_file-000/environment/config.json"]


def test_checkpoint_states_are_compared_by_value_and_their_differences_named(tmp_path):
    """Optimizer states are loaded and compared like model states: equal tensors and an object without `==`
    (DeepSpeed's loss scaler) with equal attributes are the same, and a changed recorded setting is named by
    its path (failed on the code before: optimizer state files were compared as bytes, and nothing said where
    a state file differed)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    script = load_script()
    runs = []
    for name, interval in (("a", 1), ("b", 1), ("c", 0)):
        root = fake_run(tmp_path / name, step_time=1.0)
        torch.save({"optimizer_state_dict": {"loss_scaler": LossScaler(1.0), "exp_avg": torch.ones(3)},
                    "ds_config": {"pipeline": {"activation_checkpoint_interval": interval}}},
                   root / "run" / "step_00000001" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        runs.append(root)
    assert script.compare(runs[0], runs[1])["identical"]
    result = script.compare(runs[0], runs[2])
    optim = "run/step_00000001/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert result["files_different"] == [optim]
    assert result["where"] == {optim: [".ds_config.pipeline.activation_checkpoint_interval: 1 != 0"]}
    assert "activation_checkpoint_interval: 1 != 0" in script.render(result)
