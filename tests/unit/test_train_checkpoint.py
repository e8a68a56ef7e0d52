"""Atomic checkpoints: a process SIGKILLed at any phase of a save (mid DeepSpeed write, and at each
of checkpoint.SAVE_PHASES), for a new step and for a re-save of the step `latest` names, leaves
`latest` naming a complete checkpoint; the next save cleans up. RNG files load with weights_only=True
and a missing one is an error. Plus the data loader's deterministic, resumable order and the metrics
log.

    python -m pytest tests/unit/test_train_checkpoint.py
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal

import numpy as np
import pytest
import torch

from ds_ttt.train import checkpoint as ck
from ds_ttt.train.checkpoint import resolve_checkpoint
from ds_ttt.train.data_loader import Sample, TrajectoryBatches, collate
from ds_ttt.train.rng_state import capture_rng_state, load_rng_state, restore_rng_state
from ds_ttt.train.run_record import RUN_FORMAT

class FakeEngine:
    """Writes what a DeepSpeed pipeline save writes, file by file; `die_after_files` SIGKILLs the process
    in the middle of it (after that many layer files)."""

    def __init__(self, die_after_files: int | None = None):
        self.die_after_files = die_after_files

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False
        d = pathlib.Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        for i in range(3):
            (d / f"layer_0{i}-model_states.pt").write_bytes(b"x" * 1000)
            if self.die_after_files == i + 1:
                os.kill(os.getpid(), signal.SIGKILL)
        (d / "mp_rank_00_model_states.pt").write_text(json.dumps(client_state))


def save(run_dir, step, version, *, engine=None, on_phase=None):
    return ck.save_checkpoint(engine or FakeEngine(), run_dir, step, {"step": step, "version": version},
                              {"format": RUN_FORMAT}, {"stages": []}, rank=0, barrier=lambda: None,
                              on_phase=on_phase)


def in_killed_child(fn) -> None:
    """Run fn() in a forked child that must die by SIGKILL (as a killed launch would)."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)  # reached only when no kill happened
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child was not killed: {status}"


def kill_at(phase):
    def hook(now, path):
        if now == phase:
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def assert_latest_complete(run_dir, step, version):
    """`latest` names a complete checkpoint of `step` whose files are the ones `version` wrote."""
    ckpt = resolve_checkpoint(run_dir)
    assert ckpt.name == (run_dir / "latest").read_text().strip()
    assert json.loads((ckpt / "run_config.json").read_text())["step"] == step
    assert json.loads((ckpt / "mp_rank_00_model_states.pt").read_text()) == {"step": step, "version": version}
    assert sorted(p.name for p in ckpt.glob("layer_*")) == [f"layer_0{i}-model_states.pt" for i in range(3)]
    assert (ckpt / "rng" / "rank_00000.pt").is_file()
    return ckpt


# (where the kill lands, whether the killed save's checkpoint is the one `latest` names afterwards)
KILLS = [("engine_writes", False)] + [(phase, phase == "latest") for phase in ck.SAVE_PHASES]


@pytest.mark.parametrize("resave", [False, True], ids=["new_step", "resave_latest_step"])
@pytest.mark.parametrize("where,takes_effect", KILLS, ids=[k for k, _ in KILLS])
def test_kill_at_every_save_phase_keeps_latest_complete(tmp_path, where, takes_effect, resave):
    """A new step (latest = step 2, save step 4) or a re-save of the step `latest` names (latest =
    step 4 version 1, save step 4 version 2, as a resume from step 2 does), killed at each phase."""
    save(tmp_path, 2, 1)
    if resave:
        save(tmp_path, 4, 1)
    before = (4, 1) if resave else (2, 1)
    if where == "engine_writes":
        in_killed_child(lambda: save(tmp_path, 4, 2, engine=FakeEngine(die_after_files=2)))
    else:
        in_killed_child(lambda: save(tmp_path, 4, 2, on_phase=kill_at(where)))
    assert_latest_complete(tmp_path, *((4, 2) if takes_effect else before))
    leftovers = list(tmp_path.glob(".tmp-*"))
    if leftovers:
        with pytest.raises(FileNotFoundError, match="unfinished"):
            resolve_checkpoint(leftovers[0])
    # the next complete save (a re-save of step 4 again) cleans every leftover and moves latest
    ckpt = save(tmp_path, 4, 3)
    assert assert_latest_complete(tmp_path, 4, 3) == ckpt
    assert not list(tmp_path.glob(".tmp-*"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_00000002", ckpt.name]


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.standard_normal()  # a cached gaussian is part of numpy's state
    torch.save(capture_rng_state(), tmp_path / "rank_00000.pt")
    want = (random.random(), np.random.standard_normal(), torch.rand(2))
    restore_rng_state(load_rng_state(tmp_path / "rank_00000.pt", 0))
    got = (random.random(), np.random.standard_normal(), torch.rand(2))
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])


def test_missing_rng_file_names_the_rank_and_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"rank_00003\.pt: rank 3's RNG state is missing"):
        load_rng_state(tmp_path / "rng" / "rank_00003.pt", 3)


def test_pickled_rng_file_is_refused(tmp_path):
    torch.save({"numpy": np.random.get_state()}, tmp_path / "rank_00000.pt")  # a numpy state tuple: pickled
    with pytest.raises(ValueError, match="weights_only=True"):
        load_rng_state(tmp_path / "rank_00000.pt", 0)


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


