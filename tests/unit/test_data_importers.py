"""Importers on the committed fixtures in tests/assets/data: well-formed records and each malformed kind.

    .venv/bin/python -m pytest tests/unit/test_data_importers.py -q
"""

import json
from pathlib import Path

from ds_ttt.data.atif import atif_to_canonical, canonical_to_atif
from ds_ttt.data.generator import generate_one
from ds_ttt.data.importers import import_inputs, parse_terminus_reply
from ds_ttt.data.schema import normalize_trajectory

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "data"


def by_id(res):
    return {t["id"]: t for t in res.trajectories}


def test_atif_with_continuation():
    res = import_inputs([ASSETS / "atif" / "good"])
    assert not res.rejects
    t = by_id(res)
    main, cont = t["sess-good-1"], t["sess-good-1.cont-1"]
    assert main["meta"]["group"] == cont["meta"]["group"] == "sess-good-1"
    assert [m["role"] for m in main["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert main["messages"][3] == {"role": "tool", "content": "id,name\n1,ann\n2,bob", "tool_call_id": "call_1"}
    assert json.loads(main["messages"][4]["tool_calls"][0]["function"]["arguments"]) == {"command": "wc -l data.csv"}
    assert main["messages"][2]["reasoning_content"] == "Look at the file first."
    assert main["tools"][0]["function"]["name"] == "bash" and main["meta"]["reward"] == 1.0
    assert cont["messages"][1]["content"].startswith("Summary so far")


def test_atif_malformed_each_kind():
    res = import_inputs([ASSETS / "atif" / "bad", ASSETS / "atif" / "orphan"])
    assert not res.trajectories
    got = {Path(r.file).name: (r.step, r.reason) for r in res.rejects}
    assert got["step_order.json"] == (4, "step_id 7 out of order (expected 4)")
    assert got["unknown_source.json"][0] == 2 and "unknown step source" in got["unknown_source.json"][1]
    assert got["call_id.json"][0] == 3 and "call_404" in got["call_id.json"][1]
    assert got["arguments.json"][0] == 4 and "not valid JSON" in got["arguments.json"][1]
    assert "session_id" in got["no_session.json"][1]
    assert "invalid JSON" in got["truncated.json"][1]
    assert "predecessor" in got["trajectory.cont-2.json"][1]


def test_openai_jsonl_good():
    res = import_inputs([ASSETS / "openai" / "good.jsonl"])
    assert not res.rejects
    t = by_id(res)
    assert set(t) == {"oa-1", "good:2"}
    second = t["good:2"]
    assert second["messages"][0]["content"] == "List files, then stop."  # text parts joined
    assert second["messages"][1]["reasoning_content"] == "I should run ls."  # <think> moved out of content
    assert second["messages"][1]["content"] == ""
    assert second["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"command": "ls"}'


def test_openai_jsonl_malformed_each_kind():
    res = import_inputs([ASSETS / "openai" / "bad.jsonl"])
    assert res.trajectories == []  # "ok-1" comes in two versions (lines 1 and 10): both are refused
    reasons = {r.line: r.reason for r in res.rejects}
    assert set(reasons) == set(range(1, 11))
    assert reasons[2].startswith("invalid JSON")
    assert reasons[3] == "messages must be a non-empty list"
    assert "without a preceding assistant tool call" in reasons[4]
    assert "unknown role" in reasons[5]
    assert "control token <|im_end|>" in reasons[6]
    assert "not valid JSON" in reasons[7]
    assert "names no tool call" in reasons[8]
    assert reasons[9] == "no assistant turn"
    assert "duplicate id 'ok-1' with different content" in reasons[10] and "bad.jsonl:1)" in reasons[10]
    assert "duplicate id 'ok-1' with different content" in reasons[1] and "bad.jsonl:10)" in reasons[1]
    assert all(r.file.endswith("bad.jsonl") for r in res.rejects)


def test_terminus_trial_good():
    res = import_inputs([ASSETS / "terminus" / "trial_good"])
    assert not res.rejects
    (t,) = res.trajectories
    assert t["id"] == "trial_good" and t["source"] == "terminus2_trial"
    assert t["meta"]["reward"] == 1.0 and t["meta"]["success"] is True and t["meta"]["task_name"] == "hello-file"
    roles = [m["role"] for m in t["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert t["messages"][5]["reasoning_content"] == "The file has hi."
    assert parse_terminus_reply(t["messages"][7]["content"])["task_complete"] is True


def test_terminus_trial_malformed():
    res = import_inputs([ASSETS / "terminus" / "trial_bad_reply", ASSETS / "terminus" / "trial_missing_response"])
    assert not res.trajectories
    steps = {r.step: r for r in res.rejects}
    assert "not a Terminus-2 reply" in steps["episode-2"].reason and steps["episode-2"].file.endswith("response.txt")
    assert "episode-1 has no response.txt" == steps["episode-1"].reason


def test_terminus_summarization_starts_new_part(tmp_path):
    import shutil

    trial = tmp_path / "trial_sum"
    shutil.copytree(ASSETS / "terminus" / "trial_good", trial)
    dbg = trial / "agent" / "episode-2" / "debug.json"
    doc = json.loads(dbg.read_text())
    old = doc["messages"]
    doc["messages"] = [{"role": "user", "content": "Summary: hello.txt was written. Check it."}]
    dbg.write_text(json.dumps(doc))
    # episode 3 continues the summarized context: summary + episode-2 reply + its observation
    dbg3 = trial / "agent" / "episode-3" / "debug.json"
    doc3 = json.loads(dbg3.read_text())
    doc3["messages"] = doc["messages"] + doc3["messages"][len(old):]
    dbg3.write_text(json.dumps(doc3))
    res = import_inputs([trial])
    assert not res.rejects
    part1, part2 = res.trajectories
    assert (part1["id"], part2["id"]) == ("trial_good#part-1", "trial_good#part-2")  # trial_name from result.json
    assert part1["meta"]["group"] == part2["meta"]["group"] == "trial_good"
    assert len(part1["messages"]) == 4 and len(part2["messages"]) == 4
    assert part2["messages"][0]["content"].startswith("Summary:")


def test_directory_walk_counts_everything():
    res = import_inputs([ASSETS])
    assert len(res.trajectories) == 5  # openai/bad.jsonl's two versions of "ok-1" are both refused
    assert len(res.rejects) == 19
    assert res.skipped == [str(ASSETS / "make_fixtures.py")]


def test_atif_roundtrip_of_generated_trajectory():
    t = normalize_trajectory(generate_one(2, 0))
    back = normalize_trajectory(atif_to_canonical(canonical_to_atif(t)))
    assert back["messages"] == t["messages"] and back["tools"] == t["tools"] and back["id"] == t["id"]
    assert {k: back["meta"][k] for k in t["meta"]} == t["meta"]


def test_terminus2_style_atif_without_call_ids():
    from ds_ttt.data.atif import ATIFError
    import pytest

    doc = {"schema_version": "ATIF-v1.2", "session_id": "t2", "agent": {"name": "terminus-2", "version": "1"},
           "steps": [{"step_id": 1, "source": "user", "message": "Make hello.txt"},
                     {"step_id": 2, "source": "agent", "message": "Analysis: empty dir. Plan: write it.",
                      "tool_calls": [{"tool_call_id": "call_0_1", "function_name": "bash_command",
                                      "arguments": {"keystrokes": "echo hi > hello.txt\n", "duration": 0.1}}],
                      "observation": {"results": [{"content": "New Terminal Output:\n$ echo hi > hello.txt\n$ "}]}},
                     {"step_id": 3, "source": "agent", "message": "Done.",
                      "tool_calls": [{"tool_call_id": "call_1_task_complete", "function_name": "mark_task_complete", "arguments": {}}]}]}
    t = normalize_trajectory(atif_to_canonical(doc))
    assert [m["role"] for m in t["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert "tool_call_id" not in t["messages"][2]
    assert json.loads(t["messages"][1]["tool_calls"][0]["function"]["arguments"])["keystrokes"] == "echo hi > hello.txt\n"
    doc["steps"][1]["observation"]["results"][0]["source_call_id"] = "call_9"
    with pytest.raises(ATIFError, match="call_9"):
        atif_to_canonical(doc)


def test_rl_atif_round_trip_and_token_check(tmp_path):
    """rl_steps_atif writes token ids, logprobs and inner losses per agent step (ATIF-v1.7); the importer keeps
    them as meta.rl_steps and check_token_ids finds them equal to a re-tokenisation, or names the step that
    differs. An invalid call's error result names no tool call of its step, so it loses its source_call_id."""
    from ds_ttt.data.atif import rl_steps_atif
    from ds_ttt.data.importers import check_token_ids
    from ds_ttt.data.render import TokenKind, render_trajectory
    from ds_ttt.data.tokenizer import load_tokenizer

    t = normalize_trajectory(generate_one(2, 0))
    asst = [i for i, m in enumerate(t["messages"]) if m["role"] == "assistant"]
    first_call = t["messages"][asst[0]]["tool_calls"][0]["id"]
    k = next(i for i in range(asst[0] + 1, len(t["messages"])) if t["messages"][i]["role"] != "tool")
    t["messages"].insert(k, {"role": "tool", "tool_call_id": "call_9", "content": "[error: invalid tool call: x]"})
    tok = load_tokenizer()
    r = render_trajectory(t, tok)
    turns = []
    for rnd in sorted({rd for kind, rd in zip(r.kinds, r.rounds) if kind == TokenKind.ACTION}):
        pos = [i for i, (kind, rd) in enumerate(zip(r.kinds, r.rounds)) if kind == TokenKind.ACTION and rd == rnd]
        completion = r.input_ids[pos[0]:pos[-1] + 1]
        turns.append({"prompt_token_ids": r.input_ids[:pos[0]], "completion_token_ids": completion,
                      "logprobs": [-0.5] * (len(completion) - 1)})
    losses = [1.25] * (len(turns) - 1) + [None]
    doc = rl_steps_atif(t, turns, losses)
    assert doc["schema_version"] == "ATIF-v1.7"
    results = doc["steps"][[s["source"] for s in doc["steps"]].index("agent")]["observation"]["results"]
    assert results[0]["source_call_id"] == first_call and "source_call_id" not in results[-1]
    (tmp_path / "rl.json").write_text(json.dumps(doc))
    res = import_inputs([tmp_path / "rl.json"])
    assert not res.rejects, res.rejects
    (back,) = res.trajectories
    assert [s["inner_loss"] for s in back["meta"]["rl_steps"]] == losses
    assert check_token_ids(back, tok) == []
    back["meta"]["rl_steps"][0]["prompt_token_ids"] = back["meta"]["rl_steps"][0]["prompt_token_ids"][:-1]
    (problem,) = check_token_ids(back, tok)
    assert "agent step 1: prompt_token_ids differ from the re-tokenisation" in problem
