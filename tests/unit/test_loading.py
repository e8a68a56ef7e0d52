"""Loading for inference through public APIs (ds_ttt/loading.py): a real pipeline checkpoint (reassembled,
its run record read by `RunInfo.inference_record()`) and its export give exactly the provenance results
files read; loading names no private FlashBoB function; nothing loading calls imports it back.

    .venv/bin/python -m pytest -q tests/unit/test_loading.py
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib

import pytest
import torch

from ds_ttt import loading
from ds_ttt.train.run_record import InferenceRecord

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

REPO = pathlib.Path(__file__).resolve().parents[2]
FLASHBOB = "ds_ttt.ops.flashbob"


# ---- loading uses FlashBoB's public API only ------------------------------------------------------
def private_flashbob_uses(source: str) -> list[str]:
    """Private names (a leading underscore) of ds_ttt.ops.flashbob (or a module under it) that `source`
    imports or reads as an attribute of an imported flashbob module, and private flashbob modules."""
    tree = ast.parse(source)
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(FLASHBOB):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(node.module)
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{node.module}.{alias.name}")
                else:
                    modules.add(alias.asname or alias.name)  # maybe a submodule: its attributes are checked
        elif isinstance(node, ast.ImportFrom) and node.module == "ds_ttt.ops":
            modules.update(a.asname or a.name for a in node.names if a.name == "flashbob")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(FLASHBOB):
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(alias.name)
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{ast.unparse(node.value)}.{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in modules
              and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")):
            found.append(f"getattr({node.args[0].id}, {node.args[1].value!r})")
    return found


def test_loading_calls_no_private_flashbob_name():
    assert private_flashbob_uses((REPO / "ds_ttt" / "loading.py").read_text()) == []


@pytest.mark.parametrize("changed", [
    "from ds_ttt.ops.flashbob import _validate as flashbob_resolve\n",  # what loading did before
    "from ds_ttt.ops.flashbob import choose_backend, _check_int\n",
    "import ds_ttt.ops.flashbob\nds_ttt.ops.flashbob._validate(q, k, v, True, None, 0, None, 0, 'auto')\n",
    "from ds_ttt.ops import flashbob as fb\nfb._validate\n",
    "from ds_ttt.ops.flashbob import builder\nbuilder._cache_dir()\n",
    "import ds_ttt.ops.flashbob as fb\ngetattr(fb, '_validate')\n",
])
def test_the_private_name_check_can_fail(changed):
    """The check above on changed copies of loading.py's text, to show it can fail."""
    text = (REPO / "ds_ttt" / "loading.py").read_text()
    assert private_flashbob_uses(text + "\n\ndef _changed(q, k, v):\n" +
                                 "".join("    " + line + "\n" for line in changed.splitlines())) != []


