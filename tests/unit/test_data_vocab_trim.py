"""Compact vocabulary (prepare.py --trim-vocab): exact on the corpus, lossless everywhere, mapped back to Qwen3.

    .venv/bin/python -m pytest tests/unit/test_data_vocab_trim.py -q
"""

import json

import pytest

from ds_ttt.data.generator import generate
from ds_ttt.data.manifest import load_manifest, prepare
from ds_ttt.data.render import render_trajectory
from ds_ttt.data.tokenizer import build_qwen3_tokenizer
from ds_ttt.data.vocab_trim import trim_tokenizer

CORPUS = ["id,region,amount\n1,north,273", "grep -n 'TODO' src/*.py | wc -l", "cat: config.yml: No such file or directory",
          "Port 8080 is listening; ümlaut 漢字 🚀", "def f(x):\n    return x ** 2\n"]
UNSEEN = ["zzqxj_unseenToken 98123 ∮ ⟨ψ|φ⟩", "assistant amounts northwest", "\t\t  \n\r\n" + "é" * 7]


@pytest.fixture(scope="module")
def full():
    return build_qwen3_tokenizer()


@pytest.fixture(scope="module")
def trimmed(full):
    return trim_tokenizer(full, [full.encode(t, add_special_tokens=False) for t in CORPUS])


def test_corpus_tokenizes_exactly_as_the_full_tokenizer(full, trimmed):
    small, qwen3_ids = trimmed
    assert len(small) == len(qwen3_ids) < 1000
    for text in CORPUS:
        assert [qwen3_ids[i] for i in small.encode(text, add_special_tokens=False)] == full.encode(text, add_special_tokens=False)


def test_every_text_round_trips_and_unseen_words_fall_back_to_kept_pieces(full, trimmed):
    small, qwen3_ids = trimmed
    for text in UNSEEN + CORPUS:
        ids = small.encode(text, add_special_tokens=False)
        assert small.decode(ids) == text
        assert full.decode([qwen3_ids[i] for i in ids]) == text  # the map back to Qwen3 ids is lossless too
    assert len(small.encode(UNSEEN[1], add_special_tokens=False)) > len(full.encode(UNSEEN[1], add_special_tokens=False))


def test_special_tokens_survive_with_their_qwen3_meaning(full, trimmed):
    small, qwen3_ids = trimmed
    for name in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<tool_response>"):
        new = small.convert_tokens_to_ids(name)
        assert qwen3_ids[new] == full.convert_tokens_to_ids(name)
        assert small.encode(name, add_special_tokens=False) == [new]


def test_prepare_with_trim_vocab_renders_train_identically(tmp_path, full):
    raw = tmp_path / "raw.jsonl"
    with open(raw, "w") as f:
        for t in generate(16, 7, workers=1):
            f.write(json.dumps(t) + "\n")
    res = prepare([raw], tmp_path / "data", capacity=2048, test_fraction=0.25, seed=1, trim_vocab=True)
    assert res.exit_code == 0, res.message
    m = load_manifest(tmp_path / "data" / "manifest.json")
    assert m.data["tokenizer"]["trimmed"] and m.data["tokenizer"]["vocab_size"] == len(m.tokenizer())
    qwen3_ids = json.loads((tmp_path / "data" / "tokenizer" / "qwen3_ids.json").read_text())
    by_id = {t["id"]: t for t in m.trajectories("train")}
    for r in m.rendered("train"):
        ref = render_trajectory(by_id[r.id], full)
        assert [qwen3_ids[i] for i in r.input_ids] == ref.input_ids[:len(r.input_ids)]
        assert r.kinds == ref.kinds[:len(r.kinds)] and r.rounds == ref.rounds[:len(r.rounds)]
    for r in m.rendered("test"):  # held-out text still renders (unseen words split into kept pieces)
        assert max(r.input_ids) < len(m.tokenizer())


def test_trim_vocab_refuses_a_real_checkpoint_tokenizer(tmp_path):
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(generate(1, 1, workers=1)[0]) + "\n")
    with pytest.raises(ValueError, match="--trim-vocab"):
        prepare([raw], tmp_path / "d", trim_vocab=True, model_dir=str(tmp_path))


def test_the_id_map_travels_with_the_tokenizer(trimmed, tmp_path):
    """save_tokenizer writes qwen3_ids.json, load_tokenizer reads it back and checks the special tokens
    through it; without the map the compact ids are refused (they are not Qwen3's)."""
    from ds_ttt.data.tokenizer import load_tokenizer, save_tokenizer

    small, qwen3_ids = trimmed
    assert small.qwen3_ids == qwen3_ids
    save_tokenizer(small, tmp_path / "tok")
    assert json.loads((tmp_path / "tok" / "qwen3_ids.json").read_text()) == qwen3_ids
    back = load_tokenizer(str(tmp_path / "tok"))
    assert back.qwen3_ids == qwen3_ids and back.convert_tokens_to_ids("<|im_end|>") == small.convert_tokens_to_ids("<|im_end|>")
    save_tokenizer(back, tmp_path / "again")  # a re-save (as an export does) keeps the map
    assert (tmp_path / "again" / "qwen3_ids.json").read_text() == (tmp_path / "tok" / "qwen3_ids.json").read_text()
    (tmp_path / "tok" / "qwen3_ids.json").unlink()
    with pytest.raises(ValueError, match="no qwen3_ids.json"):
        load_tokenizer(str(tmp_path / "tok"))
    (tmp_path / "tok" / "qwen3_ids.json").write_text(json.dumps(qwen3_ids[:-1]))
    with pytest.raises(ValueError, match="maps .* ids but .* tokens"):
        load_tokenizer(str(tmp_path / "tok"))
