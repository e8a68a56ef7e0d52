"""The closed-loop runner: a model acts with its own actions in a sandbox, the task's own test scores it.

  * a tiny export that memorized the shipped Harbor task's solution (tests/conftest.py scripted_export)
    solves it in process through the batched scheduler: one tool call, one inner update, then the
    answer; frozen takes no update; a random model fails the same task;
  * sampled pass@k: k episodes per task with distinct seeds; greedy attempts are refused;
  * the report: rows with Wilson intervals, paired differences with the exact McNemar test.

Run: python -m pytest tests/unit/test_closed_loop.py
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from ds_ttt.evaluation.agent_report import build_report, mcnemar_exact_p, markdown, paired_success_difference
from ds_ttt.evaluation.closed_loop import run_episodes, score_model_on_tasks, summarize
from ds_ttt.serve.session import AgentModel
from ds_ttt.tasks.suite import SUITE_FILE, SUITE_FORMAT, load_suite
from tests.harbor.scripted_agent import TASK_DIR

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def one_task_suite(tmp_path_factory):
    """The shipped Harbor task as a one-task suite (its task.toml gains the suite's metadata)."""
    root = tmp_path_factory.mktemp("suite")
    shutil.copytree(TASK_DIR, root / "count-lines")
    toml = root / "count-lines" / "task.toml"
    toml.write_text(toml.read_text().replace("[metadata]\n", '[metadata]\nds_ttt_kind = "count_lines"\n'))
    (root / SUITE_FILE).write_text(json.dumps({
        "format": SUITE_FORMAT, "split": "test", "seed_base": 0, "num_per_kind": 1, "num_tasks": 1, "sha256": "-",
        "kinds": {"count_lines": {"family": "explore_edit", "seen": False}},
        "tasks": [{"id": "count-lines", "kind": "count_lines", "family": "explore_edit", "seen": False,
                   "check": "state", "seed": 0}]}))
    return root


def test_a_model_that_learned_the_solution_solves_the_task_in_the_sandbox(scripted_export, one_task_suite):
    agent = AgentModel.load(scripted_export)
    _, tasks = load_suite(one_task_suite)
    (ttt,) = run_episodes(agent, tasks, mode="ttt", max_new_tokens=96, progress=False)
    assert ttt.success and ttt.stop == "answer" and ttt.rounds == 2 and ttt.updates == 1, ttt
    assert json.loads(ttt.actions[0]) == {"command": "wc -l < notes.txt > answer.txt"}
    assert "pass" in ttt.test_log
    # the batched scheduler's thread has ended (one left running inside torch at exit aborts the process)
    assert not [t for t in threading.enumerate() if t.name == "ds_ttt-scheduler"]
    (frozen,) = run_episodes(agent, tasks, mode="frozen", max_new_tokens=96, progress=False)
    assert frozen.updates == 0 and frozen.rounds >= 1
    with pytest.raises(ValueError, match="without adaptive layers"):
        run_episodes(agent, tasks, mode="sft", progress=False)


def test_a_random_model_fails_the_same_task(one_task_suite):
    from tests.unit.test_serve import make_model
    from ds_ttt.data.tokenizer import load_tokenizer

    agent = AgentModel(make_model(context_policy="current_round"), load_tokenizer())
    _, tasks = load_suite(one_task_suite)
    (ep,) = run_episodes(agent, tasks, mode="ttt", max_rounds=2, max_new_tokens=16, progress=False)
    assert not ep.success and "fail" in ep.test_log


def test_sampled_attempts_pass_at_k(scripted_export, one_task_suite):
    agent = AgentModel.load(scripted_export)
    _, tasks = load_suite(one_task_suite)
    with pytest.raises(ValueError, match="temperature > 0"):
        run_episodes(agent, tasks, mode="ttt", attempts=2, progress=False)
    eps = run_episodes(agent, tasks, mode="ttt", attempts=3, temperature=1.0, max_rounds=2, max_new_tokens=96,
                       progress=False)
    assert sorted(e.attempt for e in eps) == [0, 1, 2]
    row = summarize(eps, model="scripted", mode="ttt", attempts=3, temperature=1.0)
    assert row["metric"] == "pass@3" and row["tasks"] == 1 and row["episodes"] == 3
    assert row["solved"] == int(any(e.success for e in eps))


def test_score_model_on_tasks_and_report(scripted_export, one_task_suite):
    scored = score_model_on_tasks(str(scripted_export), str(one_task_suite), label="scripted", max_new_tokens=96,
                                  progress=False)
    assert list(scored["modes"]) == ["ttt", "frozen"]
    row = scored["modes"]["ttt"]["row"]
    assert row["success"] == 1.0 and row["per_family"]["explore_edit"]["solved"] == 1
    assert 0 < row["success_lo"] < 1 and row["success_hi"] == 1.0
    report = build_report([scored], command="test", seeds={}, load={"start": 0.0, "end": 0.0})
    assert [(r["model"], r["mode"]) for r in report["rows"]] == [("scripted", "ttt"), ("scripted", "frozen")]
    (pair,) = report["paired"]
    assert pair["a"] == "scripted/ttt" and pair["b"] == "scripted/frozen" and pair["tasks"] == 1
    assert "| scripted | ttt |" in markdown(report)


def test_paired_statistics():
    assert mcnemar_exact_p(5, 0) == pytest.approx(2 / 32)
    assert mcnemar_exact_p(3, 3) == 1.0 and mcnemar_exact_p(0, 0) == 1.0
    a = {str(i): i < 30 for i in range(100)}
    b = {str(i): i < 10 for i in range(100)}
    d = paired_success_difference(a, b)
    assert d["diff"] == pytest.approx(0.2) and d["a_only"] == 20 and d["b_only"] == 0
    assert 0.1 < d["lo"] < 0.2 < d["hi"] < 0.3 and d["mcnemar_p"] < 1e-5
    with pytest.raises(ValueError, match="same tasks"):
        paired_success_difference(a, {"x": True})


def test_episodes_written_as_atif_for_rl_validate_and_import_losslessly(scripted_export, one_task_suite, tmp_path):
    """trajectory_dir: each episode as ATIF >= 1.7 with per-step token ids, logprobs and inner loss; Harbor's
    own pydantic models accept it (in the Harbor venv) and the importer reads the token ids back equal to a
    re-tokenisation of the messages."""
    import subprocess

    from ds_ttt.data.importers import check_token_ids, import_inputs
    from tests.harbor.scripted_agent import HARBOR_VENV

    agent = AgentModel.load(scripted_export)
    _, tasks = load_suite(one_task_suite)
    (ep,) = run_episodes(agent, tasks, mode="ttt", max_new_tokens=96, progress=False, trajectory_dir=str(tmp_path))
    assert ep.success and ep.rounds == 2, ep
    path = tmp_path / "count-lines-a0.json"
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == "ATIF-v1.7"
    steps = [s for s in doc["steps"] if s["source"] == "agent"]
    assert len(steps) == 2
    for s in steps:
        m = s["metrics"]
        assert len(m["logprobs"]) == len(m["completion_token_ids"]) - 1 == m["completion_tokens"] - 1  # <|im_end|>
        assert all(lp <= 0 for lp in m["logprobs"]) and m["prompt_tokens"] == len(m["prompt_token_ids"])
    first, second = steps[0]["metrics"], steps[1]["metrics"]
    assert second["prompt_token_ids"][:len(first["prompt_token_ids"]) + len(first["completion_token_ids"])] == \
        first["prompt_token_ids"] + first["completion_token_ids"]
    assert isinstance(steps[0]["extra"]["inner_loss"], float) and steps[1]["extra"]["inner_loss"] is None

    result = import_inputs([path])
    assert not result.rejects, result.rejects
    (traj,) = result.trajectories
    assert [s["completion_token_ids"] for s in traj["meta"]["rl_steps"]] == [first["completion_token_ids"],
                                                                            second["completion_token_ids"]]
    assert check_token_ids(traj, agent.tokenizer) == []
    traj["meta"]["rl_steps"][1]["completion_token_ids"][0] += 1  # the check can fail
    assert check_token_ids(traj, agent.tokenizer) == [
        "count-lines-a0: agent step 2: completion_token_ids differ from the re-tokenisation at token 0 "
        f"({len(second['completion_token_ids'])} ids in the file, {len(second['completion_token_ids'])} rendered)"]

    harbor_python = HARBOR_VENV / "bin" / "python"
    if not harbor_python.is_file():
        pytest.skip(f"HARBOR VENV MISSING: {HARBOR_VENV}; create it with `bash setup_harbor.sh` to validate with "
                    "Harbor's ATIF models")
    code = ("import sys; from harbor.models.trajectories import Trajectory; "
            "t = Trajectory.model_validate_json(open(sys.argv[1]).read()); "
            "print(t.schema_version, len(t.steps[3].metrics.completion_token_ids))")
    proc = subprocess.run([str(harbor_python), "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ATIF-v1.7", str(len(second["completion_token_ids"]))]
