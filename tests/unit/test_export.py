"""Export round trip: shard layout and names (ds_ttt/export.py), our loader (ds_ttt/loading.py: same
logits, same adaptation), transformers' loader (no missing/unexpected keys, same logits as ours with the
prime branch off), the export CLI from a (faked) training checkpoint.
Run: python -m pytest tests/unit/test_export.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from ds_ttt import loading
from ds_ttt.config import TTTConfig
from ds_ttt.export import export_checkpoint, export_model, parse_size, shard_state_dict
from ds_ttt.loading import load_export
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

KINDS = [0] * 5 + ([0, 1, 1, 1, 0, 2, 2, 2, 2, 0]) * 3
ROUNDS = [0] * 5 + [r for r in (1, 2, 3) for _ in range(10)]


def trained_like_model(cfg, **ttt):
    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(**ttt))
    with torch.no_grad():  # a "trained" model: non-zero prime branch, non-unit norms
        for layer in model.adaptive_layers:
            layer.prime_mlp.down_proj.weight.normal_(0, 0.05)
            layer.prime_layernorm.weight.uniform_(0.5, 1.5)
    return model.eval()


def batch(vocab=256):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, len(KINDS)), generator=g)
    return ids, torch.tensor([KINDS]), torch.tensor([ROUNDS])


def test_parse_size_and_greedy_shards():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("100KiB") == 102400 and parse_size(7) == 7
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("five gigs")
    t = {f"w{i}": torch.zeros(10) for i in range(5)}  # 40 bytes each
    shards = shard_state_dict(t, 100)
    assert [list(s) for s in shards] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert len(shard_state_dict({"big": torch.zeros(1000)}, 10)) == 1  # oversize tensor: its own shard


def test_export_round_trip_names_shards_logits_adaptation_and_hf_load(tmp_path, tiny_qwen3_config):
    model = trained_like_model(tiny_qwen3_config)
    summary = export_model(model, tmp_path, provenance={"step": 7}, max_shard_size="200KB")
    assert summary["num_shards"] > 1

    # layout: standard names in the index, every shard listed exists, prime weights beside them
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    hf_names = set(Qwen3ForCausalLM(tiny_qwen3_config).state_dict())
    assert set(index["weight_map"]) == hf_names
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    for shard in shards:
        with safe_open(str(tmp_path / shard), "pt") as f:
            assert {n for n, s in index["weight_map"].items() if s == shard} == set(f.keys())
    with safe_open(str(tmp_path / "prime.safetensors"), "pt") as f:
        prime_names = set(f.keys())
    assert prime_names == {n for n, _ in model.named_parameters() if ".prime_" in n}
    assert len(prime_names) == 4 * model.num_adaptive
    meta = json.loads((tmp_path / "ttt_config.json").read_text())
    assert meta["ttt"] == model.ttt.to_dict() and meta["provenance"] == {"step": 7}
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]

    # our loader: same logits and the same adaptation along a trajectory
    loaded = load_export(tmp_path)
    ids, kinds, rounds = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
        a = model.trajectory_loss(ids, kinds, rounds, create_graph=False, record=True)
        b = loaded.trajectory_loss(ids, kinds, rounds, create_graph=False, record=True)
    assert a.num_updates == b.num_updates == 3
    torch.testing.assert_close(b.loss, a.loss, rtol=0, atol=0)
    for wa, wb in zip(a.final_weights[0], b.final_weights[0]):
        torch.testing.assert_close(wb, wa, rtol=0, atol=0)
    assert not any(p.requires_grad for p in loaded.parameters())

    # transformers' loader: the backbone with no missing/unexpected keys == ours with prime branch off
    hf, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info.get("mismatched_keys")
    off = load_export(tmp_path)
    with torch.no_grad():
        for layer in off.adaptive_layers:
            layer.prime_mlp.down_proj.weight.zero_()
        torch.testing.assert_close(hf.eval()(ids).logits, off(ids), rtol=1e-5, atol=1e-5)
        assert (model(ids) - off(ids)).abs().max() > 1e-4  # the prime branch matters in the trained model


def test_sft_baseline_without_prime_layers_round_trips(tmp_path, tiny_qwen3_config):
    model = trained_like_model(tiny_qwen3_config, adaptive_layers=0, trainable_scope="all")
    export_model(model, tmp_path)
    assert not (tmp_path / "prime.safetensors").exists()
    loaded = load_export(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)


def test_load_export_rejects_a_tampered_prime_file(tmp_path, tiny_qwen3_config):
    model = trained_like_model(tiny_qwen3_config)
    export_model(model, tmp_path)
    from safetensors.torch import load_file, save_file

    prime = load_file(str(tmp_path / "prime.safetensors"))
    prime.pop(sorted(prime)[0])
    save_file(prime, str(tmp_path / "prime.safetensors"))
    with pytest.raises(KeyError, match="incomplete"):
        load_export(tmp_path)


def test_export_from_a_training_checkpoint(tmp_path, tiny_qwen3_config, monkeypatch):
    """checkpoint -> (the trainer's loader, its weights faked here; its RunInfo real) -> export with
    provenance (weights-only checkpoint hash), the trainer's data_ids.json and the tokenizer."""
    from ds_ttt.train.run_record import RunInfo

    tiny_qwen3_config.vocab_size = 151936  # Qwen3's vocabulary: the export may take Qwen3's own tokenizer
    model = trained_like_model(tiny_qwen3_config, context_policy="current_round")
    ckpt = tmp_path / "run" / "step_00000012"
    ckpt.mkdir(parents=True)
    (ckpt / "layer_00-model_states.pt").write_bytes(b"weights")
    (ckpt / "run_config.json").write_text("{}")
    (ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optimizer")
    stages = {"stages": [{"data_stage": 0, "manifest": "m", "sha256": "ab" * 32, "train": ["t1"], "test": ["t2"]}]}
    (ckpt / "data_ids.json").write_text(json.dumps(stages))
    info = RunInfo(checkpoint=ckpt, step=12, backbone={}, ttt=model.ttt.to_dict(), run={}, deepspeed={}, plan={},
                   manifest_path=str(tmp_path / "nodata" / "manifest.json"), manifest_sha256="ab" * 32,
                   model_source={"preset": "tiny"}, layout={})
    monkeypatch.setattr(loading, "load_training_checkpoint", lambda path, device="cpu": (model, info))
    summary = export_checkpoint(tmp_path / "run", tmp_path / "export", max_shard_size="1MB")
    meta = json.loads((tmp_path / "export" / "ttt_config.json").read_text())
    prov = meta["provenance"]
    assert prov["step"] == 12 and prov["manifest_sha256"] == "ab" * 32 and prov["source_kind"] == "checkpoint"
    assert prov["resolved"] == str(ckpt) and prov["model_source"] == {"preset": "tiny"}
    assert prov["sha256"] == loading.checkpoint_sha256(ckpt)
    (ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"other optimizer state")
    assert loading.checkpoint_sha256(ckpt) == prov["sha256"]  # optimizer states are not the model
    (ckpt / "layer_00-model_states.pt").write_bytes(b"other weights")
    assert loading.checkpoint_sha256(ckpt) != prov["sha256"]
    assert json.loads((tmp_path / "export" / "data_ids.json").read_text()) == stages
    assert meta["ttt"]["context_policy"] == "current_round"
    assert summary["num_prime_tensors"] == 8
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert tok.chat_template and "<tool_call>" in tok.chat_template
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    loaded = loading.load_for_inference(tmp_path / "export")
    assert loaded.provenance["data_ids_path"] == str(tmp_path / "export" / "data_ids.json")
    with pytest.raises(ValueError, match="new directory"):
        export_checkpoint(tmp_path / "export", tmp_path / "export")


def test_export_cli_help_shows_usage():
    out = subprocess.run([sys.executable, "launch/export.py", "--help"], capture_output=True, text=True, check=True)
    assert "--max-shard-size" in out.stdout and "--checkpoint" in out.stdout


def test_tied_embeddings_export_once_and_load_tied(tmp_path, tiny_qwen3_config):
    """Qwen3-0.6B..4B tie the LM head to the embedding: the export writes the matrix once (safetensors
    refuses shared tensors), says so in config.json, and both loaders tie it again."""
    tiny_qwen3_config.tie_word_embeddings = True
    model = trained_like_model(tiny_qwen3_config)
    assert loading.is_tied(model)
    export_model(model, tmp_path, max_shard_size="200KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = load_export(tmp_path)
    assert loading.is_tied(loaded)
    ids, kinds, rounds = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
        a = model.trajectory_loss(ids, kinds, rounds, create_graph=False)
        b = loaded.trajectory_loss(ids, kinds, rounds, create_graph=False)
    torch.testing.assert_close(b.loss, a.loss, rtol=0, atol=0)
    hf, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    off = load_export(tmp_path)
    with torch.no_grad():
        for layer in off.adaptive_layers:
            layer.prime_mlp.down_proj.weight.zero_()
        torch.testing.assert_close(hf.eval()(ids).logits, off(ids), rtol=1e-5, atol=1e-5)
    # a config that says tied with an untied model (or the reverse) is refused, not exported wrongly
    untied = trained_like_model(tiny_qwen3_config)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    with pytest.raises(ValueError, match="tie_word_embeddings=True but lm_head.weight is not the embedding"):
        export_model(untied, tmp_path / "bad")
