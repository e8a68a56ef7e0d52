"""Importers: ATIF JSON (incl. continuation files), Terminus-2 trial folders, OpenAI-messages JSONL.

`import_inputs(paths)` walks files and folders (sorted, so the result is deterministic) and returns
`ImportResult(trajectories, rejects, skipped)`. Every record either becomes a normalized canonical
trajectory or a `Reject(file, line, step, reason)`; nothing is dropped silently. Files that are no
trajectory format at all (a trial's config.json, a README) are listed in `skipped`.

Dispatch: a folder holding `agent/episode-*` is a Terminus-2 trial; `*.jsonl` is OpenAI-messages /
canonical JSONL (one trajectory per line); `*.json` is ATIF when its `schema_version` says so. An
empty file, a line that is not JSON, or a record that fails validation is a reject naming the file,
the line (JSONL) and the message index or ATIF step.

Copies: the same trajectory may arrive twice — `data_prep/generate.py` writes each one to
`trajectories.jsonl` and again as `atif/<id>.json`. A second record with a known id is a copy when it
equals the first in everything but the provenance keys the ATIF importer adds to meta (session_id,
agent, model); one copy is kept, the canonical JSONL one when there is one (it is the generator's own
record, byte for byte, while the ATIF copy is a conversion), otherwise the first in walk order, and
every dropped copy is listed in `duplicate_copies`. The same id with different content rejects every
version (neither is known to be the right one), each reject naming the other place.

RL fields: an ATIF agent step's `prompt_token_ids`, `completion_token_ids`, `logprobs` (metrics) and
`inner_loss` (extra) are kept as `meta.rl_steps` (ds_ttt/data/atif.py). `check_token_ids(traj, tokenizer)`
says where they differ from a re-tokenisation of the imported messages (the project's renderer): the
prompt ids must be the rendering up to the reply's first token, the completion ids the reply's tokens.

Terminus-2 trial: `agent/episode-N/debug.json` holds the input messages of episode N and
`response.txt` the raw reply (JSON `{"analysis", "plan", "commands": [{"keystrokes", "duration"}],
"task_complete"}`, possibly after a `<think>` block). Episode N+1's input must extend episode N's
input + reply; where it does not (a summarization restarted the context) a new part begins, imported
as its own trajectory `<trial>#part-K` in the same group. The reward comes from `result.json`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .atif import ATIFError, atif_to_canonical, is_atif
from .token_kind import TokenKind
from .schema import TrajectoryError, normalize_trajectory

_CONT = re.compile(r"^(?P<base>.+)\.cont-(?P<n>\d+)\.json$")
_EPISODE = re.compile(r"^episode-(\d+)$")


ATIF_PROVENANCE_KEYS = ("session_id", "agent", "model")  # meta keys atif_to_canonical adds
FORMAT_PREFERENCE = ("openai_jsonl", "atif", "terminus2_trial")  # which copy of one trajectory is kept


@dataclass
class Reject:
    file: str
    reason: str
    line: int | None = None
    step: str | int | None = None
    step_kind: str | None = None  # "message" (index into messages), "step" (ATIF step_id), "episode" (Terminus-2)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """`FILE:LINE: message|step|episode S: reason` (the parts that are known)."""
        where = self.file + (f":{self.line}" if self.line is not None else "")
        if self.step is not None:
            where += f": {self.step}" if self.step_kind == "episode" else f": {self.step_kind or 'step'} {self.step}"
        return f"{where}: {self.reason}"


def _content(traj: dict) -> dict:
    return {**traj, "meta": {k: v for k, v in traj["meta"].items() if k not in ATIF_PROVENANCE_KEYS}}


def _split_origin(origin: str) -> tuple[str, int | None]:
    file, _, line = origin.rpartition(":")
    return (file, int(line)) if line.isdigit() else (origin, None)


@dataclass
class ImportResult:
    trajectories: list[dict] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)  # trajectory id -> "file[:line]"
    counts_by_format: dict[str, int] = field(default_factory=dict)
    duplicate_copies: list[dict] = field(default_factory=list)  # {"id", "kept", "dropped"} per dropped copy
    _kept: dict[str, tuple[int, str]] = field(default_factory=dict)  # id -> (index in trajectories, format)
    _conflicts: dict[str, str] = field(default_factory=dict)  # id -> where its differing versions are

    def add(self, traj: dict, origin: str, fmt: str) -> None:
        file, line = _split_origin(origin)
        try:
            traj = normalize_trajectory(traj)
        except TrajectoryError as e:
            self.rejects.append(Reject(file, e.reason, line, e.step, "message" if e.step is not None else None))
            return
        tid = traj["id"]
        if tid in self._conflicts:
            self.rejects.append(Reject(file, f"duplicate id {tid!r} with different content (also in {self._conflicts[tid]})", line))
            return
        if tid not in self._kept:
            self._kept[tid] = (len(self.trajectories), fmt)
            self.origins[tid] = origin
            self.trajectories.append(traj)
            self.counts_by_format[fmt] = self.counts_by_format.get(fmt, 0) + 1
            return
        k, kept_fmt = self._kept[tid]
        if _content(self.trajectories[k]) != _content(traj):
            # Two versions of one trajectory: neither is known to be right, so both are rejected, by name.
            first = self.origins.pop(tid)
            self.rejects.append(Reject(file, f"duplicate id {tid!r} with different content (also in {first})", line))
            first_file, first_line = _split_origin(first)
            self.rejects.append(Reject(first_file, f"duplicate id {tid!r} with different content (also in {origin})", first_line))
            self._conflicts[tid] = f"{first} and {origin}"
            del self.trajectories[k]
            self.counts_by_format[kept_fmt] -= 1
            if not self.counts_by_format[kept_fmt]:
                del self.counts_by_format[kept_fmt]
            self._kept = {t["id"]: (i, self._kept[t["id"]][1]) for i, t in enumerate(self.trajectories)}
            return
        if FORMAT_PREFERENCE.index(fmt) < FORMAT_PREFERENCE.index(kept_fmt):  # keep the canonical copy
            self.duplicate_copies.append({"id": tid, "kept": origin, "dropped": self.origins[tid]})
            self.counts_by_format[kept_fmt] -= 1
            if not self.counts_by_format[kept_fmt]:
                del self.counts_by_format[kept_fmt]
            self.counts_by_format[fmt] = self.counts_by_format.get(fmt, 0) + 1
            self.trajectories[k], self.origins[tid], self._kept[tid] = traj, origin, (k, fmt)
        else:
            self.duplicate_copies.append({"id": tid, "kept": self.origins[tid], "dropped": origin})


# ---------------------------------------------------------------- OpenAI-messages JSONL
def import_jsonl(path: Path, result: ImportResult) -> None:
    num_records = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            num_records += 1
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                result.rejects.append(Reject(str(path), f"invalid JSON ({e.msg} at column {e.colno})", lineno))
                continue
            if isinstance(rec, dict) and "id" not in rec:
                rec = dict(rec, id=f"{path.stem}:{lineno}")
            if isinstance(rec, dict) and not rec.get("source"):
                rec = dict(rec, source="openai_jsonl")
            result.add(rec, f"{path}:{lineno}", "openai_jsonl")
    if num_records == 0:
        result.rejects.append(Reject(str(path), "empty file: no trajectory records (one JSON object per line expected)"))


# ---------------------------------------------------------------- ATIF
def _atif_group(path: Path) -> tuple[str | None, str | None, str | None]:
    """(id suffix, group, problem) for a continuation file; (None, None, None) for a main file."""
    m = _CONT.match(path.name)
    if not m:
        return None, None, None
    n = int(m.group("n"))
    prev = path.with_name(f"{m.group('base')}.json" if n == 1 else f"{m.group('base')}.cont-{n - 1}.json")
    if not prev.is_file():
        return f".cont-{n}", None, f"continuation file without its predecessor {prev.name}"
    root = path.with_name(f"{m.group('base')}.json")
    group = None
    if root.is_file():
        try:
            group = json.loads(root.read_text(encoding="utf-8")).get("session_id")
        except (json.JSONDecodeError, AttributeError):
            group = None
    return f".cont-{n}", group, None


def import_atif(path: Path, doc: dict, result: ImportResult) -> None:
    suffix, group, problem = _atif_group(path)
    if problem:
        result.rejects.append(Reject(str(path), problem))
        return
    try:
        session = doc.get("session_id") if isinstance(doc.get("session_id"), str) else None
        if suffix and session and group == session:
            traj_id = session + suffix
        else:
            traj_id = session
        traj = atif_to_canonical(doc, traj_id=traj_id, group=group or session)
    except ATIFError as e:
        result.rejects.append(Reject(str(path), e.reason, None, e.step, "step" if e.step is not None else None))
        return
    result.add(traj, str(path), "atif")


# ---------------------------------------------------------------- Terminus-2 trial folders
def is_trial_dir(path: Path) -> bool:
    agent = path / "agent"
    return agent.is_dir() and any(_EPISODE.match(p.name) for p in agent.iterdir() if p.is_dir())


def parse_terminus_reply(text: str) -> dict:
    """The JSON object of a Terminus-2 reply (after an optional think block / code fence)."""
    body = text.split("</think>")[-1].strip()
    fence = re.search(r"```(?:json)?\s*(\{.*\})\s*```", body, re.S)
    if fence:
        body = fence.group(1)
    start, end = body.find("{"), body.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object in the reply")
    obj = json.loads(body[start : end + 1])
    if not isinstance(obj, dict):
        raise ValueError("reply JSON is not an object")
    cmds = obj.get("commands", [])
    if not isinstance(cmds, list) or any(not isinstance(c, dict) or not isinstance(c.get("keystrokes"), str) for c in cmds):
        raise ValueError("'commands' must be a list of objects with string 'keystrokes'")
    if not cmds and not obj.get("task_complete"):
        raise ValueError("reply has no commands and does not mark the task complete")
    return obj


def _trial_reward(trial: Path) -> tuple[dict, str | None]:
    res = trial / "result.json"
    if not res.is_file():
        return {}, None
    try:
        doc = json.loads(res.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        return {}, f"result.json is not valid JSON ({e.msg})"
    meta = {}
    vr = doc.get("verifier_result") or {}
    reward = None
    if isinstance(vr, dict):
        reward = (vr.get("rewards") or {}).get("reward") if isinstance(vr.get("rewards"), dict) else vr.get("reward")
    if reward is None:
        reward = doc.get("reward")
    if reward is not None:
        meta["reward"] = float(reward)
        meta["success"] = float(reward) >= 1.0
    for key in ("task_name", "trial_name"):
        if doc.get(key):
            meta[key] = doc[key]
    return meta, None


def import_trial(trial: Path, result: ImportResult) -> None:
    episodes = sorted(
        ((int(m.group(1)), p) for p in (trial / "agent").iterdir() if p.is_dir() and (m := _EPISODE.match(p.name))),
        key=lambda t: t[0],
    )
    meta, problem = _trial_reward(trial)
    if problem:
        result.rejects.append(Reject(str(trial / "result.json"), problem))
        return
    parts: list[list[dict]] = []
    conv: list[dict] | None = None
    for n, ep in episodes:
        step = f"episode-{n}"
        debug, resp = ep / "debug.json", ep / "response.txt"
        if not debug.is_file() or not resp.is_file():
            missing = "debug.json" if not debug.is_file() else "response.txt"
            result.rejects.append(Reject(str(trial), f"{step} has no {missing}", None, step, "episode"))
            return
        try:
            doc = json.loads(debug.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            result.rejects.append(Reject(str(debug), f"invalid JSON ({e.msg})", None, step, "episode"))
            return
        inputs = doc.get("messages", doc.get("input")) if isinstance(doc, dict) else None
        if not isinstance(inputs, list) or not inputs or not all(isinstance(m, dict) and "role" in m for m in inputs):
            result.rejects.append(Reject(str(debug), "debug.json has no input message list ('messages')", None, step, "episode"))
            return
        reply = resp.read_text(encoding="utf-8")
        try:
            parse_terminus_reply(reply)
        except ValueError as e:
            result.rejects.append(Reject(str(resp), f"not a Terminus-2 reply: {e}", None, step, "episode"))
            return
        inputs = [{"role": m["role"], "content": m.get("content") or ""} for m in inputs]
        if conv is not None and inputs[: len(conv)] == conv:
            conv = inputs  # the usual case: this episode's input extends the previous one
        else:
            if conv is not None:
                parts.append(conv)
            conv = inputs
        conv = conv + [{"role": "assistant", "content": reply}]
    if conv is None:
        result.rejects.append(Reject(str(trial), "trial has no episodes"))
        return
    parts.append(conv)
    base = meta.get("trial_name") or trial.name
    for k, msgs in enumerate(parts):
        tid = base if len(parts) == 1 else f"{base}#part-{k + 1}"
        traj = {"id": tid, "source": "terminus2_trial", "messages": msgs, "meta": dict(meta, group=base, part=k + 1, num_parts=len(parts))}
        result.add(traj, str(trial), "terminus2_trial")


# ---------------------------------------------------------------- dispatch
def _import_file(path: Path, result: ImportResult) -> None:
    if path.suffix == ".jsonl":
        import_jsonl(path, result)
    elif path.suffix == ".json":
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            result.rejects.append(Reject(str(path), "empty file: no JSON document (an ATIF trajectory expected)"))
            return
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            result.rejects.append(Reject(str(path), f"invalid JSON ({e.msg} at line {e.lineno})", e.lineno))
            return
        if is_atif(doc):
            import_atif(path, doc, result)
        elif isinstance(doc, dict) and "steps" in doc and "session_id" in doc:
            result.rejects.append(Reject(str(path), "looks like ATIF but has no 'ATIF-v…' schema_version"))
        else:
            result.skipped.append(str(path))
    else:
        result.skipped.append(str(path))


def _walk(path: Path, result: ImportResult) -> None:
    if path.is_dir():
        if is_trial_dir(path):
            import_trial(path, result)
            return
        for child in sorted(path.iterdir()):
            if child.name.startswith("."):
                continue
            _walk(child, result)
    elif path.is_file():
        _import_file(path, result)
    else:
        result.rejects.append(Reject(str(path), "input path does not exist"))


def import_inputs(paths: list[str | Path]) -> ImportResult:
    result = ImportResult()
    for p in paths:
        _walk(Path(p), result)
    return result


# ---------------------------------------------------------------- RL token ids
def check_token_ids(traj: dict, tokenizer) -> list[str]:
    """Where `traj`'s `meta.rl_steps` differ from a re-tokenisation of its messages (empty: lossless).
    Round k's reply is the k-th run of ACTION tokens of `render_trajectory`; its prompt is everything
    before it."""
    from .render import render_trajectory

    steps = (traj.get("meta") or {}).get("rl_steps")
    if not steps:
        return [f"{traj['id']}: no meta.rl_steps (an ATIF file without token ids in its agent steps' metrics)"]
    r = render_trajectory(traj, tokenizer)
    spans: dict[int, list[int]] = {}
    for i, (kind, rnd) in enumerate(zip(r.kinds, r.rounds)):
        if kind == TokenKind.ACTION:
            spans.setdefault(rnd, []).append(i)
    replies = [spans[k] for k in sorted(spans)]
    problems = []
    if len(replies) != len(steps):
        problems.append(f"{traj['id']}: {len(steps)} agent steps with RL fields but {len(replies)} rendered replies")
    for k, (step, pos) in enumerate(zip(steps, replies), 1):
        if step is None:
            problems.append(f"{traj['id']}: agent step {k} has no token ids")
            continue
        want_prompt, want_completion = r.input_ids[:pos[0]], r.input_ids[pos[0]:pos[-1] + 1]
        for name, got, want in (("prompt_token_ids", step.get("prompt_token_ids"), want_prompt),
                                ("completion_token_ids", step.get("completion_token_ids"), want_completion)):
            if got != want:
                at = next((i for i, (a, b) in enumerate(zip(got or [], want)) if a != b), min(len(got or []), len(want)))
                problems.append(f"{traj['id']}: agent step {k}: {name} differ from the re-tokenisation at token {at} "
                                f"({len(got or [])} ids in the file, {len(want)} rendered)")
    return problems
