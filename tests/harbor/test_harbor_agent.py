"""The Harbor agent end to end, through Harbor's own runner (`harbor run` of the real `harbor` package in
.venv-harbor) on the shipped task tests/assets/harbor/count-lines, in the sandbox-backed environment:

  * the agent's package imports in the Harbor venv without torch;
  * the environment alone: Harbor's oracle agent (the task's solution) earns reward 1, the nop agent 0,
    and a task that needs an image build is refused with a clear error; and its contract driven
    directly (sandbox_env_probe.py): workdir, read-only host /usr, absolute paths inside the sandbox
    root, timeouts, background processes, transfers, no link escapes, stop ends every process, no-network;
  * TTTAgent against `python -m ds_ttt.serve.frontends.http` serving a tiny export that memorized one solution:
    its bash call runs in the environment, the verifier's reward (1) is read by Harbor, the server's
    `ttt.updates` grows by one per tool result (and stays 0 with `--ak ttt=false`), and the ATIF
    trajectory validates with Harbor's own model and imports with data_prep/prepare.py.

Run: python -m pytest tests/harbor -q   (skips, loudly, only when .venv-harbor is missing: bash setup_harbor.sh)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from tests.harbor.scripted_agent import (FINAL_ANSWER, HARBOR_VENV, REPO, SOLUTION_COMMAND, TASK_DIR, harbor_env,
                                         scripted_conversation)

AGENT = "ds_ttt.serve.frontends.harbor_agent:TTTAgent"
ENVIRONMENT = "ds_ttt.serve.frontends.harbor_env:SandboxEnvironment"


def harbor_run(jobs_dir, job_name: str, *args: str, task=TASK_DIR) -> subprocess.CompletedProcess:
    argv = [str(HARBOR_VENV / "bin" / "harbor"), "run", "-p", str(task), "--env", ENVIRONMENT, "-o", str(jobs_dir),
            "--job-name", job_name, "-n", "1", "-q", "-y", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, env=harbor_env(), cwd=REPO)


def harbor_trial(jobs_dir, job_name: str, *args: str) -> tuple[dict, object]:
    """`harbor run` of one trial; returns (the trial's result.json, the trial directory)."""
    proc = harbor_run(jobs_dir, job_name, *args)
    trials = [p for p in (jobs_dir / job_name).iterdir() if p.is_dir()] if (jobs_dir / job_name).is_dir() else []
    assert len(trials) == 1 and (trials[0] / "result.json").is_file(), (
        f"harbor run made {len(trials)} trials (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((trials[0] / "result.json").read_text()), trials[0]


def exception_of(result: dict) -> str:
    info = result.get("exception_info")
    return "" if info is None else f"{info['exception_type']}: {info['exception_message']}"


def test_agent_and_environment_import_without_torch(harbor_python):
    """The Harbor venv has no torch: importing the agent's package must not pull it in."""
    code = ("import sys, ds_ttt.serve.frontends.harbor_agent, ds_ttt.serve.frontends.harbor_env; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([str(harbor_python), "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, ("the Harbor venv cannot import the agent (ds_ttt/serve/__init__.py must not import "
                                  f"torch eagerly):\n{proc.stderr[-2000:]}")


def test_sandbox_environment_runs_harbor_trials(harbor_python, tmp_path):
    oracle, trial = harbor_trial(tmp_path, "oracle", "--agent", "oracle")
    assert exception_of(oracle) == "" and oracle["verifier_result"]["rewards"] == {"reward": 1.0}
    assert (trial / "verifier" / "reward.txt").read_text().strip() == "1"
    assert "pass" in (trial / "verifier" / "test-stdout.txt").read_text()

    nop, trial = harbor_trial(tmp_path, "nop", "--agent", "nop")
    assert exception_of(nop) == "" and nop["verifier_result"]["rewards"] == {"reward": 0.0}
    assert (trial / "verifier" / "reward.txt").read_text().strip() == "0"

    task = tmp_path / "needs-image"
    shutil.copytree(TASK_DIR, task)
    (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\n")
    refused = harbor_run(tmp_path, "refused", "--agent", "oracle", task=task)
    assert refused.returncode != 0 and "SandboxEnvironment does not build images" in refused.stdout + refused.stderr


def test_sandbox_environment_contract(harbor_python, tmp_path):
    """The environment's own contract, driven directly (sandbox_env_probe.py in the Harbor venv)."""
    proc = subprocess.run([str(harbor_python), str(REPO / "tests" / "harbor" / "sandbox_env_probe.py"),
                           str(TASK_DIR / "environment"), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=harbor_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["pwd"] == "/app\n" and got["notes"] == (TASK_DIR / "environment" / "notes.txt").read_text()
    assert got["home_uid"] == "/root 1000\n"  # an unprivileged uid
    assert got["usr_write"][0] != 0 and "Read-only file system" in got["usr_write"][1]  # the host's /usr is safe
    assert got["absolute_write"] == "1\n" and got["lands_in_root"] == "1\n"  # /logs/... is the sandbox's, downloadable
    assert got["exit_code"] == 7 and got["stderr"] == "oops\n" and got["env"] == "bar\n"
    assert got["background_alive"] == "alive\n"  # a background process outlives its exec, as in `docker exec`
    assert got["timeout"] == "Command timed out after 1 seconds" and got["timeout_sec"] < 10
    assert got["uploaded_dir"] == "Aran\n" and got["uploaded_file"] == "A" and got["downloaded_file"] == "A"
    assert "Read-only file system" in got["upload_outside"]  # / is read-only; the writable mounts are the sandbox's
    assert got["downloaded"] == ["d", "d/x.txt"]  # the link to /etc/passwd was not followed out of the sandbox
    assert got["processes_before_stop"] >= 2 and got["processes_after_stop"] == 0 and got["root_removed"]
    assert got["public_network"] == "unreachable\n"  # no network even for a public task (bubblewrap, docs/sandbox.md)
    assert got["disable_internet"] and got["no_network"] == "unreachable\n"
    assert got["shell"] == got["shell_after"] == "/tmp yes\n" and got["shell_timeout"]  # the persistent shell
    assert "/var/tmp 1" in got["agent_shell"]  # the TTT agent's commands share that shell


def agent_steps(trajectory: dict) -> list[dict]:
    return [s for s in trajectory["steps"] if s["source"] == "agent"]


def test_ttt_agent_solves_the_task_through_harbor(harbor_python, ttt_server, tmp_path):
    options = ["--ak", f"server_url={ttt_server}", "--ak", "max_rounds=4", "--ak", "max_tokens=96"]
    result, trial = harbor_trial(tmp_path, "ttt", "--agent", AGENT, *options)
    assert exception_of(result) == "", exception_of(result)
    assert result["agent_info"]["name"] == "ds-ttt"
    # the verifier ran test.sh in the sandbox and Harbor read its reward file
    assert (trial / "verifier" / "reward.txt").read_text().strip() == "1"
    assert result["verifier_result"]["rewards"] == {"reward": 1.0}

    path = trial / "agent" / "trajectory.json"
    trajectory = json.loads(path.read_text())
    steps = agent_steps(trajectory)
    assert [s["source"] for s in trajectory["steps"][:2]] == ["system", "user"]
    assert trajectory["steps"][1]["message"] == (TASK_DIR / "instruction.md").read_text()
    assert len(steps) == 2, steps
    call = steps[0]["tool_calls"][0]
    assert call["function_name"] == "bash" and call["arguments"] == {"command": SOLUTION_COMMAND}
    assert steps[0]["observation"]["results"] == [{"source_call_id": call["tool_call_id"], "content": "(no output)"}]
    assert "tool_calls" not in steps[1] and steps[1]["message"] == FINAL_ANSWER
    # one inner update per tool result: none before the first reply, one before the second
    assert [s["extra"]["ttt"]["updates"] for s in steps] == [0, 1]
    assert len({s["extra"]["ttt"]["session_id"] for s in steps}) == 1
    metadata = result["agent_result"]["metadata"]
    assert metadata["stop"] == "answer" and metadata["ttt"]["updates"] == 1
    assert result["agent_result"]["n_output_tokens"] > 0

    # Harbor's own ATIF model accepts the file
    check = subprocess.run([str(harbor_python), "-c", "import sys; from harbor.models.trajectories import Trajectory; "
                            "t = Trajectory.model_validate_json(open(sys.argv[1]).read()); print(len(t.steps))",
                            str(path)], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and check.stdout.strip() == "4", check.stderr
    # ... and the project's importer turns it into a training trajectory
    out = tmp_path / "prepared"
    prep = subprocess.run([sys.executable, "data_prep/prepare.py", "--inputs", str(path), "--out", str(out),
                           "--test-fraction", "0"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert prep.returncode == 0, prep.stdout + prep.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["imported_by_format"] == {"atif": 1} and manifest["num_rejects"] == 0
    assert manifest["splits"]["train"]["num_rounds"] == 2
    from ds_ttt.data.render import TokenKind, render_trajectory
    from ds_ttt.data.tokenizer import load_tokenizer

    # the imported trajectory renders the very action tokens the model was trained to produce
    scripted = render_trajectory(scripted_conversation(), load_tokenizer())
    assert manifest["splits"]["train"]["tokens"]["action"] == scripted.count(TokenKind.ACTION)
    # ready for RL: per step token ids and logprobs (the server's return_token_ids), the inner step's loss on
    # the tool result, and token ids equal to a re-tokenisation of the imported messages
    from ds_ttt.data.importers import check_token_ids, import_inputs

    assert trajectory["schema_version"] >= "ATIF-v1.7"
    for step in steps:
        m = step["metrics"]
        assert len(m["logprobs"]) == len(m["completion_token_ids"]) - 1 and len(m["prompt_token_ids"]) == m["prompt_tokens"]
    assert isinstance(steps[0]["extra"]["inner_loss"], float) and steps[1]["extra"].get("inner_loss") is None
    (imported,) = import_inputs([path]).trajectories
    assert [r["inner_loss"] for r in imported["meta"]["rl_steps"]] == [steps[0]["extra"]["inner_loss"], None]
    assert check_token_ids(imported, load_tokenizer()) == []

    frozen, trial = harbor_trial(tmp_path, "frozen", "--agent", AGENT, *options, "--ak", "ttt=false")
    assert exception_of(frozen) == "", exception_of(frozen)
    frozen_steps = agent_steps(json.loads((trial / "agent" / "trajectory.json").read_text()))
    assert [s["extra"]["ttt"]["updates"] for s in frozen_steps] == [0] * len(frozen_steps)


# ---- a fleet's failures: retries, eviction, session cleanup, seeds -------------------------------
AGENT_PROBE = r"""
import asyncio, json, shutil, subprocess, sys, tempfile
from pathlib import Path

from harbor.environments.base import ExecResult
from harbor.models.agent.context import AgentContext

from ds_ttt.serve.frontends.harbor_agent import TTTAgent


class LocalEnvironment:
    # what TTTAgent uses of a Harbor environment: exec (here: bash in a scratch copy of the task's files)
    def __init__(self, root):
        self.root = root

    async def exec(self, command, timeout_sec=None, **kw):
        p = subprocess.run(["bash", "-c", command], cwd=self.root, capture_output=True, text=True, timeout=timeout_sec)
        return ExecResult(stdout=p.stdout, stderr=p.stderr, return_code=p.returncode)

    async def upload_file(self, source_path, target_path):  # absolute paths land under the scratch directory
        target = self.root.parent / "fs" / target_path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source_path, target)


async def attempt(url, env_dir, instruction):
    work = Path(tempfile.mkdtemp())
    root = work / "app"
    shutil.copytree(env_dir, root)
    agent = TTTAgent(logs_dir=work / "logs", server_url=url, max_rounds=4, max_tokens=96, retry_backoff_sec=0.05,
                     api_key="sk-fleet")
    await agent.setup(LocalEnvironment(root))
    context = AgentContext()
    await agent.run(instruction, LocalEnvironment(root), context)
    answer = (root / "answer.txt").read_text().strip() if (root / "answer.txt").exists() else None
    steps = json.loads((work / "logs" / "trajectory.json").read_text())["steps"]
    final = work / "fs" / "logs" / "agent" / "answer.txt"  # the final reply, for tests that read the answer
    return {"metadata": context.metadata, "answer": answer, "num_steps": len(steps),
            "final_reply": final.read_text() if final.exists() else None, "last_message": steps[-1].get("message")}


url, env_dir, instruction = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]).read_text()
print(json.dumps([asyncio.run(attempt(url, env_dir, instruction)) for _ in range(2)]))
"""


def test_ttt_agent_retries_replays_after_eviction_and_deletes_its_session(harbor_python, scripted_export, tmp_path):
    """TTTAgent (Harbor's AgentContext, the real openai client) against the project's server, with
    faults injected in front of it: the first chat request gets a 429 (Retry-After), the next a 503;
    right after the first reply the server evicts the session. The agent retries, replays its history
    into a new session, solves the task, and deletes its session at the end; two attempts draw
    different seeds."""
    import threading
    import time

    from fastapi.responses import JSONResponse

    from ds_ttt.serve import AgentModel
    from ds_ttt.serve.conversations import ConversationStore
    from ds_ttt.serve.frontends.http import bind, create_app, make_server

    store = ConversationStore(AgentModel.load(scripted_export), max_new_tokens=96)
    app = create_app(store, "scripted-export", api_keys=["sk-fleet"])
    faults = [429, 503]  # the first two chat requests fail

    @app.middleware("http")
    async def inject(request, call_next):
        if request.url.path.endswith("/chat/completions") and faults:
            status = faults.pop(0)
            return JSONResponse({"error": {"message": f"injected {status}", "type": "server_error", "param": None,
                                           "code": None}}, status_code=status, headers={"Retry-After": "0"})
        return await call_next(request)

    evicted: list[str] = []
    chat = store.chat

    def chat_then_evict(req, *args, **kwargs):
        result = chat(req, *args, **kwargs)
        if not evicted:  # the first reply's session is evicted right after it is sent
            evicted.append(result.conversation_id)
            with store._lock:
                store._convs.pop(result.conversation_id)
        return result
    store.chat = chat_then_evict

    sock = bind("127.0.0.1", 0)
    srv = make_server(app, sock)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        proc = subprocess.run([str(harbor_python), "-c", AGENT_PROBE, url, str(TASK_DIR / "environment"),
                               str(TASK_DIR / "instruction.md")], capture_output=True, text=True, timeout=600,
                              env=harbor_env(), cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-4000:]
        first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
    for run in (first, second):
        assert run["metadata"]["stop"] == "answer" and run["answer"] == "3", run
        assert run["final_reply"] == run["last_message"] == FINAL_ANSWER  # written where answer tests read it
        assert run["metadata"]["deleted"] is True
    assert first["metadata"]["retries"] == 2 and first["metadata"]["replays"] == 1
    assert first["metadata"]["ttt"]["session_id"] != evicted[0]  # a new session took over after the replay
    assert first["metadata"]["ttt"]["updates"] == 1  # the replay re-learned the tool result
    assert second["metadata"]["retries"] == 0 and second["metadata"]["replays"] == 0
    assert first["metadata"]["seed"] != second["metadata"]["seed"]
    assert len(store) == 0  # every session was deleted by its agent
