"""launch/train.py end to end on 4 CPU ranks (tiny preset, generated real-shell data):

  A  fresh run with the deepspeed launcher (README command), 4 steps, checkpoints at 2 and 4;
  B  --resume A/step_2, SIGKILLed (every rank and the launcher, by tests/e2e/fault_injection.py) in its
     re-save of step 4, the step `latest` names, after the new folder is renamed and before `latest`
     switches: `latest` still names A's complete step 4; then --resume A/step_2 again (a second resume
     from the same checkpoint): steps 3-4 give exactly A's losses (fp32), the schedule is not
     restarted, and metrics.jsonl holds every step once; all of it loaded with weights_only=True;
  C  --start-stage-from A with a new manifest: cumulative steps continue (5..), the schedule restarts
     (lr 0 at the new stage's first step), data stage 1, new RUN_DIR; held-out ids are tracked;
  D  --resume with another train_batch_size / gradient accumulation: refused in one line (exit 2).
The reassembled single-process model (load_model_from_checkpoint) matches the checkpoint.

    python -m pytest tests/e2e/test_pipeline_train.py          (five 4-rank launches, ~4 min on 2 cores)
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from ds_ttt.train.checkpoint import resolve_checkpoint
from ds_ttt.train.reassembly import load_model_from_checkpoint
from ds_ttt.train.run_record import RunInfo

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


def launch(args: list[str], cfg_dir: pathlib.Path, *, deepspeed_launcher: bool = False, kill_at: str | None = None,
           ds_file: str = "ds.json", want_rc: int = 0) -> str:
    """Run launch/train.py on 4 CPU ranks in its own session; `kill_at` (PHASE@STEP) runs it through
    tests/e2e/fault_injection.py, whose rank 0 SIGKILLs the whole launch at that phase of a save.
    Returns stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline"}
    port = str(free_port())
    if deepspeed_launcher:
        head = [str(BIN / "deepspeed"), "--num_gpus", "4", "--master_port", port]
    else:
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", port]
    script = ["tests/e2e/fault_injection.py", "--kill-at", kill_at] if kill_at else ["launch/train.py"]
    cmd = head + script + ["--deepspeed_config", str(cfg_dir / ds_file),
                           "--run_config", str(cfg_dir / "run.json")] + args
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:  # timed out: SIGTERM lets torchrun stop its workers, then nothing is left
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    want = -signal.SIGKILL if kill_at else want_rc
    assert proc.returncode == want, " ".join(cmd) + f"\nrc {proc.returncode}\n" + out[-4000:] + err[-4000:]
    return err


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
    first_latest = (a / "latest").read_text().strip()
    shutil.copytree(a / "step_00000004", tmp / "A_step4")  # B re-saves step 4
    launch(["--resume", str(a / "step_00000002")], tmp, kill_at="renamed@4")
    kept = resolve_checkpoint(a)  # what `latest` names right after the kill (compared in the tests)
    after_kill = {"latest": kept.name, "names": sorted(p.name for p in a.iterdir()),
                  "files": {p.relative_to(kept).as_posix(): p.read_bytes() for p in kept.rglob("*") if p.is_file()}}
    launch(["--resume", str(a / "step_00000002")], tmp)
    # a resume with another batch layout is refused in one line before anything is built or written
    (tmp / "ds_gas4.json").write_text(json.dumps({**DS, "train_batch_size": 4, "gradient_accumulation_steps": 4}))
    refused = launch(["--resume", str(a)], tmp, ds_file="ds_gas4.json", want_rc=1)  # torchrun: a rank exited 2
    latest_after_refusal = (a / "latest").read_text().strip()
    launch(["--start-stage-from", str(a), "--data", str(m2), "--output", str(c), "--max_steps", "3"], tmp)
    return {"tmp": tmp, "A": a, "C": c, "first": first, "resumed": metrics(a), "stage2": metrics(c),
            "after_kill": after_kill, "first_latest": first_latest, "refused": refused,
            "latest_after_refusal": latest_after_refusal}


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
    assert runs["first_latest"] == "step_00000004"
    assert (runs["A"] / "step_00000002" / "COMPLETE").is_file()
    assert not list(runs["A"].glob(".tmp-*"))


def test_kill_in_a_resave_of_the_latest_step_keeps_it(runs):
    """The killed re-save had renamed its complete folder (step_4-resave1) but not switched `latest`:
    `latest` still names A's step 4, complete and unchanged."""
    after = runs["after_kill"]
    assert after["latest"] == "step_00000004" and "step_00000004-resave1" in after["names"]
    assert not any(name.startswith(".shared-check-") for name in after["names"])
    old = runs["tmp"] / "A_step4"
    assert sorted(after["files"]) == sorted(p.relative_to(old).as_posix() for p in old.rglob("*") if p.is_file())
    for name, data in after["files"].items():
        assert data == (old / name).read_bytes(), name


def test_resume_reproduces_losses(runs):
    first, resumed = runs["first"], runs["resumed"]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # cut back to step 2 by each resume, never doubled
    for a, b in zip(first[2:], resumed[2:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)
        assert b["action_loss"] == pytest.approx(a["action_loss"], rel=1e-6, abs=1e-7)
        assert b["lr"] == a["lr"]  # warmup not restarted
    old = torch.load(runs["tmp"] / "A_step4" / "layer_07-model_states.pt", weights_only=True)
    latest = resolve_checkpoint(runs["A"])  # the second resume's re-save of step 4, the old one removed
    assert latest.name == "step_00000004-resave1" and not (runs["A"] / "step_00000004").exists()
    new = torch.load(latest / "layer_07-model_states.pt", weights_only=True)
    for k in old:
        torch.testing.assert_close(new[k], old[k], rtol=1e-6, atol=1e-7)


def test_resume_with_another_batch_layout_is_refused(runs):
    errors = [line for line in runs["refused"].splitlines() if line.startswith("launch/train.py: error:")]
    assert len(errors) == 1, runs["refused"][-3000:]
    assert "--resume: train_batch_size is 4 now but 2 in " in errors[0]
    assert "set train_batch_size=2 in the DeepSpeed config" in errors[0] and "--start-stage-from" in errors[0]
    assert runs["latest_after_refusal"] == "step_00000004-resave1"  # nothing written


def test_stage_transition(runs):
    stage2 = runs["stage2"]
    assert [r["step"] for r in stage2] == [5, 6, 7] and [r["stage_step"] for r in stage2] == [1, 2, 3]
    assert all(r["data_stage"] == 1 for r in stage2)
    assert stage2[0]["lr"] == 0.0  # the new stage's schedule starts over
    info = RunInfo.read(resolve_checkpoint(runs["C"]))
    assert info.step == 7 and info.raw["data_stage"] == 1 and info.raw["stage_start_step"] == 4
    ids = json.loads((info.checkpoint / "data_ids.json").read_text())["stages"]
    assert [s["data_stage"] for s in ids] == [0, 1]


def test_load_model_from_real_checkpoint(runs):
    model, info = load_model_from_checkpoint(runs["A"])
    assert info.step == 4 and info.model_source == {"preset": "tiny"} and info.plan["planned_steps"] == 4
    # trained prime down projections moved away from their zero init; frozen backbone unchanged by scope
    assert all(float(layer.prime_mlp.down_proj.weight.detach().abs().sum()) > 0 for layer in model.adaptive_layers)
    last = torch.load(resolve_checkpoint(runs["A"]) / "layer_07-model_states.pt", weights_only=True)
    torch.testing.assert_close(model.lm_head.weight, last["lm_head.weight"], rtol=0, atol=0)
