"""evals/adaptation_report.py on hand-written results.json files: the issue-7 keys and values, the
target logic, and the refusals (missing file or key, wrong context policy, different checkpoints).
Run: python -m pytest tests/unit/test_adaptation_report.py
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib

import pytest

from ds_ttt.evaluation.adaptation import targets

REPO = pathlib.Path(__file__).resolve().parents[2]
CKPT = {"kind": "checkpoint", "path": "runs/main/step_40", "sha256": "a" * 64, "step": 40, "config_sha256": "c" * 64}
EXPORT = {"kind": "export", "path": "runs/main/export", "sha256": "a" * 64, "export_sha256": "e" * 64, "step": 40,
          "config_sha256": "c" * 64}


def load_cli():
    spec = importlib.util.spec_from_file_location("adaptation_report_cli", REPO / "evals/adaptation_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def eval_results(policy, mem, rec, ckpt=CKPT):
    def mode(exact, nll):
        return {"action_nll": 1.0, "memory_action_exact": exact[0] / exact[1],
                "memory_action_exact_count": list(exact), "memory_action_nll": 0.5, "recovery_action_nll": nll,
                "recovery_action_nll_lo": nll - 0.1, "recovery_action_nll_hi": nll + 0.1,
                "recovery_action_tokens": 40, "recovery_rounds": 4}

    return {"format": "ds_ttt-eval-v1", "context_policy": policy, "context_policy_trained": "current_round",
            "checkpoint": ckpt, "summary": {"ttt": mode(mem[0], rec[0]), "frozen": mode(mem[1], rec[1])}}


def memory_results(policy, worlds, ckpt=CKPT, num_worlds=32):
    return {"format": "ds_ttt-memory-v1", "context_policy": policy, "context_policy_trained": "current_round",
            "checkpoint": ckpt, "seeds": [1_000_000, 1_000_000 + num_worlds - 1],
            "summary": {m: {"worlds_passed": w, "num_worlds": num_worlds} for m, w in zip(("ttt", "frozen"), worlds)}}


def write(d: pathlib.Path, data: dict) -> pathlib.Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps(data))
    return d


@pytest.fixture
def dirs(tmp_path):
    return {
        "eval": write(tmp_path / "eval", eval_results("current_round", ((6, 10), (1, 10)), (0.6, 1.0))),
        "memory": write(tmp_path / "mem", memory_results("current_round", (20, 1))),
        "eval_full": write(tmp_path / "eval_full", eval_results("full", ((9, 10), (8, 10)), (0.5, 0.55))),
        "memory_full": write(tmp_path / "mem_full", memory_results("full", (30, 29), ckpt=EXPORT)),
    }


def args(dirs, out, *extra):
    return ["--eval", str(dirs["eval"]), "--memory", str(dirs["memory"]), "--eval-full", str(dirs["eval_full"]),
            "--memory-full", str(dirs["memory_full"]), "--minutes", "27.5", "--command", "bash run_main.sh",
            "--out", str(out), *extra]


def test_report_keys_values_and_outputs(dirs, tmp_path):
    out = tmp_path / "results" / "adaptation.json"
    run_cfg = tmp_path / "run.json"
    run_cfg.write_text(json.dumps({"preset": "tiny", "seed": 3}))
    assert load_cli().main(args(dirs, out, "--seeds", '{"data": 11, "train": 3}', "--run-config", str(run_cfg))) == 0
    r = json.loads(out.read_text())
    assert r["memory_exact_match_ttt"] == pytest.approx(0.6) and r["memory_exact_match_frozen"] == pytest.approx(0.1)
    assert (r["worlds_passed_ttt"], r["worlds_passed_frozen"]) == (20, 1)
    assert (r["recovery_nll_ttt"], r["recovery_nll_frozen"]) == (0.6, 1.0)
    points = {k: v for k, v in r["full_context"].items() if not k.endswith(("_lo", "_hi"))}
    assert points == {"memory_exact_match_ttt": 0.9, "memory_exact_match_frozen": 0.8,
                      "worlds_passed_ttt": 30, "worlds_passed_frozen": 29,
                      "recovery_nll_ttt": 0.5, "recovery_nll_frozen": 0.55}
    # every number carries its 95% interval: Wilson for rates (worlds as counts of 32), bootstrap NLLs passed on
    from ds_ttt.evaluation.intervals import wilson_interval
    assert (r["memory_exact_match_ttt_lo"], r["memory_exact_match_ttt_hi"]) == wilson_interval(6, 10)
    assert r["worlds_passed_ttt_lo"] == pytest.approx(wilson_interval(20, 32)[0] * 32)
    assert r["worlds_passed_ttt_lo"] < 20 < r["worlds_passed_ttt_hi"] <= 32
    assert (r["recovery_nll_ttt_lo"], r["recovery_nll_ttt_hi"]) == pytest.approx((0.5, 0.7))
    assert r["minutes"] == 27.5 and r["command"] == "bash run_main.sh"
    assert r["counts"]["current_round"]["memory_exact_match_ttt"] == [6, 10]
    assert r["counts"]["current_round"]["worlds_passed_frozen"] == [1, 32]
    assert r["counts"]["full"]["recovery_nll_ttt"] == {"rounds": 4, "tokens": 40}
    assert r["context_policy"]["eval_full"] == {"used": "full", "trained": "current_round"}
    assert all(t["met"] for t in r["targets"].values()) and r["all_targets_met"]
    assert r["seeds"]["given"] == {"data": 11, "train": 3} and r["seeds"]["memory_worlds"] == [1_000_000, 1_000_031]
    src = r["sources"]["memory_full"]
    assert src["sha256"] == hashlib.sha256((dirs["memory_full"] / "results.json").read_bytes()).hexdigest()
    assert src["checkpoint"]["export_sha256"] == "e" * 64  # the export of the evaluated checkpoint is accepted
    assert r["run_config"]["config"] == {"preset": "tiny", "seed": 3} and len(r["run_config"]["sha256"]) == 64
    md = out.with_suffix(".md").read_text()
    assert "| memory_exact_match_ttt_abs | >= 0.5 | 0.600 | met |" in md
    cells = [f"{w} ({w}/32) [{wilson_interval(w, 32)[0] * 32:.3f}, {wilson_interval(w, 32)[1] * 32:.3f}]"
             for w in (20, 1, 30, 29)]
    assert "| memory test worlds passed | " + " | ".join(cells) + " |" in md
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_target_logic():
    base = {"memory_exact_match_ttt": 0.6, "memory_exact_match_frozen": 0.2, "worlds_passed_ttt": 16,
            "worlds_passed_frozen": 2, "recovery_nll_ttt": 0.8, "recovery_nll_frozen": 1.0}
    t = targets(base, 32)
    assert all(v["met"] for v in t.values())  # every threshold is inclusive
    t = targets({**base, "memory_exact_match_ttt": 0.49, "memory_exact_match_frozen": 0.0, "worlds_passed_ttt": 15,
                 "worlds_passed_frozen": 3, "recovery_nll_ttt": 0.81}, 32)
    assert not any(v["met"] for k, v in t.items() if k != "memory_exact_match_ttt_vs_frozen")
    assert t["memory_exact_match_ttt_vs_frozen"]["met"]  # frozen 0: met iff ttt > 0
    t = targets({**base, "memory_exact_match_ttt": 0.0, "memory_exact_match_frozen": 0.0}, 32)
    assert not t["memory_exact_match_ttt_vs_frozen"]["met"] and not t["memory_exact_match_ttt_abs"]["met"]
    t = targets({**base, "memory_exact_match_ttt": 0.59, "memory_exact_match_frozen": 0.2}, 32)
    assert not t["memory_exact_match_ttt_vs_frozen"]["met"] and t["memory_exact_match_ttt_abs"]["met"]
    t = targets({**base, "memory_exact_match_ttt": None, "recovery_nll_frozen": None}, 32)
    assert not t["memory_exact_match_ttt_abs"]["met"] and not t["recovery_nll_ttt_vs_frozen"]["met"]
    t = targets(base, 8)  # a smaller memory test never meets the 32-world targets
    assert not t["worlds_passed_ttt"]["met"] and not t["worlds_passed_frozen"]["met"] and "8 worlds" in t[
        "worlds_passed_ttt"]["note"]


def test_refusals(dirs, tmp_path, capsys):
    out = tmp_path / "adaptation.json"
    cli = load_cli()

    def refused(match):
        assert cli.main(args(dirs, out)) == 2
        err = capsys.readouterr().err
        assert "refused" in err and match in err, err
        assert not out.exists()

    (dirs["memory"] / "results.json").unlink()
    refused(f"{dirs['memory'] / 'results.json'}: no such results file")
    write(dirs["memory"], memory_results("current_round", (20, 1)))

    data = eval_results("current_round", ((6, 10), (1, 10)), (0.6, 1.0))
    del data["summary"]["frozen"]["recovery_action_nll"]
    write(dirs["eval"], data)
    refused(f"{dirs['eval'] / 'results.json'}: missing key 'summary.frozen.recovery_action_nll'")

    write(dirs["eval"], eval_results("full", ((6, 10), (1, 10)), (0.6, 1.0)))  # the full run passed as --eval
    refused("context_policy is 'full', but --eval needs a run with 'current_round'")
    write(dirs["eval"], eval_results("current_round", ((6, 10), (1, 10)), (0.6, 1.0)))

    other = {**CKPT, "sha256": "b" * 64, "path": "runs/other/step_40"}
    write(dirs["memory"], memory_results("current_round", (20, 1), ckpt=other))
    refused("come from different checkpoints")
    write(dirs["memory"], memory_results("current_round", (20, 1), ckpt={**CKPT, "config_sha256": "d" * 64}))
    refused("different trained configs")
    write(dirs["memory"], memory_results("current_round", (20, 1)))
    assert cli.main(args(dirs, out)) == 0