def test_nothing_loading_calls_imports_it_back():
    """The trainer's checkpoint reading, the model and FlashBoB sit below loading.py: none of their
    modules imports ds_ttt.loading (at module level or inside a function)."""
    back = []
    for path in sorted((REPO / "ds_ttt").glob("*/**/*.py")):
        if path.parts[len(REPO.parts) + 1] not in ("train", "model", "ops"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            back += [f"{path.relative_to(REPO)}: {n}" for n in names if n == "ds_ttt.loading" or n.startswith("ds_ttt.loading.")]
    assert back == []


# ---- the run record's public answer for inference ------------------------------------------------
def test_inference_record_names_exactly_the_fields_inference_reads():
    assert [f.name for f in dataclasses.fields(InferenceRecord)] == [
        "checkpoint", "step", "manifest_path", "manifest_sha256", "model_source", "tokenizer", "tokenizer_dir"]


# ---- provenance of a real checkpoint and of its export: keys and values pinned ---------------------
def write_checkpoint(model, run_dir: pathlib.Path, *, step: int, tokenizer: dict | None) -> pathlib.Path:
    """The files a DeepSpeed pipeline save writes for our layers (2 stages) and the run record."""
    from ds_ttt.train import checkpoint as ckpt_mod
    from ds_ttt.train.layout import resolve_layout
    from ds_ttt.train.pipeline import build_specs
    from ds_ttt.train.run_config import RunConfig
    from ds_ttt.train.run_record import DATA_IDS, RUN_CONFIG, resolved_config

    layout = resolve_layout(2, model.config.num_hidden_layers, model.ttt,
                            tied_embeddings=model.config.tie_word_embeddings)
    d = run_dir / ckpt_mod.tag_for(step)
    d.mkdir(parents=True)
    layers = [spec.build() for spec in build_specs(model.config, model.ttt, layout)[:layout.last_spec + 1]]
    if layout.tied_embeddings:  # wired as TTTPipelineModule does: the last stage's head is the embedding
        layers[-1].tie_lm_head(layers[0].embed_tokens.weight)
    full = model.state_dict()
    for idx, layer in enumerate(layers):  # the tied head reference saves no file
        layer.load_state_dict({k: full[layout.hf_name(idx, k)] for k in layer.state_dict()})
        torch.save(layer.state_dict(), d / f"layer_{idx:02d}-model_states.pt")
    run = RunConfig(data="data/manifest.json", output=str(run_dir), ttt=model.ttt)
    res = resolved_config(run=run, backbone=model.config, ds={"pipeline": {"stages": layout.num_stages}}, plan=None,
                          layout=layout, manifest_path=str(run_dir / "data" / "manifest.json"),
                          manifest_sha256="ab" * 32, tokenizer=tokenizer)
    (d / RUN_CONFIG).write_text(json.dumps({**res, "step": step}))
    (d / DATA_IDS).write_text(json.dumps({"stages": [{"data_stage": 0, "train": ["t1"], "test": ["t2"]}]}))
    (d / ckpt_mod.COMPLETE).write_text(d.name)
    (run_dir / ckpt_mod.LATEST).write_text(d.name)
    return d


def test_checkpoint_and_export_provenance_keys_and_values(tmp_path):
    """Results files read these dicts: every key and value of a reassembled checkpoint's provenance (its
    tokenizer verified against run_config.json's record) and of its export's, loaded back."""
    from ds_ttt.config import TTTConfig
    from ds_ttt.data.tokenizer import load_tokenizer, save_tokenizer
    from ds_ttt.export import export_checkpoint
    from ds_ttt.model.presets import tiny_qwen3_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=151936,  # Qwen3's vocabulary
                            tie_word_embeddings=True)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(adaptive_layers=1, prime_intermediate_size=32,
                                               context_policy="current_round"))
    tok_dir = tmp_path / "tokenizer"
    save_tokenizer(load_tokenizer(), tok_dir)
    tok_sha = loading.sha256_file(tok_dir / "tokenizer.json")
    run_dir = tmp_path / "run"
    ckpt = write_checkpoint(model, run_dir, step=7, tokenizer={"dir": str(tok_dir), "sha256": tok_sha})
    cfg_sha = loading.config_sha256(model.config, model.ttt)

    loaded = loading.load_for_inference(run_dir, attention_backend="auto")
    tok = {"sha256": tok_sha, "size": len(loaded.tokenizer), "trimmed": False, "qwen3_ids_sha256": None}
    got = loaded.model.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    assert loaded.provenance == {
        "kind": "checkpoint", "path": str(run_dir), "resolved": str(ckpt), "sha256": loading.checkpoint_sha256(ckpt),
        "sha256_scope": "layer_*model_states.pt + run_config.json", "step": 7,
        "manifest_path": str((run_dir / "data" / "manifest.json").resolve()), "manifest_sha256": "ab" * 32,
        "model_source": {"preset": "tiny"}, "config_sha256": cfg_sha, "data_ids_path": str(ckpt / "data_ids.json"),
        "tokenizer": {"source": str(tok_dir), "recorded_in": f"{ckpt}/run_config.json", **tok},
        "attention_backend_trained": "reference", "attention_backend_requested": "auto", "attention_backend": "cpu"}
    nohash = loading.load_for_inference(ckpt, attention_backend=None, hash_files=False).provenance
    assert nohash["sha256"] is None and nohash["path"] == nohash["resolved"] == str(ckpt)
    assert "attention_backend_requested" not in nohash and nohash["attention_backend"] == "reference"

    export_checkpoint(run_dir, tmp_path / "export")
    exported = loading.load_for_inference(tmp_path / "export")
    assert exported.provenance == {
        "source_kind": "checkpoint", "path": str(tmp_path / "export"), "resolved": str(ckpt),
        "sha256": loading.checkpoint_sha256(ckpt), "sha256_scope": "layer_*model_states.pt + run_config.json",
        "step": 7, "manifest_path": str((run_dir / "data" / "manifest.json").resolve()), "manifest_sha256": "ab" * 32,
        "model_source": {"preset": "tiny"}, "kind": "export", "export_sha256": loading.tree_sha256(tmp_path / "export"),
        # hashed again from the exported config.json, which sets the eos/pad ids for generation
        "config_sha256": loading.config_sha256(exported.model.config, exported.model.ttt),
        "data_ids_path": str(tmp_path / "export" / "data_ids.json"),
        "tokenizer": {"source": "export", **tok, "sha256": loading.sha256_file(tmp_path / "export" / "tokenizer.json")},
        "attention_backend_trained": "reference", "attention_backend_requested": "reference",
        "attention_backend": "reference"}


def test_a_backend_the_model_cannot_run_is_refused_naming_the_fix(tiny_qwen3_config):
    """set_attention_backend asks FlashBoB's choose_backend with the model's device, dtype and head dim."""
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    model = TTTQwen3ForCausalLM(tiny_qwen3_config, TTTConfig(adaptive_layers=1, prime_intermediate_size=32))
    assert loading.set_attention_backend(model, "auto") == "cpu" and model.ttt.attention_backend == "cpu"
    assert loading.set_attention_backend(model, "reference") == "reference"
    with pytest.raises(ValueError, match="--attention-backend cuda: backend 'cuda' needs CUDA tensors.*'reference'"):
        loading.set_attention_backend(model, "cuda")
    with pytest.raises(ValueError, match="--attention-backend cpu: dtype torch.bfloat16 .*use backend='reference'"):
        loading.resolve_attention_backend(model.to(torch.bfloat16), "cpu")
    assert model.ttt.attention_backend == "reference"  # a refused backend changes nothing
