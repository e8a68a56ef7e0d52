"""Qwen3 chat rendering of canonical trajectories into token ids + a kind and a round per token.

This is the one renderer the trainer, the evals and serving call. It reproduces Qwen3's chat template
(`qwen3_chat_template.jinja`) text for text, with one deliberate difference: *every* assistant turn
keeps its own `<think>` block (the stock template drops the reasoning of turns before the last real
user query, so whole-conversation rendering would not equal turn-by-turn rendering). An assistant turn
without reasoning renders an empty block `<think>\n\n</think>\n\n`, which is what the stock template
writes for the last turn and what Qwen3 emits in non-thinking mode. In agent trajectories (one task,
then assistant / tool turns) every assistant turn comes after the last user query, so the stock
template agrees with us exactly whenever every assistant turn has reasoning (a test checks this).

Token kinds (TEAM_NOTES): 0 context (no loss), 1 action (outer loss), 2 observation (inner loss), -1 pad.
  - action: the tokens the model generates: `<think>` ... tool calls ... `<|im_end|>` (the header
    `<|im_start|>assistant\n` and the `\n` after `<|im_end|>` are context);
  - observation: the terminal text inside a tool result (not `<tool_response>` wrappers or headers), or,
    for Terminus-style traces, the text of a later user message after its "New Terminal Output:" line;
  - everything else (system prompt, tool schemas, task, headers) is context.
Rounds: 0 = system + task; r >= 1 = the r-th assistant turn and the observations that follow it.

Every message ends in `<|im_end|>\n` and the next starts with `<|im_start|>`, both special tokens, so
the token sequence of a conversation is exactly the concatenation of its messages' token sequences:
`render_trajectory` is built from `render_message`, and serving can render incrementally with
`render_generation_prompt` (before generating an action), `render_action_end` (the `\n` after the
generated `<|im_end|>`) and `render_observation` (the tool-result turn).

Inside a message, kinds are assigned from character spans through the fast tokenizer's offsets; a
token that straddles wrapper text and observation text (e.g. a final `\n\n`) counts as observation.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field

from ds_ttt.data.token_kind import TokenKind


@dataclass
class RenderedTrajectory:
    id: str
    input_ids: list[int]
    kinds: list[int]
    rounds: list[int]
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_rounds(self) -> int:
        """Number of action rounds (round ids 1..num_rounds)."""
        return max(self.rounds) if self.rounds else 0

    def count(self, kind: int) -> int:
        return sum(1 for k in self.kinds if k == kind)

    def prefix(self, last_round: int) -> "RenderedTrajectory":
        """The tokens of rounds 0..last_round (rounds are contiguous and non-decreasing)."""
        n = sum(1 for r in self.rounds if r <= last_round)
        return RenderedTrajectory(self.id, self.input_ids[:n], self.kinds[:n], self.rounds[:n], dict(self.meta))


TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)
GENERATION_PROMPT = "<|im_start|>assistant\n"
ACTION_END = "\n"  # after the generated <|im_end|>; context
# Terminus-style observations: the terminal text starts after one of these lines.
_TERMINAL_MARKER = re.compile(r"(?:New Terminal Output|Current [Tt]erminal [Ss](?:tate|creen)):[ \t]*\n")
THINK_TAGS = ("<think>", "</think>")  # structural only inside an assistant turn (schema.py moves them out)

Span = tuple[str, int]  # (text, kind)


def _tojson(obj) -> str:
    # transformers' jinja `tojson` filter: json.dumps(ensure_ascii=False) with default separators.
    return json.dumps(obj, ensure_ascii=False)


def format_arguments(arguments) -> str:
    """Tool-call arguments as rendered: a string verbatim, anything else through `tojson`."""
    return arguments if isinstance(arguments, str) else _tojson(arguments)


def encode_spans(spans: list[Span], tokenizer) -> tuple[list[int], list[int]]:
    """Tokenize the concatenated span texts once and give each token the kind of the spans it covers
    (observation/action win over context when a token straddles a boundary)."""
    text = "".join(t for t, _ in spans)
    if not text:
        return [], []
    bounds = []
    pos = 0
    for t, k in spans:
        bounds.append((pos, pos + len(t), k))
        pos += len(t)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    kinds = []
    for s, e in enc["offset_mapping"]:
        if e <= s:
            e = s + 1
        kind = TokenKind.CONTEXT
        for bs, be, k in bounds:
            if bs < e and s < be and k != TokenKind.CONTEXT:
                kind = max(kind, k) if k != TokenKind.PAD else kind
        kinds.append(int(kind))
    return ids, kinds


def system_spans(content: str | None, tools: list | None) -> list[Span]:
    """The first system turn (with the tool schemas when there are tools). All context."""
    if tools:
        text = "<|im_start|>system\n" + (content + "\n\n" if content is not None else "") + TOOLS_PREAMBLE
        text += "".join("\n" + _tojson(t) for t in tools) + TOOLS_POSTAMBLE + "<|im_end|>\n"
    else:
        text = "<|im_start|>system\n" + (content or "") + "<|im_end|>\n"
    return [(text, TokenKind.CONTEXT)]


def action_text(message: dict) -> str:
    """What the model generates for an assistant message: think block, content, tool calls, <|im_end|>."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    content = content.lstrip("\n")
    text = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content
    for k, call in enumerate(message.get("tool_calls") or []):
        if k > 0 or content:
            text += "\n"
        fn = call.get("function", call)
        text += '<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + format_arguments(fn["arguments"]) + "}\n</tool_call>"
    return text + "<|im_end|>"


