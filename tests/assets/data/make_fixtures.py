"""Writes the small importer fixtures in this folder (committed; rerun only to change them).

    python tests/assets/data/make_fixtures.py

atif/good: an ATIF trajectory + its continuation (trajectory.cont-1.json); atif/bad: one malformed
document per failure kind; atif/orphan: a continuation without its predecessor; openai/: good and
bad JSONL lines; terminus/: Terminus-2 trial folders (good, an unparseable reply, a missing reply).
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def J(p, o):
    p = HERE / p
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(o, indent=1, ensure_ascii=False) + "\n")


def T(p, s):
    p = HERE / p
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(s)


bash_tool = {"name": "bash", "description": "Run a bash command.",
             "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


def agent(i, msg, reasoning, calls, results):
    s = {"step_id": i, "timestamp": f"2025-10-16T14:30:{i:02d}Z", "source": "agent", "model_name": "qwen3-8b", "message": msg,
         "reasoning_content": reasoning,
         "tool_calls": [{"tool_call_id": c, "function_name": "bash", "arguments": {"command": cmd}} for c, cmd in calls]}
    if results is not None:
        s["observation"] = {"results": [{"source_call_id": c, "content": r} for c, r in results]}
    return s


good = {"schema_version": "ATIF-v1.4", "session_id": "sess-good-1",
        "agent": {"name": "terminus-2", "version": "2.0.0", "model_name": "qwen3-8b", "tool_definitions": [bash_tool]},
        "steps": [{"step_id": 1, "timestamp": "2025-10-16T14:30:00Z", "source": "system", "message": "You are a helpful terminal agent."},
                  {"step_id": 2, "timestamp": "2025-10-16T14:30:01Z", "source": "user", "message": "Count the lines in data.csv."},
                  agent(3, "", "Look at the file first.", [("call_1", "head -n 3 data.csv")], [("call_1", "id,name\n1,ann\n2,bob")]),
                  agent(4, "", "Now count.", [("call_2", "wc -l data.csv")], [("call_2", "5 data.csv")]),
                  {"step_id": 5, "timestamp": "2025-10-16T14:30:05Z", "source": "agent", "message": "data.csv has 5 lines.", "reasoning_content": "wc says 5."}],
        "final_metrics": {"total_steps": 5}, "extra": {"meta": {"reward": 1.0}}}
J("atif/good/trajectory.json", good)
cont = {"schema_version": "ATIF-v1.4", "session_id": "sess-good-1", "continued_trajectory_ref": "trajectory.json", "agent": good["agent"],
        "steps": [{"step_id": 1, "source": "system", "message": "You are a helpful terminal agent."},
                  {"step_id": 2, "source": "user", "message": "Summary so far: data.csv has 5 lines. Now print its last line."},
                  agent(3, "", "Use tail.", [("call_9", "tail -n 1 data.csv")], [("call_9", "4,dan")]),
                  {"step_id": 4, "source": "agent", "message": "The last line is 4,dan.", "reasoning_content": "Done."}]}
J("atif/good/trajectory.cont-1.json", cont)


def bad(name, session, mutate):
    b = json.loads(json.dumps(good))
    b["session_id"] = session
    mutate(b)
    J(f"atif/bad/{name}.json", b)


bad("step_order", "bad-order", lambda b: b["steps"][3].update(step_id=7))
bad("unknown_source", "bad-source", lambda b: b["steps"][1].update(source="human"))
bad("call_id", "bad-callid", lambda b: b["steps"][2]["observation"]["results"][0].update(source_call_id="call_404"))
bad("arguments", "bad-args", lambda b: b["steps"][3]["tool_calls"][0].update(arguments="ls -l"))
bad("no_session", "x", lambda b: b.pop("session_id"))
T("atif/bad/truncated.json", json.dumps(good)[:200])
J("atif/orphan/trajectory.cont-2.json", dict(cont, session_id="orphan"))


def oa(i, reasoning, cmd, out):
    return [{"role": "assistant", "content": "", "reasoning_content": reasoning,
             "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": cmd})}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": out}]


good_lines = [
    {"id": "oa-1", "messages": [{"role": "system", "content": "You are a terminal agent."}, {"role": "user", "content": "Where am I?"}]
     + oa(1, "Print the directory.", "pwd", "/home/user")
     + [{"role": "assistant", "content": "You are in /home/user.", "reasoning_content": "pwd answered."}],
     "tools": [{"type": "function", "function": bash_tool}], "meta": {"task": "Where am I?", "reward": 1.0}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "List files, "}, {"type": "text", "text": "then stop."}]},
                  {"role": "assistant", "content": "<think>\nI should run ls.\n</think>\n\n",
                   "tool_calls": [{"id": "x", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
                  {"role": "tool", "tool_call_id": "x", "content": "a.txt\nb.txt\n"},
                  {"role": "assistant", "content": "Two files: a.txt, b.txt."}]},
]
T("openai/good.jsonl", "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in good_lines))
bad_lines = [
    '{"id": "ok-1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}',
    '{"id": "broken", "messages": [',
    json.dumps({"id": "no-messages"}),
    json.dumps({"id": "orphan-tool", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "out"}, {"role": "assistant", "content": "y"}]}),
    json.dumps({"id": "bad-role", "messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}),
    json.dumps({"id": "control-token", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "done<|im_end|>"}]}),
    json.dumps({"id": "bad-args", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "bash", "arguments": "{not json"}}]}, {"role": "tool", "tool_call_id": "a", "content": "z"}]}),
    json.dumps({"id": "wrong-call-id", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "b", "content": "z"}]}),
    json.dumps({"id": "no-action", "messages": [{"role": "user", "content": "x"}]}),
    '{"id": "ok-1", "messages": [{"role": "user", "content": "again"}, {"role": "assistant", "content": "dup"}]}',
]
T("openai/bad.jsonl", "\n".join(bad_lines) + "\n")

task = ("You are an AI assistant tasked with solving command-line tasks in a Linux environment.\n\nTask Description:\n"
        "Create hello.txt containing 'hi'.\n\nCurrent terminal state:\nroot@box:/app# ")


def reply(analysis, plan, cmds, done=False):
    return json.dumps({"analysis": analysis, "plan": plan, "commands": [{"keystrokes": k, "duration": 0.1} for k in cmds], "task_complete": done}, indent=2)


r0 = reply("Empty directory.", "Write the file.", ["echo hi > hello.txt\n"])
r1 = reply("File written.", "Check it.", ["cat hello.txt\n"])
r2 = "<think>\nThe file has hi.\n</think>\n" + reply("hello.txt contains hi.", "Done.", [], True)
r3 = reply("Confirmed.", "Done.", [], True)
obs1 = "New Terminal Output:\n\nroot@box:/app# echo hi > hello.txt\nroot@box:/app# "
obs2 = "New Terminal Output:\n\nroot@box:/app# cat hello.txt\nhi\nroot@box:/app# "
obs3 = ("Current terminal state:\nroot@box:/app# \n\nAre you sure you want to mark the task as complete? This will trigger your "
        "solution to be graded and you won't be able to make any further changes. If so, include \"task_complete\": true in your JSON response again.")
msgs = [{"role": "user", "content": task}]
eps = [(list(msgs), r0)]
for r, o in [(r0, obs1), (r1, obs2), (r2, obs3)]:
    msgs = msgs + [{"role": "assistant", "content": r}, {"role": "user", "content": o}]
    eps.append((list(msgs), {r0: r1, r1: r2, r2: r3}[r]))
for trial, mutate in [("trial_good", None), ("trial_bad_reply", "bad"), ("trial_missing_response", "missing")]:
    for n, (m, r) in enumerate(eps):
        J(f"terminus/{trial}/agent/episode-{n}/debug.json", {"model": "qwen3-8b", "messages": m, "log_event_type": "post_api_call"})
        if mutate == "missing" and n == 1:
            continue
        T(f"terminus/{trial}/agent/episode-{n}/response.txt", "I think we should run ls" if (mutate == "bad" and n == 2) else r)
    J(f"terminus/{trial}/result.json", {"trial_name": trial, "task_name": "hello-file", "verifier_result": {"rewards": {"reward": 1.0}}})
    T(f"terminus/{trial}/verifier/reward.txt", "1\n")
