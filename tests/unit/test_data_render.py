"""Rendering: equals transformers' apply_chat_template where they agree; kinds, rounds, incremental form.

    .venv/bin/python -m pytest tests/unit/test_data_render.py -q
"""

import json

import pytest

from ds_ttt.data.generator import BASH_TOOL, generate_one
from ds_ttt.data.render import (
    TokenKind,
    action_text,
    parse_assistant_message,
    render_action,
    render_action_end,
    render_generation_prompt,
    render_message,
    render_observation,
    render_trajectory,
)
from ds_ttt.data.schema import normalize_trajectory
from ds_ttt.data.tokenizer import build_qwen3_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_qwen3_tokenizer()


def call(cid, cmd):
    return {"id": cid, "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": cmd}, ensure_ascii=False)}}


def hf_ids(tok, messages, tools=None, **kw):
    out = tok.apply_chat_template(messages, tools=tools, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


CONVERSATIONS = {
    "tools+reasoning": (
        [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List files."},
         {"role": "assistant", "content": "", "reasoning_content": "I will list.", "tool_calls": [call("c1", "ls -a")]},
         {"role": "tool", "tool_call_id": "c1", "content": "a.txt\nb.txt"},
         {"role": "assistant", "content": "Two files.", "reasoning_content": "Done."}],
        [BASH_TOOL]),
    "two calls, two results, unicode": (
        [{"role": "user", "content": "Zähle die Zeilen — bitte."},
         {"role": "assistant", "content": "Ich prüfe beide.", "reasoning_content": "\nBeide Dateien.\n",
          "tool_calls": [call("a", "wc -l ä.txt"), call("b", "cat 'über.txt'")]},
         {"role": "tool", "tool_call_id": "a", "content": "3 ä.txt\n"}, {"role": "tool", "tool_call_id": "b", "content": "x\ny"},
         {"role": "assistant", "content": "", "reasoning_content": "Now finish.", "tool_calls": [call("c", "echo done")]},
         {"role": "tool", "tool_call_id": "c", "content": ""},
         {"role": "assistant", "content": "ä.txt has 3 lines.", "reasoning_content": "ok"}],
        [BASH_TOOL]),
    "no tools, last turn without reasoning": (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        None),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_equals_apply_chat_template(tok, name):
    messages, tools = CONVERSATIONS[name]
    rt = render_trajectory({"id": name, "messages": messages, "tools": tools}, tok)
    assert rt.input_ids == hf_ids(tok, messages, tools)


def test_generated_trajectory_equals_apply_chat_template(tok):
    t = generate_one(11, 4)
    rt = render_trajectory(t, tok)
    assert rt.input_ids == hf_ids(tok, t["messages"], t["tools"])


def test_generation_prompt_equals_template(tok):
    messages, tools = CONVERSATIONS["tools+reasoning"]
    hist = messages[:4]
    prompt = hf_ids(tok, hist, tools, add_generation_prompt=True)
    rt = render_trajectory({"id": "x", "messages": hist, "tools": tools}, tok)
    assert prompt == rt.input_ids + render_generation_prompt(tok)


def test_earlier_turn_keeps_reasoning_where_stock_template_drops_it(tok):
    # Terminus-style: observations are user messages, so the stock template drops earlier thinking.
    msgs = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "New Terminal Output:\nout1"}, {"role": "assistant", "content": "a2", "reasoning_content": "r2"}]
    rt = render_trajectory({"id": "t", "messages": msgs}, tok)
    text = tok.decode(rt.input_ids)
    assert "<think>\nr1\n</think>" in text and "<think>\nr2\n</think>" in text
    assert "r1" not in tok.apply_chat_template(msgs, tokenize=False)


