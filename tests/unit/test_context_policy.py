"""The context policy answers visibility itself: its answers against its own mask, no caller compares names,
and the model holds its policy once.

    python -m pytest tests/unit/test_context_policy.py -q
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from ds_ttt.model.context import ContextPolicy, PolicyKind

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
    for folder in ("ds_ttt/model", "ds_ttt/serve", "ds_ttt/train", "ds_ttt/evaluation"):
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name == "context.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "kind" and isinstance(node.value, (ast.Name, ast.Attribute)):
                    owner = node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
                    if owner == "policy":
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"callers compare the policy's name instead of asking it: {found}"


NAMES = {k.value for k in PolicyKind}


def test_no_module_compares_policy_name_strings():
    """No module of ds_ttt compares a value with a policy's name written as a string ("full", "window",
    "current_round"); the two that define the names (context.py's PolicyKind, config.py's
    CONTEXT_POLICIES, which validates the config's own field) aside. Fails on the code before:
    evaluation/comparison.py (3 places) and evaluation/runner.py."""
    found = []
    for path in sorted((ROOT / "ds_ttt").rglob("*.py")):
        if path.relative_to(ROOT).as_posix() in ("ds_ttt/model/context.py", "ds_ttt/config.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                consts = [c for side in sides for c in ([side] if not isinstance(side, (ast.Tuple, ast.List, ast.Set))
                                                         else side.elts)]
                if any(isinstance(c, ast.Constant) and c.value in NAMES for c in consts):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"policy names compared as strings: {found}"


def test_the_model_holds_its_policy_once():
    """`model.policy` is read from `model.ttt` (no second copy to patch): replacing the policy once changes
    what every reader sees, and the runner's switch restores a window exactly (fails on the code before:
    `model.policy` was an attribute beside `model.ttt`, and switching a window model to full and back lost
    its window)."""
    from ds_ttt.config import TTTConfig
    from ds_ttt.evaluation.runner import set_context_policy
    from ds_ttt.model.presets import tiny_qwen3_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, vocab_size=64)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(context_policy="window", window=5))
    assert "policy" not in vars(model) and model.policy == ContextPolicy(PolicyKind.WINDOW, 5)
    trained = model.policy
    model.set_context_policy(ContextPolicy(PolicyKind.FULL))
    assert model.policy.sees_everything and (model.ttt.context_policy, model.ttt.window) == ("full", 0)
    model.set_context_policy(trained)
    assert model.policy == trained and model.ttt.window == 5
    assert set_context_policy(model, "current_round") is PolicyKind.WINDOW
    assert model.policy.rounds_are_segments
    with pytest.raises(ValueError):
        model.set_context_policy(ContextPolicy(PolicyKind.WINDOW, 0))  # the config's own validation
    with pytest.raises(ValueError):
        ContextPolicy("everything")
