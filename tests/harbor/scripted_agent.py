"""What the Harbor tests share: the shipped task, a tiny TTT model trained to solve it (one bash call,
then an answer), and the environment of the `harbor` subprocesses. Used by tests/harbor/conftest.py
and tests/harbor/test_harbor_agent.py (run: python -m pytest tests/harbor).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
HARBOR_VENV = REPO / ".venv-harbor"
TASK_DIR = REPO / "tests" / "assets" / "harbor" / "count-lines"
SOLUTION_COMMAND = "wc -l < notes.txt > answer.txt"  # what the scripted model learns to call
FINAL_ANSWER = "answer.txt holds the line count."


def harbor_env() -> dict[str, str]:
    """Environment of the harbor subprocesses: LiteLLM (imported by Harbor) keeps to its bundled price list
    instead of fetching one, and rich prints error messages unwrapped."""
    return {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OMP_NUM_THREADS": "1", "COLUMNS": "1000"}


def scripted_conversation() -> dict:
    """The two rounds the tiny model memorizes: call bash with the task's solution, then answer."""
    from ds_ttt.data.generator import BASH_TOOL, SYSTEM_PROMPT

    call = {"id": "call_0", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": SOLUTION_COMMAND})}}
    return {"id": "scripted", "tools": [BASH_TOOL], "messages": [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": (TASK_DIR / "instruction.md").read_text()},  # what Harbor passes the agent
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "(no output)"},  # the command prints nothing
        {"role": "assistant", "content": FINAL_ANSWER}]}


def train_scripted_model(tok, *, max_steps: int = 400):
    """A tiny TTT model (full Qwen3 vocabulary) trained until greedy decoding reproduces every action
    token of `scripted_conversation` with margin (all argmax right and mean NLL < 0.05, 3 steps running)."""
    from ds_ttt.config import TTTConfig
    from ds_ttt.data.render import TokenKind, render_trajectory
    from ds_ttt.model.presets import tiny_qwen3_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    torch.manual_seed(0)
    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(context_policy="full"))
    rendered = render_trajectory(scripted_conversation(), tok)
    ids = torch.tensor([rendered.input_ids])
    want = (torch.tensor(rendered.kinds[1:]) == TokenKind.ACTION).nonzero().flatten()  # position j predicts token j + 1
    labels = ids[0, want + 1]
    model.model.embed_tokens.requires_grad_(False)  # the rest has capacity enough; saves the dense update
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    good = 0
    for _ in range(max_steps):
        h = model.run_layers(model.model.layers, model.model.embed_tokens(ids), None)
        logits = model.lm_head(model.model.norm(h[0, want])).float()
        loss = torch.nn.functional.cross_entropy(logits, labels)
        good = good + 1 if bool((logits.argmax(-1) == labels).all()) and float(loss.detach()) < 0.05 else 0
        if good == 3:
            return model.eval().requires_grad_(False)
        opt.zero_grad()
        loss.backward()
        opt.step()
    raise AssertionError(f"the scripted model did not memorize its actions in {max_steps} steps "
                         f"(loss {float(loss.detach()):.3f})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
