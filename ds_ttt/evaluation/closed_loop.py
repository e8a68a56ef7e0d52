"""Closed-loop evaluation: the agent does held-out tasks with its own actions, scored by the tasks' tests.

    from ds_ttt.evaluation.closed_loop import run_episodes, summarize
    episodes = run_episodes(agent, tasks, mode="ttt", attempts=1, temperature=0.0)   # evals/agent_tasks.py
    row = summarize(episodes, model="ttt_current", mode="ttt")

One episode (the training loop's shape; the one episode loop, ds_ttt/serve/episode.py, which the task
CLI and the Harbor agent run too):
  1. a fresh bubblewrap sandbox (ds_ttt/sandbox/) holding the task's environment/ files in /app;
  2. an AgentSession reset with the generator's system prompt, its `bash` tool and the instruction;
  3. until a reply makes no tool call, or `max_rounds` replies: the model generates its action, every
     tool call runs in the episode's persistent shell, and the observation goes back to the session,
     which takes one inner step on its fast weights (mode "ttt"; "frozen" keeps W_0: the ablation;
     "sft": a model without adaptive layers, nothing to update);
  4. the verifier (verifier.py): every process of the agent's sandbox is killed, its files go to a fresh
     sandbox the agent never ran in, the final reply is written to the answer file (ds_ttt/tasks/checks.py,
     ANSWER_PATH), the task's test.sh is placed (never visible to the agent before) and read back, the
     reward directory is new and empty, and the test runs; success = its reward is 1. A final reply that
     is unfinished (cut at max_new_tokens, or an unclosed `<think>` / `<tool_call>`) answers nothing:
     the answer file is empty and the stop is "truncated" (ds_ttt/data/render.py `final_answer`).

Episodes run together: each on its own thread (its sandbox commands overlap the others' decoding), all
model work on one BatchScheduler (ds_ttt/serve/scheduler.py), the server's batched decode, so the
tokens of up to `concurrency` replies are generated in one forward.
With trajectory_dir=DIR every episode is also written as ATIF >= 1.7 for RL (`write_trajectory`: per
agent step its prompt and completion token ids, logprobs and the inner loss of its observation's update).
Greedy (temperature 0, attempts=1) or sampled: `attempts` = k independent samples per task, each with
its own seed; pass@k counts a task solved when any attempt succeeds.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import asdict, dataclass, field

from ds_ttt.evaluation.intervals import wilson_interval
from ds_ttt.evaluation.verifier import run_verifier, run_verifier_each
from ds_ttt.sandbox import Sandbox
from ds_ttt.serve.episode import SessionAgent
from ds_ttt.serve.episode import run_episode as run_episode_loop
from ds_ttt.serve.tools import BashToolRunner
from ds_ttt.tasks.suite import Task

MODES = ("ttt", "frozen", "sft")
AGENT_DIRS = ("/logs", "/tests")  # Harbor's directories, writable by the agent as in Harbor's containers


@dataclass
class EpisodeResult:
    task: str
    kind: str
    family: str
    seen: bool
    attempt: int
    success: bool
    stop: str  # "answer", "max_rounds", "truncated" (the final reply is unfinished), "context_full"
    rounds: int
    updates: int  # inner steps taken (0 in the frozen / sft modes)
    tokens: int  # generated tokens
    seconds: float
    test_log: str = ""
    actions: list = field(default_factory=list)  # the commands, for reading failures (not scored)


def score_outcome(sb: Sandbox, task: Task, answer: str | None) -> tuple[bool, str]:
    """Run the task's test on what the episode left in `sb`: (reward == 1, the test's log). The verifier
    (verifier.py) closes `sb`, killing every process of the agent, and runs the test in a fresh sandbox
    holding the agent's files. `answer` (the final reply) goes to the answer file; None keeps the file
    as the episode left it."""
    return run_verifier(sb, task.test, answer)


def score_outcomes(sb: Sandbox, task: Task, answers: list[str | None]) -> list[tuple[bool, str]]:
    """`score_outcome` for several final replies to what one episode left in `sb` (the agent's files
    carried over once, each answer tested in a verifier sandbox of its own)."""
    return run_verifier_each(sb, task.test, answers)


def verify_task(task: Task, *, nop: bool = True) -> dict:
    """The task's test judged on two known agents: the reference solution (solution/solve.sh, run in one
    shell as Harbor's oracle agent runs it) must pass, and doing nothing (Harbor's nop agent) must fail.
    nop=False judges the oracle only: for a suite the blind-policy gate has passed, whose policy `nothing`
    is that same agent (no command, an empty reply) and has failed every task."""
    out = {}
    agents = [("oracle", (task.path / "solution" / "solve.sh").read_text())] + ([("nop", None)] if nop else [])
    for name, script in agents:
        with Sandbox(timeout=30.0, dirs=AGENT_DIRS) as sb:
            sb.add_tree(task.environment)
            if script is not None:
                sb.put(script.encode(), "/tmp/solve.sh", 0o755)  # not in /tests: the verifier discards that
                sb.run("bash /tmp/solve.sh")
            out[name], out[f"{name}_log"] = score_outcome(sb, task, None if script is not None else "")
    out["valid"] = out["oracle"] and not out.get("nop", False)
    return out


def run_episode(agent, engine, task: Task, *, mode: str, attempt: int = 0, temperature: float = 0.0,
                max_rounds: int = 12, max_new_tokens: int = 256, command_timeout: float = 10.0,
                max_output_chars: int = 2000, seed: int = 0, trajectory_dir: str | None = None) -> EpisodeResult:
    """One task, one attempt: the episode loop (ds_ttt/serve/episode.py) on a fresh session and sandbox,
    then the verifier on what the episode left. With `trajectory_dir`, the episode is also written there as
    ATIF for RL (`write_trajectory`)."""
    from ds_ttt.serve.session import AgentSession, ContextFullError

    t0 = time.perf_counter()
    session = AgentSession(agent, update=(mode == "ttt"), temperature=temperature, seed=seed,
                           max_new_tokens=max_new_tokens)
    res = EpisodeResult(task.id, task.kind, task.family, task.seen, attempt, False, "max_rounds", 0, 0, 0, 0.0)
    answer = ""
    with BashToolRunner(timeout=command_timeout, max_output_chars=max_output_chars, setup_dir=task.environment,
                        dirs=AGENT_DIRS) as tools:
        try:
            engine.run(lambda: session.reset(task.instruction))
        except ContextFullError:  # the task alone fills the context: nothing to score but the untouched files
            res.stop = "context_full"
        else:
            ttt_agent = SessionAgent(session, engine)
            episode = run_episode_loop(ttt_agent, tools, max_rounds=max_rounds)
            answer, res.stop, res.rounds = episode.answer, episode.stop, len(episode.rounds)
            res.tokens, res.updates = ttt_agent.num_generated, session.num_updates
            res.actions = [c.get("function", c).get("arguments") for r in episode.rounds
                           for c in r.message.get("tool_calls") or []]
        res.success, res.test_log = score_outcome(tools.sandbox, task, answer)
    res.seconds = time.perf_counter() - t0
    if trajectory_dir is not None and res.rounds:
        write_trajectory(trajectory_dir, res, session, ttt_agent.turns, episode, mode=mode)
    return res


def write_trajectory(out_dir: str, res: EpisodeResult, session, turns: list[dict], episode, *, mode: str) -> str:
    """`out_dir/<task>-a<attempt>.json`: the episode as ATIF >= 1.7 (ds_ttt/data/atif.py `rl_steps_atif`),
    each agent step with its prompt and completion token ids, logprobs and the inner loss of the update
    its observation made; the outcome in extra.meta. Returns the path."""
    import json
    import pathlib

    from ds_ttt.data.atif import rl_steps_atif

    traj = {"id": f"{res.task}-a{res.attempt}", "source": "closed_loop", "messages": session.messages,
            "tools": session.tools, "meta": {"task": res.task, "kind": res.kind, "mode": mode, "attempt": res.attempt,
                                            "stop": res.stop, "success": res.success, "updates": res.updates}}
    losses = [r.obs_loss if r.outputs is not None else None for r in episode.rounds]
    doc = rl_steps_atif(traj, turns, losses, agent_name="ds_ttt-closed-loop", model_name=f"ds_ttt-{mode}")
    path = pathlib.Path(out_dir) / f"{traj['id']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False))
    return str(path)


def run_episodes(agent, tasks: list[Task], *, mode: str, attempts: int = 1, temperature: float = 0.0,
                 concurrency: int = 16, seed: int = 0, progress: bool = True, **episode_options) -> list[EpisodeResult]:
    """Every task `attempts` times, `concurrency` episodes at once on one batched scheduler."""
    from ds_ttt.serve.scheduler import BatchScheduler

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "sft" and agent.model.num_adaptive:
        raise ValueError("mode 'sft' is for a model without adaptive layers; use 'ttt' or 'frozen' for a TTT model")
    if mode != "sft" and not agent.model.num_adaptive:
        raise ValueError(f"mode {mode!r} needs adaptive layers; this model has none (score it with mode 'sft')")
    if attempts > 1 and temperature <= 0:
        raise ValueError("attempts > 1 needs temperature > 0 (greedy attempts are identical)")
    engine = BatchScheduler(agent, max_batch=concurrency)
    jobs = [(t, a) for a in range(attempts) for t in tasks]
    bar, lock = None, threading.Lock()
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc=f"episodes ({mode})", unit="ep")
    done = []

    def one(job):
        t, a = job
        r = run_episode(agent, engine, t, mode=mode, attempt=a, temperature=temperature,
                        seed=seed + 1_000_003 * a + t.seed, **episode_options)
        with lock:
            done.append(r)
            if bar:
                bar.update(1)
                bar.set_postfix(success=f"{sum(x.success for x in done)}/{len(done)}")
        return r

    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, jobs))
    finally:
        engine.stop()
        bar and bar.close()
    return results


def _rate(outcomes: list[bool]) -> dict:
    n, s = len(outcomes), int(sum(outcomes))
    lo, hi = wilson_interval(s, n)
    return {"n": n, "solved": s, "rate": s / n if n else None, "lo": lo, "hi": hi}


def task_outcomes(episodes: list[EpisodeResult]) -> dict[str, bool]:
    """task id -> solved by any attempt (pass@k; k = 1 for greedy)."""
    out: dict[str, bool] = {}
    for e in episodes:
        out[e.task] = out.get(e.task, False) or e.success
    return out


def summarize(episodes: list[EpisodeResult], *, model: str, mode: str, attempts: int = 1, temperature: float = 0.0,
              seconds: float | None = None) -> dict:
    """One row: success over tasks (pass@k) with a Wilson interval, per family, seen vs unseen kinds."""
    solved = task_outcomes(episodes)
    first = {e.task: e for e in episodes if e.attempt == 0}
    by = lambda key: {v: _rate([solved[t] for t, e in first.items() if getattr(e, key) == v])  # noqa: E731
                      for v in sorted({getattr(e, key) for e in first.values()})}
    overall = _rate(list(solved.values()))
    return {"model": model, "mode": mode, "attempts": attempts, "temperature": temperature,
            "metric": "pass@1" if attempts == 1 else f"pass@{attempts}",
            "episodes": len(episodes), "tasks": overall["n"], "success": overall["rate"],
            "success_lo": overall["lo"], "success_hi": overall["hi"], "solved": overall["solved"],
            "per_family": by("family"), "per_kind": by("kind"),
            "seen": _rate([solved[t] for t, e in first.items() if e.seen]),
            "unseen": _rate([solved[t] for t, e in first.items() if not e.seen]),
            "stops": {s: sum(e.stop == s for e in episodes) for s in sorted({e.stop for e in episodes})},
            "mean_rounds": sum(e.rounds for e in episodes) / max(len(episodes), 1),
            "updates": sum(e.updates for e in episodes), "tokens": sum(e.tokens for e in episodes),
            "seconds": seconds, "solved_ids": sorted(t for t, ok in solved.items() if ok)}


def episode_records(episodes: list[EpisodeResult]) -> list[dict]:
    return [asdict(e) for e in episodes]


def score_model_on_tasks(model_path: str, suite_dir: str, *, label: str, modes: tuple[str, ...] | None = None,
                         attempts: int = 1, temperature: float = 0.0, concurrency: int = 16, seed: int = 0,
                         progress: bool = True, dynamic_eval_from: str | None = None, **episode_options) -> dict:
    """Load a checkpoint or export once and run the suite in each mode (default: ttt and its frozen
    ablation for a TTT model, sft for a model without adaptive layers). What agent_report reads.
    dynamic_eval_from: the SFT model at `model_path` takes that TTT run's inner step (dynamic_eval.py)."""
    from ds_ttt.evaluation.agent_report import SCORED_FORMAT
    from ds_ttt.evaluation.dynamic_eval import load_model_for_scoring
    from ds_ttt.serve.session import AgentModel
    from ds_ttt.tasks.suite import load_suite

    suite, tasks = load_suite(suite_dir)
    model, tokenizer, provenance = load_model_for_scoring(model_path, dynamic_eval_from=dynamic_eval_from)
    agent = AgentModel(model, tokenizer, provenance)
    modes = modes or (("ttt", "frozen") if agent.model.num_adaptive else ("sft",))
    out = {"format": SCORED_FORMAT, "label": label, "model": str(model_path), "provenance": provenance,
           "suite": {k: suite[k] for k in ("split", "seed_base", "num_per_kind", "num_tasks", "sha256", "kinds")},
           "settings": {"attempts": attempts, "temperature": temperature, "concurrency": concurrency, "seed": seed,
                        **episode_options},
           "modes": {}}
    for mode in modes:
        t0 = time.perf_counter()
        episodes = run_episodes(agent, tasks, mode=mode, attempts=attempts, temperature=temperature,
                                concurrency=concurrency, seed=seed, progress=progress, **episode_options)
        seconds = time.perf_counter() - t0
        row = summarize(episodes, model=label, mode=mode, attempts=attempts, temperature=temperature, seconds=seconds)
        out["modes"][mode] = {"row": row, "outcomes": task_outcomes(episodes), "episodes": episode_records(episodes)}
    return out
