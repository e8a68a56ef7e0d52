"""ds_ttt.data.synthetic: the one synthetic-trajectory builder reproduces, for the same seed, the
ids / kinds / rounds that the four benchmarks' own builders produced (their code, kept below as the
specification), and lays rounds out as documented.

    .venv/bin/python -m pytest tests/unit/test_synthetic.py -q
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from ds_ttt.data.synthetic import synthetic_kinds_rounds, synthetic_trajectory
from ds_ttt.data.token_kind import TokenKind


# ---- the builders the benchmarks had, verbatim but for names ----------------------------------------

TRAINER_ROUND = [0] * 8 + [1] * 40 + [2] * 80  # benchmarks/trainer.py and frozen_stage_backward.py


def old_trainer(num_tokens, vocab, seed):  # benchmarks/trainer.py: trajectory()
    g = torch.Generator().manual_seed(seed)
    num_rounds = num_tokens // len(TRAINER_ROUND)
    kinds = [0] * 16 + TRAINER_ROUND * num_rounds
    rounds = [0] * 16 + [r for r in range(1, num_rounds + 1) for _ in TRAINER_ROUND]
    kinds, rounds = kinds[:num_tokens], rounds[:num_tokens]
    return torch.randint(0, vocab, (len(kinds),), generator=g).tolist(), kinds, rounds


def old_frozen(num_samples, num_rounds=4, vocab=4096):  # benchmarks/frozen_stage_backward.py: worker()
    g = torch.Generator().manual_seed(1)
    kinds = TRAINER_ROUND * num_rounds
    rounds = [r for r in range(num_rounds) for _ in TRAINER_ROUND]
    return [(torch.randint(0, vocab, (len(kinds),), generator=g).tolist(), kinds, rounds) for _ in range(num_samples)]


def old_last_stage(num_tokens, *, prompt, action, observation, vocab, seed=0):  # gpu harness bench_last_stage.py
    one_round = ([TokenKind.CONTEXT] * 2 + [TokenKind.ACTION] * action + [TokenKind.CONTEXT] * 1
                 + [TokenKind.OBSERVATION] * observation + [TokenKind.CONTEXT] * 1)
    kinds, rounds = [TokenKind.CONTEXT] * prompt, [0] * prompt
    r = 0
    while len(kinds) < num_tokens:
        r += 1
        take = one_round[: num_tokens - len(kinds)]
        kinds += take
        rounds += [r] * len(take)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, num_tokens), generator=g)
    return ids, torch.tensor([kinds]), torch.tensor([rounds])


def old_pipeline_balance(vocab, num_tokens, *, seed=0, prompt=None, action=None, observation=None):
    prompt = max(1, num_tokens // 16) if prompt is None else prompt  # benchmarks/pipeline_balance
    action = max(1, num_tokens // 32) if action is None else action
    observation = max(1, 3 * num_tokens // 32) if observation is None else observation
    one_round = [0, 0] + [1] * action + [0] + [2] * observation + [0]
    kinds, rounds, r = [0] * prompt, [0] * prompt, 0
    while len(kinds) < num_tokens:
        r += 1
        take = one_round[: num_tokens - len(kinds)]
        kinds += take
        rounds += [r] * len(take)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, num_tokens), generator=g)
    return ids, torch.tensor([kinds]), torch.tensor([rounds])


# ---- the new builder as each caller now calls it -----------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    """A benchmark script as a module (its folder on sys.path for its sibling imports)."""
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their module by name
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


def test_the_benchmarks_themselves_build_the_old_tensors():
    trainer = _load(REPO / "benchmarks" / "trainer.py", "trainer_benchmark")
    assert trainer.trajectory(2048, 151936, 7) == old_trainer(2048, 151936, 7)
    frozen = _load(REPO / "benchmarks" / "frozen_stage_backward.py", "frozen_stage_backward_benchmark")
    assert [tuple(t) for t in frozen.trajectories()] == old_frozen(frozen.GAS, frozen.NUM_ROUNDS, frozen.VOCAB)
    bls = _load(REPO / "gpu_check" / "bench_last_stage.py", "bench_last_stage_synthetic_check")
    old = old_last_stage(4096, prompt=512, action=256, observation=768, vocab=151936, seed=3)
    new = bls.synthetic_trajectory(4096, prompt=512, action=256, observation=768, vocab=151936, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(old, new))
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from pipeline_balance.timing import synthetic_micro_batch
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    config = type("Config", (), {"vocab_size": 512})()
    mb = synthetic_micro_batch(config, 8192, device="cpu", seed=4)
    old = old_pipeline_balance(512, 8192, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(old, (mb.ids_BT, mb.kinds_BT, mb.rounds_BT)))


@pytest.mark.parametrize("num_tokens", [1024, 2048, 4096, 8192])
@pytest.mark.parametrize("seed", [0, 3])
def test_trainer_benchmark_trajectories_are_unchanged(num_tokens, seed):
    ids, kinds, rounds = synthetic_trajectory(num_tokens, vocab_size=151936, seed=seed, prompt=16, header=8,
                                              action=40, observation=80, separator=0, num_rounds=num_tokens // 128)
    assert (ids.tolist(), kinds.tolist(), rounds.tolist()) == old_trainer(num_tokens, 151936, seed)


def test_frozen_stage_backward_trajectories_are_unchanged():
    g = torch.Generator().manual_seed(1)
    new = [synthetic_trajectory(vocab_size=4096, generator=g, header=8, action=40, observation=80, separator=0,
                                num_rounds=4, first_round=0) for _ in range(4)]
    assert [tuple(t.tolist() for t in x) for x in new] == old_frozen(4)


@pytest.mark.parametrize("num_tokens, prompt, action, observation", [
    (40, 6, 4, 5), (30, 4, 3, 4), (2048, 512, 256, 768), (8192, 512, 256, 768), (16384, 512, 256, 768)])
def test_last_stage_trajectories_are_unchanged(num_tokens, prompt, action, observation):
    old = old_last_stage(num_tokens, prompt=prompt, action=action, observation=observation, vocab=151936, seed=5)
    new = synthetic_trajectory(num_tokens, vocab_size=151936, seed=5, prompt=prompt, action=action,
                               observation=observation)
    for a, b in zip(old, new):
        assert torch.equal(a, b[None])


@pytest.mark.parametrize("num_tokens, kw", [(512, {}), (8192, {}), (96, dict(prompt=8, action=8, observation=16)),
                                            (1024, dict(prompt=32, action=16, observation=48)), (100, {})])
def test_pipeline_balance_micro_batches_are_unchanged(num_tokens, kw):
    old = old_pipeline_balance(256, num_tokens, seed=2, **kw)
    prompt = kw.get("prompt", max(1, num_tokens // 16))
    action = kw.get("action", max(1, num_tokens // 32))
    observation = kw.get("observation", max(1, 3 * num_tokens // 32))
    new = synthetic_trajectory(num_tokens, vocab_size=256, seed=2, prompt=prompt, action=action,
                               observation=observation)
    for a, b in zip(old, new):
        assert torch.equal(a, b[None])


# ---- the layout itself -------------------------------------------------------------------------------

def test_layout_cut_and_numbering():
    kinds, rounds = synthetic_kinds_rounds(20, prompt=3, header=1, action=2, observation=3, separator=1)
    one = [0, 1, 1, 0, 2, 2, 2, 0]
    assert kinds == [0] * 3 + one + one + one[:1] and rounds == [0] * 3 + [1] * 8 + [2] * 8 + [3]
    kinds, rounds = synthetic_kinds_rounds(prompt=0, header=0, action=1, observation=1, separator=0, num_rounds=3,
                                           first_round=0)
    assert kinds == [1, 2] * 3 and rounds == [0, 0, 1, 1, 2, 2]
    ids, k, r = synthetic_trajectory(20, vocab_size=7, prompt=3, action=2, observation=3)
    assert ids.dtype == k.dtype == r.dtype == torch.int64 and ids.shape == (20,) and int(ids.max()) < 7


@pytest.mark.parametrize("kw, words", [
    (dict(num_tokens=6, prompt=6, action=4, observation=5), "must exceed the prompt"),
    (dict(num_tokens=10, action=0, observation=5), "must each be >= 1"),
    (dict(action=1, observation=1), "num_tokens, num_rounds"),
])
def test_refusals(kw, words):
    with pytest.raises(ValueError, match=words):
        synthetic_kinds_rounds(**kw)
