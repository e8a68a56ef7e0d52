"""The context policy answers visibility itself: its answers against its own mask, and no caller compares names.

    python -m pytest tests/unit/test_context_policy.py -q
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from ds_ttt.model.context import ContextPolicy

ROOT = pathlib.Path(__file__).resolve().parents[2]
POLICIES = [ContextPolicy("full"), ContextPolicy("window", 3), ContextPolicy("current_round")]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.kind)
def test_visible_from_matches_the_mask(policy):
    """Under full and window (slot = position in a serving cache), the first visible slot of every query is
    the first True of its row of the whole-sequence mask."""
    if policy.rounds_are_segments:  # slots are not positions: checked by the round tests below
        return
    t = 9
    mask = policy.mask(torch.zeros(1, t, dtype=torch.long))
    rows = torch.tril(torch.ones(t, t, dtype=torch.bool)) if mask is None else mask[0, 0]
    for slot in range(t):
        assert policy.visible_from(slot) == int(rows[slot].nonzero()[0])


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.kind)
def test_window_and_kernel_questions(policy):
    assert policy.attention_window == (3 if policy.kind == "window" else 0)
    assert policy.is_positional == (policy.mask(torch.tensor([[0, 1, 1, 2]])) is None
                                    or bool((policy.mask(torch.tensor([[0, 1, 1, 2]]))
                                             == policy.mask(torch.tensor([[0, 0, 0, 0]]))).all()))
    assert policy.needs_rounds == (not policy.is_positional)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.kind)
def test_rounds_and_segments(policy):
    """A round's tokens see an earlier round exactly when the policy does not make rounds segments, and
    then a new round takes its own positions as slots; otherwise it reuses the slots after round 0."""
    rounds = torch.tensor([[0, 0, 1, 1, 2, 2]])
    mask = policy.mask(rounds)
    sees_earlier_round = True if mask is None else bool(mask[0, 0, 4, 2])
    assert policy.rounds_are_segments == (not sees_earlier_round and policy.kind != "window")
    assert policy.new_round_slot(40, prompt_slots=7) == (7 if policy.rounds_are_segments else 40)
    assert policy.segment_starts_at(0, None) and policy.segment_starts_at(0, 7)
    assert policy.segment_starts_at(7, 7) == policy.rounds_are_segments
    assert not policy.segment_starts_at(7, None)
    assert not policy.segment_starts_at(8, 7)


def test_no_caller_compares_policy_names():
    """Outside context.py, nothing in the model, serving or training reads `policy.kind`: each asks the
    policy (fails on the code before ContextPolicy answered visibility: 4 places in session.py, 1 in
    batch.py, 3 in qwen3.py, 1 in event_loop.py)."""
    found = []
    for folder in ("ds_ttt/model", "ds_ttt/serve", "ds_ttt/train"):
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name == "context.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "kind" and isinstance(node.value, (ast.Name, ast.Attribute)):
                    owner = node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
                    if owner == "policy":
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"callers compare the policy's name instead of asking it: {found}"