def _observation_spans_of_user(content: str) -> list[Span]:
    m = _TERMINAL_MARKER.search(content)
    start = m.end() if m else 0
    return [(content[:start], TokenKind.CONTEXT), (content[start:], TokenKind.OBSERVATION)]


def message_spans(
    message: dict,
    *,
    is_first: bool = False,
    prev_role: str | None = None,
    next_role: str | None = None,
    tools: list | None = None,
    as_observation: bool = False,
) -> list[Span]:
    """Text spans (with kinds) of one message exactly as Qwen3's template writes it in context."""
    role = message["role"]
    content = message.get("content")
    content = content if isinstance(content, str) else ""
    if role == "system" and is_first:
        return system_spans(content, tools)
    if role in ("system", "user"):
        head = [("<|im_start|>" + role + "\n", TokenKind.CONTEXT)]
        body = _observation_spans_of_user(content) if as_observation and role == "user" else [(content, TokenKind.CONTEXT)]
        return head + body + [("<|im_end|>\n", TokenKind.CONTEXT)]
    if role == "assistant":
        return [(GENERATION_PROMPT, TokenKind.CONTEXT), (action_text(message), TokenKind.ACTION), (ACTION_END, TokenKind.CONTEXT)]
    if role == "tool":
        spans: list[Span] = []
        if prev_role != "tool":
            spans.append(("<|im_start|>user", TokenKind.CONTEXT))
        spans += [("\n<tool_response>\n", TokenKind.CONTEXT), (content, TokenKind.OBSERVATION), ("\n</tool_response>", TokenKind.CONTEXT)]
        if next_role != "tool":
            spans.append(("<|im_end|>\n", TokenKind.CONTEXT))
        return spans
    raise ValueError(f"unknown role {role!r}")


def render_message(message: dict, tokenizer, **kwargs) -> tuple[list[int], list[int]]:
    """(ids, kinds) of one message; keyword args as in `message_spans` (neighbours decide tool grouping)."""
    return encode_spans(message_spans(message, **kwargs), tokenizer)


def render_generation_prompt(tokenizer) -> list[int]:
    """`<|im_start|>assistant\n`: the context tokens that precede a generated action."""
    return tokenizer.encode(GENERATION_PROMPT, add_special_tokens=False)


def render_action_end(tokenizer) -> list[int]:
    """The context `\n` that follows a generated action's `<|im_end|>` before the next turn."""
    return tokenizer.encode(ACTION_END, add_special_tokens=False)


def render_action(message: dict, tokenizer) -> list[int]:
    """The action tokens of an assistant message (what the model should generate after the prompt)."""
    return tokenizer.encode(action_text(message), add_special_tokens=False)


def render_observation(tool_results: list[str], tokenizer) -> tuple[list[int], list[int]]:
    """The user turn carrying tool results: `<|im_start|>user` + one `<tool_response>` per result."""
    ids: list[int] = []
    kinds: list[int] = []
    n = len(tool_results)
    for i, text in enumerate(tool_results):
        msg = {"role": "tool", "content": text}
        a, b = render_message(msg, tokenizer, prev_role="tool" if i > 0 else "assistant", next_role="tool" if i < n - 1 else None)
        ids += a
        kinds += b
    return ids, kinds