def test_turn_by_turn_equals_whole(tok):
    t = generate_one(5, 2)
    rt = render_trajectory(t, tok)
    msgs = t["messages"]
    # context up to the first action = system + task
    ids, kinds = [], []
    a, b = render_message(msgs[0], tok, is_first=True, tools=t["tools"])
    ids += a; kinds += b
    a, b = render_message(msgs[1], tok, prev_role="system", next_role="assistant")
    ids += a; kinds += b
    i = 2
    while i < len(msgs):
        act = msgs[i]
        ids += render_generation_prompt(tok); kinds += [0] * len(render_generation_prompt(tok))
        gen = render_action(act, tok)
        ids += gen; kinds += [1] * len(gen)
        ids += render_action_end(tok); kinds += [0]
        i += 1
        results = []
        while i < len(msgs) and msgs[i]["role"] == "tool":
            results.append(msgs[i]["content"]); i += 1
        if results:
            a, b = render_observation(results, tok)
            ids += a; kinds += b
    assert ids == rt.input_ids
    assert kinds == rt.kinds


def test_kinds_and_rounds(tok):
    t = normalize_trajectory(generate_one(7, 3))
    rt = render_trajectory(t, tok)
    assert len(rt.input_ids) == len(rt.kinds) == len(rt.rounds)
    actions = [m for m in t["messages"] if m["role"] == "assistant"]
    assert rt.num_rounds == len(actions) == t["meta"]["num_rounds"]
    for r, msg in enumerate(actions, start=1):
        act = [i for i, k, rr in zip(rt.input_ids, rt.kinds, rt.rounds) if rr == r and k == TokenKind.ACTION]
        assert tok.decode(act) == action_text(msg)
        assert act[-1] == tok.convert_tokens_to_ids("<|im_end|>") and act[0] == tok.convert_tokens_to_ids("<think>")
    # observation tokens of a round decode to that round's tool outputs (and only those)
    r = 0
    outs: dict[int, list[str]] = {}
    for m in t["messages"]:
        r += m["role"] == "assistant"
        if m["role"] == "tool":
            outs.setdefault(r, []).append(m["content"])
    for r, texts in outs.items():
        obs = [i for i, k, rr in zip(rt.input_ids, rt.kinds, rt.rounds) if rr == r and k == TokenKind.OBSERVATION]
        # a token straddling the output's end and the wrapper's "\n" (e.g. "]\n") counts as observation
        got, want = tok.decode(obs), "".join(texts)
        assert got.startswith(want) and got[len(want):] in ("", "\n")
    # round 0 is pure context and covers system + task
    assert {k for k, rr in zip(rt.kinds, rt.rounds) if rr == 0} == {TokenKind.CONTEXT}
    assert rt.rounds == sorted(rt.rounds)


def test_terminus_user_observation_after_marker(tok):
    msgs = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "{}"},
            {"role": "user", "content": "Previous response had warnings:\nWARNINGS: x\n\nNew Terminal Output:\n$ ls\nfile\n$ "}]
    rt = render_trajectory({"id": "t", "messages": msgs}, tok)
    obs = [i for i, k in zip(rt.input_ids, rt.kinds) if k == TokenKind.OBSERVATION]
    assert tok.decode(obs) == "$ ls\nfile\n$ "


def test_parse_assistant_message_roundtrip(tok):
    msg = {"role": "assistant", "content": "Checking.", "reasoning_content": "Need ls and wc.",
           "tool_calls": [call("call_0", "ls"), call("call_1", "wc -l 'ä b.txt'")]}
    text = tok.decode(render_action(msg, tok))
    parsed = parse_assistant_message(text)
    assert parsed["reasoning_content"] == msg["reasoning_content"]
    assert parsed["content"] == msg["content"]
    assert [c["function"] for c in parsed["tool_calls"]] == [c["function"] for c in msg["tool_calls"]]
    assert render_action(parsed, tok) == render_action(msg, tok)


def test_parse_reports_invalid_tool_call():
    parsed = parse_assistant_message('<think>\nx\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": {bad}\n</tool_call><|im_end|>')
    assert "tool_calls" not in parsed and parsed["invalid_tool_calls"][0]["error"].startswith("JSONDecodeError")