@pytest.mark.parametrize("micro,gas,dp", [(1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (4, 1, 1)])
def test_each_step_draws_the_same_trajectories_in_every_layout(micro, gas, dp):
    """The global batch alone decides a step's trajectories (a run moved to another layout continues
    on the same data); the ranks' micro-batches are a partition of it. Reference: the main job's
    layout, micro 1 x accumulation 2 x dp 2."""
    s = samples()
    for k in range(6):
        want = sorted(r.id for mb in loader().step_micro_batches(k) for r in mb)
        got = []
        for rank in range(dp):
            other = TrajectoryBatches(s, num_samples=len(s), train_batch_size=4, micro_batch_size=micro,
                                      gradient_accumulation_steps=gas, dp_rank=rank, dp_size=dp, seed=0, bucket=8,
                                      capacity=64)
            mbs = other.rank_micro_batches(k)
            assert len(mbs) == gas and all(len(mb) == micro for mb in mbs)
            got += [r.id for mb in mbs for r in mb]
        assert sorted(got) == want and len(set(got)) == 4


def test_collate_pads_right_with_kind_minus_one():
    ids, kinds, rounds = collate([([5, 6, 7], [0, 1, 2], [0, 1, 1]), ([1], [0], [0])], bucket=4, capacity=100)
    assert ids.shape == (2, 4)
    assert kinds.tolist() == [[0, 1, 2, -1], [0, -1, -1, -1]]
    assert rounds.tolist() == [[0, 1, 1, 1], [0, 0, 0, 0]]
    assert collate([([1] * 10, [0] * 10, [0] * 10)], bucket=8, capacity=12)[0].shape == (1, 12)  # capped


def test_metrics_logger_jsonl_resume_truncation_and_offline_wandb(tmp_path, monkeypatch):
    from ds_ttt.train.logging import WANDB_ID_FILE, MetricsLogger

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    rec = {"loss": 1.0, "action_loss": 1.0, "tokens_per_s": 10.0, "lr": 0.0}
    log = MetricsLogger(tmp_path, enabled=True, total=3, initial=0, resume_step=None, wandb_config={"a": 1})
    for step in (1, 2, 3):
        log.step({**rec, "step": step})
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, "wandb must run offline by default"
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert runs[0].name.endswith("-" + run_id)
    # a resume from step 1 drops the lines of steps it will redo, and continues the same W&B run
    log = MetricsLogger(tmp_path, enabled=True, total=3, initial=1, resume_step=1, wandb_config={"a": 1}, resume=True)
    assert log.wandb.id == run_id
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    # a fresh launch (or a new data stage, which has a new RUN_DIR) starts a new W&B run
    log = MetricsLogger(tmp_path, enabled=True, total=3, initial=0, resume_step=0, wandb_config={"a": 1})
    assert log.wandb.id != run_id and (tmp_path / WANDB_ID_FILE).read_text().strip() == log.wandb.id
    log.close()
    # other ranks write nothing
    MetricsLogger(tmp_path / "r1", enabled=False, total=3, initial=0, resume_step=None).step({**rec, "step": 1})
    assert not (tmp_path / "r1").exists()


def test_progress_bar_advances_every_step_whatever_the_log_interval(tmp_path):
    from ds_ttt.train.logging import MetricsLogger

    rec = {"loss": 1.0, "action_loss": 1.0, "tokens_per_s": 10.0, "lr": 0.0}
    log = MetricsLogger(tmp_path, enabled=True, total=6, initial=0, resume_step=None)
    for step in range(1, 7):
        log.step({**rec, "step": step} if step % 3 == 0 else None, loss=1.0)  # log_interval 3
    assert log.bar.n == 6
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [3, 6]


def test_metrics_cut_drops_a_line_a_kill_cut_short(tmp_path):
    from ds_ttt.train.logging import cut_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    cut_metrics(path, 3)
    assert path.read_text() == "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
    cut_metrics(path, 3)  # idempotent: a second resume from the same step cuts nothing more
    cut_metrics(path, 2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        cut_metrics(path, 2)


def test_ranks_take_micro_batches_in_serpentine_order_so_their_work_is_alike():
    """dp 2 x accumulation 2 (the main job's layout): rank 0 takes the longest and the shortest trajectory
    of each step, rank 1 the two between. Dealt d, d + dp, ... rank 0 held the longer of every pair, the
    partition with the largest gap; serpentine is the 2 + 2 partition with the smallest largest share."""
    for k in range(6):
        every = loader().step_micro_batches(k)
        lengths = [len(mb[0]) for mb in every]
        assert lengths == sorted(lengths, reverse=True)
        r0, r1 = loader(0).rank_micro_batches(k), loader(1).rank_micro_batches(k)
        assert [mb[0].id for mb in r0] == [every[0][0].id, every[3][0].id]
        assert [mb[0].id for mb in r1] == [every[1][0].id, every[2][0].id]
        shares = [sum(len(mb[0]) for mb in r) for r in (r0, r1)]
        best = min(max(lengths[a] + lengths[b], sum(lengths) - lengths[a] - lengths[b])
                   for a in range(4) for b in range(a + 1, 4))
        assert max(shares) == best