def render_trajectory(trajectory: dict, tokenizer) -> RenderedTrajectory:
    """Render a canonical trajectory (see schema.py) into ids, kinds and round ids."""
    messages = trajectory["messages"]
    tools = trajectory.get("tools") or None
    ids: list[int] = []
    kinds: list[int] = []
    rounds: list[int] = []
    r = 0
    if tools and (not messages or messages[0]["role"] != "system"):
        a, b = encode_spans(system_spans(None, tools), tokenizer)
        ids, kinds, rounds = a, b, [0] * len(a)
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            r += 1
        a, b = render_message(
            msg,
            tokenizer,
            is_first=(i == 0),
            prev_role=messages[i - 1]["role"] if i > 0 else None,
            next_role=messages[i + 1]["role"] if i + 1 < len(messages) else None,
            tools=tools,
            as_observation=(r >= 1),
        )
        ids += a
        kinds += b
        rounds += [r] * len(a)
    meta = dict(trajectory.get("meta") or {})
    meta.setdefault("source", trajectory.get("source"))
    return RenderedTrajectory(str(trajectory["id"]), ids, kinds, rounds, meta)


def find_fact_tokens(rendered: RenderedTrajectory, tokenizer, fact: str, round: int, kind: int) -> list[int]:
    """Positions of the tokens (of `kind` in `round`) that overlap the first occurrence of `fact` in that
    text, e.g. the readback value in a memory world's observation or the fact an action must reproduce.
    Returns [] when the fact does not occur. Token texts are decoded one by one (fine for ASCII facts)."""
    positions = [i for i, (k, r) in enumerate(zip(rendered.kinds, rendered.rounds)) if k == kind and r == round]
    pieces = [tokenizer.decode([rendered.input_ids[i]]) for i in positions]
    text = "".join(pieces)
    start = text.find(fact)
    if start < 0:
        return []
    end, out, pos = start + len(fact), [], 0
    for i, piece in zip(positions, pieces):
        if pos < end and start < pos + len(piece):
            out.append(i)
        pos += len(piece)
    return out


_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.S)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_assistant_message(text: str) -> dict:
    """Parse generated text (`<think>…</think>` + content + `<tool_call>{json}</tool_call>` blocks,
    optionally ending in `<|im_end|>`) back into an OpenAI-style assistant message.

    Tool calls whose JSON does not parse (or lacks name/arguments) go to `invalid_tool_calls`
    with the error, so serving can report them instead of crashing.
    """
    text = text.split("<|im_end|>")[0]
    reasoning = None
    m = _THINK.match(text)
    if m and "</think>" in text:
        reasoning = m.group(1).strip("\n")
        text = text[m.end():]
    calls, invalid = [], []
    for k, block in enumerate(_TOOL_CALL.findall(text)):
        try:
            obj = json.loads(block)
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str):
                raise ValueError("name is not a string")
            if isinstance(args, str):
                args = json.loads(args)
            calls.append({"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": _tojson(args)}})
        except (ValueError, KeyError, TypeError) as e:
            invalid.append({"text": block, "error": f"{type(e).__name__}: {e}"})
    content = _TOOL_CALL.sub("", text).strip()
    msg: dict = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    if invalid:
        msg["invalid_tool_calls"] = invalid
    return msg


def reply_is_unfinished(content: str, *, truncated: bool) -> bool:
    """A reply that ended before it was done: cut at the token limit (`truncated`), or whose parsed
    content still holds an unclosed `<think>` or `<tool_call>` (a closed tool call is parsed out of it)."""
    def unclosed(opening: str, closing: str) -> bool:
        return content.rfind(opening) > content.rfind(closing)

    return truncated or unclosed("<think>", "</think>") or unclosed("<tool_call>", "</tool_call>")


def final_answer(content: str | None, *, truncated: bool) -> str:
    """The answer an episode's final reply gives: its content, or "" when the reply is unfinished
    (`reply_is_unfinished`): half a thought or half a command is never an answer, even when it holds
    the number a test looks for. The closed-loop runner and the Harbor agent both write this."""
    content = content or ""
    return "" if reply_is_unfinished(content, truncated=truncated) else content


@functools.lru_cache(maxsize=1)
def control_tokens() -> tuple[str, ...]:
    """Every Qwen3 added token but the think tags: in message text each would encode as its single
    token id (`<tool_call>` as a tool call, `<|im_end|>` as the end of a turn) and break the structure."""
    from .tokenizer import QWEN3_ADDED_TOKENS  # here, not at import: tokenizer.py imports transformers

    return tuple(content for _, content, _ in QWEN3_ADDED_TOKENS if content not in THINK_TAGS)


def contains_control_tokens(text: str) -> str | None:
    """The first chat-control token found inside message text (it would break the turn structure)."""
    if "<" not in text:
        return None
    for t in control_tokens():
        if t in text:
            return t
    return None
