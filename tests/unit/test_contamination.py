"""The contamination check on a tiny generated corpus and a tiny suite.

  * a training trajectory's world, regenerated from its seed without a sandbox, is exactly what the
    generator wrote before its first command (in a real sandbox);
  * a task planted as a copy of a training episode (instruction and every setup file) is refused by
    name, with the training trajectory it equals; the same world under another instruction is reported,
    not refused; instruction overlap is counted per kind; a clean suite passes;
  * `contaminated` answers for a TaskSpec-like object, for an (instruction, files) pair and for a task
    directory;
  * a prepared manifest contributes its train split only (the main job's `--train-only` extra episodes
    included).

Run: python -m pytest tests/unit/test_contamination.py
"""

from __future__ import annotations

import json
import shutil
import types

import pytest

from ds_ttt.data import generator
from ds_ttt.data.cli import generate_main, prepare_main
from ds_ttt.evaluation.contamination import (build_training_index, contaminated, load_training_trajectories,
                                             regenerate_world)
from ds_ttt.tasks.suite import SUITE_FILE, SUITE_FORMAT
from evals.contamination import main as contamination_main
from tests.harbor.scripted_agent import TASK_DIR


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The main job's two generator runs in miniature: seed 0 (families drawn) and seed 1 (--family memory)."""
    root = tmp_path_factory.mktemp("corpus")
    assert generate_main(["--out", str(root / "raw"), "--num", "6", "--seed", "0", "--workers", "1",
                          "--no-token-stats"]) == 0
    assert generate_main(["--out", str(root / "raw_extra"), "--num", "3", "--seed", "1", "--family", "memory",
                          "--workers", "1", "--no-token-stats"]) == 0
    return [root / "raw", root / "raw_extra" / "trajectories.jsonl"]


def write_task(root, task_id: str, kind: str, instruction: str, files) -> None:
    d = root / task_id
    (d / "environment").mkdir(parents=True)
    (d / "instruction.md").write_text(instruction)
    (d / "task.toml").write_text(f'[metadata]\nds_ttt_kind = "{kind}"\n')
    for rel, text, mode in files:
        p = d / "environment" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        p.chmod(mode)


def write_suite_json(root, tasks: list[tuple[str, str, bool]]) -> None:
    (root / SUITE_FILE).write_text(json.dumps({
        "format": SUITE_FORMAT, "split": "test", "seed_base": 0, "num_per_kind": 1, "num_tasks": len(tasks),
        "sha256": "-", "kinds": {k: {"family": "f", "seen": s} for _, k, s in tasks},
        "tasks": [{"id": i, "kind": k, "family": "f", "seen": s, "check": "state", "seed": 0} for i, k, s in tasks]}))


def test_a_regenerated_world_is_what_the_generator_wrote(corpus, monkeypatch):
    trajs, _ = load_training_trajectories(corpus)
    written = []
    real_write, real_act = generator.Episode.write, generator.Episode.act

    def write(self, rel, text, mode=None):
        if not getattr(self, "acted", False):
            written.append((rel, text, 0o644 if mode is None else mode))
        return real_write(self, rel, text, mode)

    def act(self, *args, **kwargs):
        self.acted = True
        return real_act(self, *args, **kwargs)

    monkeypatch.setattr(generator.Episode, "write", write)
    monkeypatch.setattr(generator.Episode, "act", act)
    for t in (trajs[0], trajs[-1]):  # one of each run
        written.clear()
        seed, index = map(int, t["id"].split("-")[1:])
        again = generator.generate_one(seed, index, "memory" if seed == 1 else None)
        assert again["messages"] == t["messages"]
        assert regenerate_world(t) == written and written, t["id"]


def test_a_planted_training_episode_is_refused_by_name(corpus, tmp_path, capsys):
    trajs, sources = load_training_trajectories(corpus)
    index = build_training_index(trajs, sources)
    assert index.num_trajectories == 9 and not index.not_regenerated
    planted, reworded = trajs[0], trajs[1]
    instruction = next(m["content"] for m in planted["messages"] if m["role"] == "user")
    other = next(m["content"] for m in reworded["messages"] if m["role"] == "user")
    suite = tmp_path / "suite"
    write_task(suite, "test-copy-000", "copied", instruction, regenerate_world(planted))
    write_task(suite, "test-reworded-000", "reworded", other + " Reply with only the number, nothing else.",
               regenerate_world(reworded))
    shutil.copytree(TASK_DIR, suite / "count-lines")
    toml = suite / "count-lines" / "task.toml"
    toml.write_text(toml.read_text().replace("[metadata]\n", '[metadata]\nds_ttt_kind = "count_lines"\n'))
    write_suite_json(suite, [("test-copy-000", "copied", True), ("test-reworded-000", "reworded", True),
                             ("count-lines", "count_lines", False)])

    out = tmp_path / "report.json"
    assert contamination_main(["--suite", str(suite), "--training", *map(str, corpus), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "CONTAMINATED: test-copy-000" in err and planted["id"] in err and "test-reworded-000" not in err
    report = json.loads(out.read_text())
    assert not report["clean"]
    assert [(r["task"], r["training"][0]) for r in report["identical"]] == [("test-copy-000", planted["id"])]
    assert [(r["task"], r["training"][0]) for r in report["same_world"]] == [("test-reworded-000", reworded["id"])]
    per_kind = report["instruction_overlap"]["per_kind"]
    assert per_kind["copied"]["exact"] == 1 and per_kind["reworded"] == dict(per_kind["reworded"], exact=0, verbatim=1)
    assert per_kind["count_lines"]["verbatim"] == 0
    assert report["instruction_overlap"]["seen"]["verbatim"]["count"] == 2

    assert contaminated(suite / "test-copy-000", index) and not contaminated(suite / "count-lines", index)
    files = regenerate_world(planted)
    assert contaminated(types.SimpleNamespace(instruction=instruction, files=files), index)
    assert not contaminated((instruction, files[:-1]), index)  # a file less: another world
    assert not contaminated((instruction + " ", files), index)

    shutil.rmtree(suite / "test-copy-000")
    write_suite_json(suite, [("test-reworded-000", "reworded", True), ("count-lines", "count_lines", False)])
    assert contamination_main(["--suite", str(suite), "--training", *map(str, corpus), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["clean"]


def test_a_manifest_contributes_its_train_split(corpus, tmp_path):
    from ds_ttt.data.manifest import load_manifest

    raw, extra = corpus
    assert prepare_main(["--inputs", str(raw / "trajectories.jsonl"), "--train-only", str(extra), "--out",
                         str(tmp_path / "data"), "--test-fraction", "0.3"]) == 0
    trajs, (source,) = load_training_trajectories([tmp_path / "data"])
    train = load_manifest(tmp_path / "data").ids("train")
    assert {t["id"] for t in trajs} == train and source["split"] == "train" and len(train) < 9
    assert not build_training_index(trajs).not_regenerated
