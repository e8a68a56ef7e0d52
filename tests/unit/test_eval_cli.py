"""evals/evaluate.py and evals/memory_test.py end to end on generated data and a tiny exported model:
outputs (results.json, summary.md, PNGs), hashes, the exposure label, x/N worlds and y/2N readbacks.
Run: python -m pytest tests/unit/test_eval_cli.py
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

REPO = pathlib.Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def load_script(rel):
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_")[:-3], REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from ds_ttt.data.generator import generate, write_outputs
    from ds_ttt.data.manifest import load_manifest, prepare

    root = tmp_path_factory.mktemp("evaldata")
    write_outputs(generate(6, seed=11, workers=1), root / "raw")
    assert prepare([root / "raw" / "trajectories.jsonl"], root / "data", test_fraction=0.5, seed=0).exit_code == 0
    assert prepare([root / "raw" / "trajectories.jsonl"], root / "all_train", test_fraction=0.0).exit_code == 0
    return root, load_manifest(root / "data")


@pytest.fixture(scope="module")
def export_dir(data):
    from ds_ttt.export import export_model

    root, man = data
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(context_policy="current_round"))
    with torch.no_grad():
        for layer in model.adaptive_layers:
            layer.prime_mlp.down_proj.weight.normal_(0, 0.3)
    export_model(model, root / "export", tokenizer=man.tokenizer(),
                 provenance={"step": 3, "manifest_sha256": man.sha256, "manifest_path": str(man.path)})
    return root / "export"


def test_evaluate_cli_writes_results_summary_plots_and_hashes(data, export_dir, tmp_path):
    root, man = data
    out = tmp_path / "eval"
    assert load_script("evals/evaluate.py").main(
        ["--checkpoint", str(export_dir), "--manifest", str(root / "data"), "--out", str(out), "--limit", "2"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["modes"] == ["ttt", "frozen"] and res["num_trajectories"] == 2
    assert res["manifest"]["sha256"] == man.sha256 and res["manifest"]["split"] == "test"
    assert res["exposure"]["label"] == "held_out"
    assert res["checkpoint"]["kind"] == "export" and len(res["checkpoint"]["export_sha256"]) == 64
    assert len(res["config"]["sha256"]) == 64 and res["config"]["context_policy"] == "current_round"
    assert res["context_policy"] == res["context_policy_trained"] == "current_round"
    test_ids = sorted(t["id"] for t in man.trajectories("test"))[:2]
    assert [t["id"] for t in res["trajectories"]] == test_ids  # test split only
    for mode in ("ttt", "frozen"):
        s = res["summary"][mode]
        assert s["action_tokens"] > 0 and 0 <= s["action_token_acc"] <= 1 and s["obs_exact_count"][1] > 0
        assert res["per_round"][mode][0]["round"] == 1
    assert res["summary"]["ttt"]["num_updates"] > 0 and res["summary"]["frozen"]["obs_nll_after"] is None
    md = (out / "summary.md").read_text()
    assert "| action NLL |" in md and "held_out" in md and man.sha256[:16] in md
    assert "| memory-check action exact match |" in md and "| recovery action NLL" in md
    for png in ("loss_vs_round.png", "exact_vs_round.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exposure_counts_trajectories_seen_in_training(data):
    from ds_ttt.data.manifest import load_manifest
    from ds_ttt.evaluation.heldout import exposure

    root, man = data
    other = load_manifest(root / "all_train")  # every trajectory in its train split
    exp = exposure({"manifest_path": str(other.path), "manifest_sha256": other.sha256}, man)
    n_test = len(man.trajectories("test"))
    assert exp["label"] == "exposed" and exp["overlap_ids"] == n_test
    assert exposure({}, man)["label"] == "unknown"
    # the trainer's data_ids.json (every data stage's train ids) decides when present
    test_ids = sorted(t["id"] for t in man.trajectories("test"))
    ids_file = root / "data_ids.json"
    ids_file.write_text(json.dumps({"stages": [{"data_stage": 0, "sha256": man.sha256, "train": test_ids[:1], "test": []}]}))
    exp = exposure({"data_ids_path": str(ids_file)}, man)
    assert exp["label"] == "exposed" and exp["overlap_ids"] == 1 and "stage 0" in exp["detail"]
    assert exposure({"data_ids_path": str(ids_file)}, man, ids=set(test_ids[1:]))["label"] == "held_out"


def test_memory_test_cli_reports_worlds_and_readbacks(export_dir, tmp_path):
    out = tmp_path / "mem"
    assert load_script("evals/memory_test.py").main(
        ["--checkpoint", str(export_dir), "--out", str(out), "--num-worlds", "1", "--seed-base", "1000005"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["num_worlds"] == 1 and res["context_policy"] == "current_round"
    assert res["seeds"] == [1_000_005, 1_000_005]
    # the training manifest is known from the export's provenance: fresh values never occur in it
    assert res["contamination"]["checked"] and res["contamination"]["values_found_in_training"] == 0
    for mode in ("ttt", "frozen"):
        s = res["summary"][mode]
        assert s["num_readbacks"] == 2 and s["readbacks"].endswith("/2") and s["worlds"].endswith("/1")
        assert s["num_facts"] == 2
        d = s["diagnostics"]  # the memory diagnostics (memory_diagnostics.py)
        assert d["first_token_count"][1] == 2 and d["by_num_keys"] == {"2": [int(s["worlds_passed"]), 1]}
        assert len(d["passed_ids"]) == s["worlds_passed"]
    (layer,) = res["addressing_margin"].values()  # one adaptive layer, both readbacks have another key's write
    assert layer["readbacks"] == 2 and -2 <= layer["margin"] <= 2
    for w in res["worlds"]:
        assert len(w["ttt"]["readbacks_exact"]) == 2 and w["ttt"]["passed"] == all(w["ttt"]["readbacks_exact"])
    md = (out / "summary.md").read_text()
    assert "| ttt |" in md and "Addressing margin" in md and "Worlds passed:" in md


def test_context_policy_override_is_recorded(data, export_dir, tmp_path):
    root, _ = data
    ev, mem = tmp_path / "eval_full", tmp_path / "mem_full"
    assert load_script("evals/evaluate.py").main(
        ["--checkpoint", str(export_dir), "--manifest", str(root / "data"), "--out", str(ev), "--limit", "1",
         "--no-plots", "--context-policy", "full"]) == 0
    res = json.loads((ev / "results.json").read_text())
    assert (res["context_policy"], res["context_policy_trained"]) == ("full", "current_round")
    assert res["config"]["ttt"]["context_policy"] == "full"
    assert res["config"]["context_policy_trained"] == "current_round"
    for key in ("memory_action_exact_count", "memory_action_nll", "recovery_action_nll", "recovery_rounds"):
        assert key in res["summary"]["ttt"]
    assert "context policy `full` (trained: `current_round`)" in (ev / "summary.md").read_text()
    assert load_script("evals/memory_test.py").main(
        ["--checkpoint", str(export_dir), "--out", str(mem), "--num-worlds", "1", "--seed-base", "1000005",
         "--context-policy", "full"]) == 0
    res = json.loads((mem / "results.json").read_text())
    assert (res["context_policy"], res["context_policy_trained"]) == ("full", "current_round")
    assert "context policy `full` (trained: `current_round`)" in (mem / "summary.md").read_text()
