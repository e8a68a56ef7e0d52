"""Atomic checkpoints: a process killed (SIGKILL-like os._exit) at any point of a save never leaves a
half-written checkpoint marked latest; the next save cleans up. Plus the data loader's deterministic,
resumable order.

    python -m pytest tests/unit/test_train_checkpoint.py
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from ds_ttt.train.checkpoint import resolve_checkpoint
from ds_ttt.train.data_loader import Sample, TrajectoryBatches, collate

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os, pathlib, sys
    from ds_ttt.train import checkpoint as ck

    run_dir, kill_at = pathlib.Path(sys.argv[1]), sys.argv[2]

    class FakeEngine:  # writes what DeepSpeed writes, file by file
        def save_checkpoint(self, save_dir, tag, client_state, save_latest):
            assert save_latest is False
            d = pathlib.Path(save_dir) / tag
            d.mkdir(parents=True, exist_ok=True)
            for i in range(3):
                (d / f"layer_0{{i}}-model_states.pt").write_bytes(b"x" * 1000)
                if kill_at == "engine" and i == 1 and client_state["step"] == 4:
                    os._exit(9)
            (d / "mp_rank_00_model_states.pt").write_bytes(repr(client_state).encode())

    def hook(tmp):
        if kill_at == "before_rename":
            os._exit(9)

    resolved = {{"format": ck.RUN_FORMAT}}
    ck.save_checkpoint(FakeEngine(), run_dir, 2, {{"step": 2}}, resolved, {{"stages": []}}, rank=0, barrier=lambda: None)
    ck.save_checkpoint(FakeEngine(), run_dir, 4, {{"step": 4}}, resolved, {{"stages": []}}, rank=0,
                       barrier=lambda: None, after_engine_save=hook if kill_at != "none" else None)
""")


def run_saver(run_dir: pathlib.Path, kill_at: str) -> int:
    code = SCRIPT.format(root=str(ROOT))
    return subprocess.run([sys.executable, "-c", code, str(run_dir), kill_at], capture_output=True, timeout=120).returncode


@pytest.mark.parametrize("kill_at", ["engine", "before_rename"])
def test_kill_during_save_keeps_previous_latest(tmp_path, kill_at):
    assert run_saver(tmp_path, kill_at) == 9
    assert (tmp_path / "latest").read_text() == "step_00000002"
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_00000002"
    assert not (tmp_path / "step_00000004").exists()
    leftover = tmp_path / ".tmp-step_00000004"
    assert leftover.is_dir()
    with pytest.raises(FileNotFoundError, match="unfinished"):
        resolve_checkpoint(leftover)
    # the next (complete) save removes the leftover and moves latest
    assert run_saver(tmp_path, "none") == 0
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_00000004"
    assert not list(tmp_path.glob(".tmp-*"))
    saved = json.loads((tmp_path / "step_00000004" / "run_config.json").read_text())
    assert saved["step"] == 4 and (tmp_path / "step_00000004" / "rng" / "rank_00000.pt").is_file()


def samples(n=10):
    return [Sample(f"s{i}", list(range(5 + 3 * i)), [0] * (5 + 3 * i), [0] * (5 + 3 * i)) for i in range(n)]


def loader(dp_rank=0, dp=2, seed=0, with_samples=True):
    s = samples()
    return TrajectoryBatches(s if with_samples else None, num_samples=len(s), train_batch_size=4, micro_batch_size=1,
                             gradient_accumulation_steps=2, dp_rank=dp_rank, dp_size=dp, seed=seed, bucket=8,
                             capacity=64)


def test_data_order_is_deterministic_resumable_and_covers_each_epoch():
    a = loader()
    steps = [[[r.id for r in mb] for mb in a.step_micro_batches(k)] for k in range(6)]
    assert a.steps_per_epoch == 2
    assert steps == [[[r.id for r in mb] for mb in loader().step_micro_batches(k)] for k in range(6)]
    epoch0 = [i for st in steps[:2] for mb in st for i in mb]
    assert len(set(epoch0)) == 8  # no repeats inside an epoch (2 of 10 dropped as the incomplete batch)
    assert steps[:2] != steps[2:4]  # a new permutation each epoch
    assert steps != [[[r.id for r in mb] for mb in loader(seed=1).step_micro_batches(k)] for k in range(6)]
    # resuming the iterator at step 3 yields exactly what an uninterrupted iterator yields from step 3 on
    full = loader(dp_rank=1).iterate(0)
    items = [next(full) for _ in range(10)]
    resumed = loader(dp_rank=1).iterate(3)
    for want in items[6:]:
        got = next(resumed)
        for x, y in zip(got[0], want[0]):
            assert x.equal(y)
    # the two dp ranks split each step's micro-batches between them
    r0, r1 = loader(0).rank_micro_batches(0), loader(1).rank_micro_batches(0)
    assert sorted(r.id for mb in r0 + r1 for r in mb) == sorted(i for mb in steps[0] for i in mb)
    # ranks without data (middle stages) agree on the step count
    assert loader(with_samples=False).steps_per_epoch == 2


def test_collate_pads_right_with_kind_minus_one():
    ids, kinds, rounds = collate([([5, 6, 7], [0, 1, 2], [0, 1, 1]), ([1], [0], [0])], bucket=4, capacity=100)
    assert ids.shape == (2, 4)
    assert kinds.tolist() == [[0, 1, 2, -1], [0, -1, -1, -1]]
    assert rounds.tolist() == [[0, 1, 1, 1], [0, 0, 0, 0]]
    assert collate([([1] * 10, [0] * 10, [0] * 10)], bucket=8, capacity=12)[0].shape == (1, 12)  # capped


def test_metrics_logger_jsonl_resume_truncation_and_offline_wandb(tmp_path, monkeypatch):
    from ds_ttt.train.logging import MetricsLogger

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    rec = {"loss": 1.0, "action_loss": 1.0, "tokens_per_s": 10.0, "lr": 0.0}
    log = MetricsLogger(tmp_path, enabled=True, total=3, initial=0, resume_step=None, wandb_config={"a": 1})
    for step in (1, 2, 3):
        log.log({**rec, "step": step})
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb must run offline by default"
    # a resume from step 1 drops the lines of steps it will redo
    MetricsLogger(tmp_path, enabled=True, total=3, initial=1, resume_step=1).close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    # other ranks write nothing
    MetricsLogger(tmp_path / "r1", enabled=False, total=3, initial=0, resume_step=None).log({**rec, "step": 1})
    assert not (tmp_path / "r1").exists()
