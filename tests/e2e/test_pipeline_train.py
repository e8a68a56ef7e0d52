"""launch/train.py end to end on 4 CPU ranks (tiny preset, generated real-shell data):

  A  fresh run with the deepspeed launcher (README command), 4 steps, checkpoints at 2 and 4;
  B  --resume A/step_2: steps 3-4 give exactly A's losses (fp32), the schedule is not restarted;
  C  --start-stage-from A with a new manifest: cumulative steps continue (5..), the schedule restarts
     (lr 0 at the new stage's first step), data stage 1, new RUN_DIR; held-out ids are tracked.
The reassembled single-process model (load_model_from_checkpoint) matches the checkpoint.

    python -m pytest tests/e2e/test_pipeline_train.py          (three 4-rank launches, ~2 min on 2 cores)
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
pytestmark = pytest.mark.slow

DS = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
      "pipeline": {"stages": 4, "activation_checkpoint_interval": 1, "use_reentrant": False},
      "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
      "scheduler": {"type": "WarmupCosineLR", "params": {}}, "steps_per_print": 10**6}
RUN = {"preset": "tiny", "seed": 0, "save_interval": 2, "min_lr_ratio": 0.1,
       "ttt": {"adaptive_layers": 2, "trainable_scope": "prime"}}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(out: pathlib.Path, seed: int) -> pathlib.Path:
    from ds_ttt.data.generator import generate, write_outputs
    from ds_ttt.data.manifest import prepare

    write_outputs(generate(12, seed, workers=1), out / "raw")
    res = prepare([out / "raw" / "trajectories.jsonl"], out / "data", capacity=384, test_fraction=0.2, seed=seed)
    assert res.exit_code == 0, res.message
    return out / "data" / "manifest.json"


def launch(args: list[str], cfg_dir: pathlib.Path, *, deepspeed_launcher: bool = False) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline"}
    port = str(free_port())
    if deepspeed_launcher:
        head = [str(BIN / "deepspeed"), "--num_gpus", "4", "--master_port", port]
    else:
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", port]
    cmd = head + ["launch/train.py", "--deepspeed_config", str(cfg_dir / "ds.json"),
                  "--run_config", str(cfg_dir / "run.json")] + args
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, " ".join(cmd) + "\n" + proc.stdout[-4000:] + proc.stderr[-4000:]


def metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    (tmp / "ds.json").write_text(json.dumps(DS))
    (tmp / "run.json").write_text(json.dumps(RUN))
    m1, m2 = make_data(tmp / "d1", seed=1), make_data(tmp / "d2", seed=2)
    a, c = tmp / "A", tmp / "C"
    launch(["--data", str(m1), "--output", str(a), "--max_steps", "4"], tmp, deepspeed_launcher=True)
    first = metrics(a)
    shutil.copytree(a / "step_00000004", tmp / "A_step4")  # B re-saves step 4 in place
    launch(["--resume", str(a / "step_00000002")], tmp)
    launch(["--start-stage-from", str(a), "--data", str(m2), "--output", str(c), "--max_steps", "3"], tmp)
    return {"tmp": tmp, "A": a, "C": c, "first": first, "resumed": metrics(a), "stage2": metrics(c)}


def test_fresh_run_logs_and_schedule(runs):
    first = runs["first"]
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    for r in first:
        for key in ("loss", "action_loss", "obs_loss", "inner_updates", "inner_skipped", "tokens_per_s",
                    "peak_mem_gb", "lr", "inner_lr"):
            assert key in r, key
        assert r["inner_updates"] > 0 and r["tokens_per_s"] > 0 and r["peak_mem_gb"] > 0
        # the step loss is the token-weighted objective: without an observation term it is the action
        # loss over the global batch (a mean of micro-batch means is not)
        assert r["loss"] == pytest.approx(r["action_loss"], rel=1e-6)
    peak = DS["optimizer"]["params"]["lr"]
    assert first[0]["lr"] == 0.0  # warmup from 0
    assert first[-1]["lr"] == pytest.approx(peak * RUN["min_lr_ratio"])  # the floor on the last planned step
    assert (runs["A"] / "latest").read_text().strip() == "step_00000004"
    assert (runs["A"] / "step_00000002" / "COMPLETE").is_file()
    assert not list(runs["A"].glob(".tmp-*"))


def test_resume_reproduces_losses(runs):
    first, resumed = runs["first"], runs["resumed"]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(first[2:], resumed[2:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)
        assert b["action_loss"] == pytest.approx(a["action_loss"], rel=1e-6, abs=1e-7)
        assert b["lr"] == a["lr"]  # warmup not restarted
    old = torch.load(runs["tmp"] / "A_step4" / "layer_07-model_states.pt", weights_only=True)
    new = torch.load(runs["A"] / "step_00000004" / "layer_07-model_states.pt", weights_only=True)
    for k in old:
        torch.testing.assert_close(new[k], old[k], rtol=1e-6, atol=1e-7)


def test_stage_transition(runs):
    stage2 = runs["stage2"]
    assert [r["step"] for r in stage2] == [5, 6, 7] and [r["stage_step"] for r in stage2] == [1, 2, 3]
    assert all(r["data_stage"] == 1 for r in stage2)
    assert stage2[0]["lr"] == 0.0  # the new stage's schedule starts over
    from ds_ttt.train.checkpoint import RunInfo, resolve_checkpoint
    info = RunInfo.read(resolve_checkpoint(runs["C"]))
    assert info.step == 7 and info.raw["data_stage"] == 1 and info.raw["stage_start_step"] == 4
    ids = json.loads((info.checkpoint / "data_ids.json").read_text())["stages"]
    assert [s["data_stage"] for s in ids] == [0, 1]


def test_load_model_from_real_checkpoint(runs):
    from ds_ttt.train.checkpoint import load_model_from_checkpoint

    model, info = load_model_from_checkpoint(runs["A"])
    assert info.step == 4 and info.model_source == {"preset": "tiny"} and info.plan["planned_steps"] == 4
    # trained prime down projections moved away from their zero init; frozen backbone unchanged by scope
    assert all(float(layer.prime_mlp.down_proj.weight.detach().abs().sum()) > 0 for layer in model.adaptive_layers)
    last = torch.load(runs["A"] / "step_00000004" / "layer_07-model_states.pt", weights_only=True)
    torch.testing.assert_close(model.lm_head.weight, last["lm_head.weight"], rtol=0, atol=0)
