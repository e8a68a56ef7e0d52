"""Serving's one model step: every serving path runs the model through `TTTQwen3ForCausalLM.step`, and round 0 is rendered once.

    .venv/bin/python -m pytest -q tests/unit/test_serve_model_step.py

* Every forward of a session (round 0's system block and rest, a reply's generation prompt, decode
  steps and turn end, a forced turn, an observation's inner step), of the batched decode (several rows
  in the pool, and one row alone) and of the batched prefill embeds its tokens inside `model.step`: a
  path that ran the layers itself would embed outside it (each one did before the step existed).
* Round 0's two parts (system block, rest) are rendered once each, and together they are exactly
  `render_trajectory` of the round-0 messages (the session rendered the system message twice before).
"""

from __future__ import annotations

import pytest
import torch

from ds_ttt.data.render import render_trajectory
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
from ds_ttt.serve import AgentModel, AgentSession
from ds_ttt.serve.batch import batched_decode_logits
from ds_ttt.serve.kv_pool import KVPool
from ds_ttt.serve.pooled_chunk import PooledChunk
from ds_ttt.serve.prefill import batched_prefill
from ds_ttt.serve.round0 import render_round0
from ds_ttt.serve.session_chunk import SessionChunk
from tests.unit.test_serve import make_model, tok  # noqa: F401 - the tokenizer fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

SYSTEM = "You are a careful terminal agent."
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]


def test_every_serving_path_runs_through_model_step(tok, monkeypatch):
    model = make_model(context_policy="current_round", key_shift=2)
    with torch.no_grad():  # a key state that matters, so key_prev / commit_keys are exercised
        for layer in model.adaptive_layers:
            layer.prime_mlp.key_shift.normal_(0, 0.3)
    agent = AgentModel(model, tok)
    inside, caches, outside = [], [], []
    step = TTTQwen3ForCausalLM.step

    def counted_step(self, ids, positions, cache, **kw):
        inside.append(True)
        caches.append(type(cache))
        try:
            return step(self, ids, positions, cache, **kw)
        finally:
            inside.pop()

    monkeypatch.setattr(TTTQwen3ForCausalLM, "step", counted_step)
    embedded = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, args, out: (embedded if inside else outside).append(tuple(out.shape)))
    try:
        s = AgentSession(agent, max_new_tokens=6)
        s.reset_messages([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}],
                         tools=TOOLS)  # system block and rest
        s.act()  # generation prompt, decode steps, turn end
        s.observe(["a.txt b.txt"])  # the round in one chunk, with the inner step
        s.act(force={"role": "assistant", "content": "done"})  # a forced turn
        assert set(caches) == {SessionChunk}
        rows = [s.fork(), s.fork()]
        s.observe(["ok"])
        rows.append(s)
        decodes = [r.begin_decode(max_new_tokens=3) for r in rows]
        with torch.inference_mode():
            logits = [d.first_logits() for d in decodes]
            for d, x in zip(decodes, logits):
                d.step(x)
            logits = batched_decode_logits(agent, decodes)  # three rows through the pool
            decodes[0].step(logits[0])
            batched_decode_logits(agent, decodes[:1])  # one row alone
            for d in decodes:
                d.state.cache.leave_pool()
        news = [AgentSession(agent, max_new_tokens=4) for _ in range(2)]
        r0s = [n.begin_reset([{"role": "user", "content": t}]) for n, t in zip(news, ("Say hi.", "Say ho."))]
        batched_prefill(agent, r0s, KVPool.for_model(model))
        for n, r0 in zip(news, r0s):
            n.end_reset(r0)
    finally:
        hook.remove()
    assert PooledChunk in caches and SessionChunk in caches
    assert embedded and not outside, f"{len(outside)} forwards embedded their tokens outside model.step"


@pytest.mark.parametrize("messages,tools", [
    ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}], TOOLS),
    ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}], None),
    ([{"role": "user", "content": "List the files."}], TOOLS),
    ([{"role": "user", "content": "List the files."}], None),
    ([{"role": "system", "content": SYSTEM}, {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Hi."}], TOOLS),
    ([{"role": "system", "content": SYSTEM}], TOOLS),
], ids=["system+tools", "system", "tools", "task only", "two systems", "system alone"])
def test_round0_is_rendered_once_and_equals_the_whole_render(tok, messages, tools, monkeypatch):
    import ds_ttt.serve.round0 as round0

    rendered = []
    monkeypatch.setattr(round0, "render_trajectory", lambda traj, t: rendered.append(traj) or render_trajectory(traj, t))
    r = render_round0(messages, tools, tok)
    seen = [id(m) for traj in rendered for m in traj["messages"]]
    assert sorted(seen) == sorted(id(m) for m in messages)  # each message rendered once
    assert sum(bool(traj["tools"]) for traj in rendered) == (1 if tools else 0)
    whole = render_trajectory({"id": "x", "messages": messages, "tools": tools}, tok)
    assert (r.ids, r.kinds, r.rounds) == (whole.input_ids, whole.kinds, whole.rounds)
    head = messages[:1] if messages[0]["role"] == "system" else []
    block = render_trajectory({"id": "x", "messages": head, "tools": tools}, tok).input_ids if head or tools else []
    assert r.block == (len(block) if 0 < len(block) < len(whole.input_ids) else 0)
