"""The trainer adopts a manifest's compact vocabulary for presets and refuses it for real checkpoints.

    .venv/bin/python -m pytest tests/unit/test_train_vocab.py -q
"""

from types import SimpleNamespace

import pytest
from transformers import Qwen3ForCausalLM

from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.train.engine import load_backbone


def manifest(trimmed, size=2632):
    return SimpleNamespace(data={"tokenizer": {"trimmed": trimmed, "vocab_size": size}})


def test_preset_takes_the_padded_compact_vocabulary():
    run = SimpleNamespace(model=None, preset="tiny", data="d/manifest.json")
    assert load_backbone(run, manifest(True)).vocab_size == 2688  # 2632 padded to a multiple of 64
    assert load_backbone(run, manifest(False)).vocab_size == 151936
    assert load_backbone(run).vocab_size == 151936


def test_real_checkpoint_refuses_a_trimmed_manifest(tmp_path):
    Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=256)).save_pretrained(tmp_path)
    run = SimpleNamespace(model=str(tmp_path), preset=None, data="d/manifest.json")
    with pytest.raises(ValueError, match="without --trim-vocab"):
        load_backbone(run, manifest(True))
    assert load_backbone(run, manifest(False)).vocab_size == 256
