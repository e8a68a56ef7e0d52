"""Loading a model for inference: an export directory or a training checkpoint, with its tokenizer and provenance.

    from ds_ttt.loading import load_for_inference, load_export
    loaded = load_for_inference("EXPORT")      # or a training run: RUN_DIR or one step directory
    loaded.model, loaded.tokenizer, loaded.provenance
    model = load_export("EXPORT")              # TTTQwen3ForCausalLM: same logits, same adaptation

No command line of its own: evals/ (through ds_ttt/evaluation), serving (ds_ttt/serve) and
`export_checkpoint` (ds_ttt/export.py, launch/export.py) load their models here.

The tokenizer is part of the model: an export's ttt_config.json records the sha256 of tokenizer.json (and
of a compact vocabulary's qwen3_ids.json, which must be there: the special ids of a trimmed vocabulary
differ from Qwen3's), `load_for_inference` checks both, and a model whose embedding is smaller than
Qwen3's tokenizer is refused without its own tokenizer (the full Qwen3 tokenizer would give wrong ids).
A training checkpoint's tokenizer is the training manifest's tokenizer/ folder, checked against the
hash recorded at training (run_config.json's "tokenizer" when the trainer writes it, else the hash in
the training manifest whose sha256 run_config.json records).

`load_export` loads the backbone through the same name-checked adapter as Hugging Face checkpoints
(ds_ttt/model/hf_adapter.py) and then requires prime.safetensors to supply exactly the prime
parameters the model lacks — nothing more, nothing less. A tied head (`tie_word_embeddings: true`) is
stored once as the embedding and tied again here, as transformers does.

The export directory's layout is ds_ttt/export.py's (the writer). The names a reader checks — the
format tag, ttt_config.json, data_ids.json — and the hashes both sides record are defined here, and
the writer imports them: export.py depends on this module, never the reverse.

Loading calls down, through public APIs only, and nothing it calls imports it back: a training
checkpoint's weights come from the trainer's reassembly (ds_ttt/train/reassembly.py, through the test
seam `load_training_checkpoint`), what inference needs of its run record from
`RunInfo.inference_record()` (ds_ttt/train/run_record.py), and the concrete attention backend from
FlashBoB's `choose_backend` (ds_ttt/ops/flashbob).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import torch
from safetensors import safe_open
from transformers import Qwen3Config

from ds_ttt.config import TTTConfig
from ds_ttt.data.tokenizer import QWEN3_IDS_FILE, QWEN3_TOKENIZER_SIZE, load_tokenizer
from ds_ttt.model.hf_adapter import copy_checked, load_backbone_weights, load_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
from ds_ttt.ops.flashbob import choose_backend
from ds_ttt.train.run_record import InferenceRecord

EXPORT_FORMAT = "ds_ttt-export-v1"
TTT_CONFIG_FILE = "ttt_config.json"
DATA_IDS_FILE = "data_ids.json"  # the trainer's record of every data stage's train/test ids (exposure checks)


def sha256_file(path: str | pathlib.Path) -> str:
    """sha256 of one file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_sha256(path: str | pathlib.Path) -> str:
    """Hash of a file, or of a directory as sorted (relative path, file sha256) pairs."""
    path = pathlib.Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(path).as_posix()}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def config_sha256(config: Qwen3Config, ttt: TTTConfig) -> str:
    """Hash of the architecture + TTT settings (what decides the model's function given its weights)."""
    backbone = {k: v for k, v in config.to_dict().items()
                if k not in ("transformers_version", "architectures", "dtype", "torch_dtype", "_name_or_path")}
    blob = json.dumps({"backbone": backbone, "ttt": ttt.to_dict()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def checkpoint_sha256(ckpt: str | pathlib.Path) -> str:
    """Hash of a training checkpoint's model weights (DeepSpeed `layer_*model_states.pt`) + run_config.json;
    optimizer states are left out (they do not change the model and are 3x its size). Other paths: tree_sha256."""
    ckpt = pathlib.Path(ckpt)
    files = sorted(ckpt.glob("layer_*model_states.pt")) + [p for p in [ckpt / "run_config.json"] if p.is_file()]
    if not files or not ckpt.is_dir():
        return tree_sha256(ckpt)
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def is_tied(model: TTTQwen3ForCausalLM) -> bool:
    """Whether the LM head shares the embedding's storage (tied embeddings)."""
    return model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def tie_embeddings(model: TTTQwen3ForCausalLM) -> None:
    """lm_head.weight <- the embedding Parameter itself (one tensor, as transformers ties them)."""
    if hasattr(model, "tie_weights"):  # the model's own tying (ds_ttt/model/qwen3.py)
        model.tie_weights()
    else:
        model.lm_head.weight = model.model.embed_tokens.weight


# ---- the tokenizer is part of the model ------------------------------------------------------------
def tokenizer_record(tok_dir: str | pathlib.Path, tokenizer) -> dict:
    """What an export (or a run) records about its tokenizer: file hashes, size, compact or not."""
    tok_dir = pathlib.Path(tok_dir)
    ids_file = tok_dir / QWEN3_IDS_FILE
    return {"sha256": sha256_file(tok_dir / "tokenizer.json"), "size": len(tokenizer),
            "trimmed": ids_file.is_file(), "qwen3_ids_sha256": sha256_file(ids_file) if ids_file.is_file() else None}


def check_tokenizer_fits(tokenizer, config, *, where: str) -> None:
    """Every token id of the tokenizer must have an embedding row."""
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has "
                         f"{config.vocab_size} rows (vocab_size); this is not the tokenizer the model was trained "
                         "with (a compact-vocabulary model needs its own tokenizer/ folder with qwen3_ids.json)")


def _check_hash(path: pathlib.Path, expected: str | None, recorded_in: str) -> None:
    if expected is None:
        return
    got = sha256_file(path) if path.is_file() else None
    if got != expected:
        raise ValueError(f"{path}: sha256 {got or '(file missing)'} but {recorded_in} records {expected}; the "
                         "tokenizer is not the one the model was trained with (restore it from the training data's "
                         "tokenizer/ folder, or re-export the run)")


def _no_tokenizer(where: pathlib.Path, config, why: str):
    """No tokenizer shipped: Qwen3's own is right only for a model with Qwen3's vocabulary."""
    if config.vocab_size < QWEN3_TOKENIZER_SIZE:
        raise FileNotFoundError(
            f"{where}: {why}, and its vocabulary is compact (vocab_size {config.vocab_size} < Qwen3's "
            f"{QWEN3_TOKENIZER_SIZE} tokens), so Qwen3's tokenizer would give wrong ids; restore the training "
            "data's tokenizer/ folder (tokenizer.json + qwen3_ids.json) or re-export the run with launch/export.py")
    return load_tokenizer(), {"source": "qwen3 (built offline; the model has Qwen3's vocabulary)", "sha256": None}


def export_tokenizer(export_dir: pathlib.Path, meta: dict, config):
    """The export's own tokenizer, checked against the hashes ttt_config.json records."""
    rec = meta.get("tokenizer")
    if not (export_dir / "tokenizer.json").is_file():
        if rec:
            raise FileNotFoundError(f"{export_dir}: ttt_config.json records a tokenizer (sha256 {rec['sha256']}) "
                                    "but tokenizer.json is missing; copy the export again")
        return _no_tokenizer(export_dir, config, "the export has no tokenizer.json")
    where = f"{export_dir / TTT_CONFIG_FILE}"
    if rec:
        _check_hash(export_dir / "tokenizer.json", rec["sha256"], where)
        if rec.get("trimmed"):
            _check_hash(export_dir / QWEN3_IDS_FILE, rec["qwen3_ids_sha256"], where)
    tok = load_tokenizer(str(export_dir))
    check_tokenizer_fits(tok, config, where=str(export_dir))
    return tok, {"source": "export", **tokenizer_record(export_dir, tok)}


def checkpoint_tokenizer(record: InferenceRecord, config):
    """A training checkpoint's tokenizer: the one its data was rendered with (the training manifest's
    tokenizer/ folder), checked against the hash recorded at training. That record is run_config.json's
    "tokenizer" entry when the trainer writes one, else the training manifest's (whose own sha256 the
    checkpoint records, so a changed manifest is refused). `record`: `RunInfo.inference_record()`."""
    where = pathlib.Path(record.checkpoint)
    recorded = record.tokenizer or {}
    expected, recorded_in = recorded.get("sha256"), f"{where}/run_config.json"
    tok_dir = pathlib.Path(recorded["dir"]) if recorded.get("dir") else None
    manifest_path = record.manifest_path
    if manifest_path and pathlib.Path(manifest_path).is_file():
        raw = pathlib.Path(manifest_path).read_bytes()
        got = hashlib.sha256(raw).hexdigest()
        if record.manifest_sha256 and got != record.manifest_sha256:
            raise ValueError(f"{manifest_path}: sha256 {got} but {where} was trained on {record.manifest_sha256}; "
                             "the training data (and its tokenizer) changed after training, so the tokenizer cannot "
                             "be verified: restore that manifest directory")
        tok_meta = json.loads(raw)["tokenizer"]
        tok_dir = tok_dir or pathlib.Path(manifest_path).parent / tok_meta["dir"]
        if expected is None:
            expected, recorded_in = tok_meta["hash"], f"the training manifest {manifest_path}"
    if tok_dir is None and record.tokenizer_dir:
        tok_dir = pathlib.Path(record.tokenizer_dir)
    if tok_dir is None or not (tok_dir / "tokenizer.json").is_file():
        if expected is not None:
            raise FileNotFoundError(f"{where}: trained with tokenizer sha256 {expected} ({recorded_in}), but "
                                    f"{tok_dir}/tokenizer.json is missing; restore the training data's tokenizer/")
        return _no_tokenizer(where, config, f"its tokenizer folder {tok_dir} is missing")
    if expected is None and config.vocab_size < QWEN3_TOKENIZER_SIZE:
        raise ValueError(f"{where}: a compact-vocabulary checkpoint whose tokenizer hash is recorded nowhere "
                         f"(training manifest {manifest_path} missing); its tokenizer {tok_dir} cannot be verified")
    _check_hash(tok_dir / "tokenizer.json", expected, recorded_in)
    tok = load_tokenizer(str(tok_dir))
    check_tokenizer_fits(tok, config, where=str(where))
    return tok, {"source": str(tok_dir), "recorded_in": recorded_in, **tokenizer_record(tok_dir, tok)}


def is_export_dir(path: str | pathlib.Path) -> bool:
    """Whether `path` looks like an export directory (ttt_config.json beside config.json)."""
    path = pathlib.Path(path)
    return (path / TTT_CONFIG_FILE).is_file() and (path / "config.json").is_file()


def read_export_meta(export_dir: str | pathlib.Path) -> dict:
    """ttt_config.json of an export; refuses another format tag."""
    path = pathlib.Path(export_dir) / TTT_CONFIG_FILE
    meta = json.loads(path.read_text())
    if meta.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {EXPORT_FORMAT!r} (not a ds_ttt export?)")
    return meta


@torch.no_grad()
def load_export(export_dir: str | pathlib.Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                attention_backend: str | None = None) -> TTTQwen3ForCausalLM:
    """The exported TTT model, in eval mode with frozen parameters (fast weights adapt in copies).

    `attention_backend` overrides the training setting (e.g. "reference" on a machine without the
    compiled op); it changes the kernel, not the function.
    """
    export_dir = pathlib.Path(export_dir)
    meta = read_export_meta(export_dir)
    ttt = TTTConfig.from_dict(meta["ttt"], where=str(export_dir / TTT_CONFIG_FILE))
    if attention_backend is not None:
        ttt = dataclasses.replace(ttt, attention_backend=attention_backend)
    cfg = load_qwen3_config(export_dir)
    dtype = dtype or (cfg.dtype if isinstance(cfg.dtype, torch.dtype) else getattr(torch, str(cfg.dtype or "float32")))
    # Build on the meta device and allocate in the target dtype directly (no random init, no fp32
    # copy of an 8B model); every parameter is then overwritten from the files (checked below).
    with torch.device("meta"):
        model = TTTQwen3ForCausalLM(cfg, ttt)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty makes new Parameters: tie again before loading (one tensor)
        tie_embeddings(model)
    with torch.device(device):  # RoPE's inverse frequencies: recomputed in float32, as transformers does
        model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    missing = set(load_backbone_weights(model, export_dir))
    got: set[str] = set()
    if meta.get("prime_file"):
        params = dict(model.named_parameters())
        with safe_open(str(export_dir / meta["prime_file"]), "pt") as f:
            for name in f.keys():
                if name not in missing:
                    raise KeyError(f"{export_dir / meta['prime_file']}: unexpected tensor {name!r} "
                                   f"(not a prime parameter of this model)")
                copy_checked(params[name], f.get_tensor(name), name=name, where=export_dir / meta["prime_file"])
                got.add(name)
    if missing - got:
        raise KeyError(f"{export_dir}: no weights for {sorted(missing - got)[:5]} (prime.safetensors incomplete?)")
    if cfg.tie_word_embeddings and not is_tied(model):
        raise AssertionError("tied embeddings came apart while loading")
    model.eval().requires_grad_(False)
    return model


# ---- one entry for "a training checkpoint or an export" (evals, export CLI, serving) ----------------
@dataclasses.dataclass
class LoadedModel:
    """What `load_for_inference` returns: the frozen model, its tokenizer and where both came from."""

    model: TTTQwen3ForCausalLM
    tokenizer: object  # the export's / training run's tokenizer (hash-checked), or Qwen3's for a full vocabulary
    provenance: dict  # kind, path, sha256, step, manifest_path, manifest_sha256, config_sha256, data_ids_path,
    #                   tokenizer (source, hashes), attention_backend (concrete) and _requested / _trained


def load_training_checkpoint(path: str | pathlib.Path, device: str = "cpu"):
    """The trainer's loader (ds_ttt/train/reassembly.py) -> (model, RunInfo). One seam for tests: a
    replacement returns a RunInfo (or anything with its `inference_record()`)."""
    from ds_ttt.train.reassembly import load_model_from_checkpoint

    return load_model_from_checkpoint(str(path), device=device)


def resolve_attention_backend(model: TTTQwen3ForCausalLM, backend: str) -> str:
    """The concrete FlashBoB backend `backend` selects for this model's device, dtype and head dim ("auto":
    cuda on a GPU, the cpu kernel on a CPU), by FlashBoB's own rule (`choose_backend`, the one `attention`
    decides by); raises ValueError, naming the fix, if that kernel cannot run the model."""
    attn = model.model.layers[0].self_attn
    weight = attn.q_proj.weight
    try:
        return choose_backend(backend, device=weight.device, dtype=weight.dtype, head_dim=attn.head_dim)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--attention-backend {backend}: {e}") from None


def set_attention_backend(model: TTTQwen3ForCausalLM, backend: str) -> str:
    """Use `backend` ("auto", "reference", "cpu", "cuda") for the model's event-wise attention (the inner
    loop in evaluation, every layer in serving); returns the concrete backend, which the results record."""
    resolved = resolve_attention_backend(model, backend)
    model.ttt = dataclasses.replace(model.ttt, attention_backend=resolved)
    return resolved


def load_for_inference(path: str | pathlib.Path, *, device: str = "cpu", attention_backend: str | None = "reference",
                       hash_files: bool = True) -> LoadedModel:
    """A frozen TTT model from an export directory or a training checkpoint (RUN_DIR or a step dir),
    with its tokenizer (always: the shipped one, hash-checked, or Qwen3's for a full-vocabulary model
    that ships none; a compact vocabulary without its tokenizer is refused) and its provenance.

    attention_backend: "reference" by default (O(N^2) memory, runs anywhere without a build), "auto"
    (the FlashBoB kernel for the device: O(N) memory), "cpu", "cuda", or None to keep the trained
    setting. The concrete backend is recorded as provenance["attention_backend"].
    """
    path = pathlib.Path(path)
    if is_export_dir(path):
        model = load_export(path, device=device)
        meta = read_export_meta(path)
        tokenizer, tok_info = export_tokenizer(path, meta, model.config)
        prov = dict(meta.get("provenance") or {})
        prov.update(kind="export", path=str(path), export_sha256=tree_sha256(path) if hash_files else None,
                    config_sha256=config_sha256(model.config, model.ttt),
                    data_ids_path=str(path / DATA_IDS_FILE) if (path / DATA_IDS_FILE).is_file() else None)
    else:
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such checkpoint or export directory")
        model, info = load_training_checkpoint(path, device=device)
        model.eval().requires_grad_(False)
        record = info.inference_record()
        tokenizer, tok_info = checkpoint_tokenizer(record, model.config)
        resolved = pathlib.Path(record.checkpoint or path)
        prov = {
            "kind": "checkpoint",
            "path": str(path),
            "resolved": str(resolved),
            "sha256": checkpoint_sha256(resolved) if hash_files and resolved.exists() else None,
            "sha256_scope": "layer_*model_states.pt + run_config.json",
            "step": record.step,
            "manifest_path": str(record.manifest_path) if record.manifest_path else None,
            "manifest_sha256": record.manifest_sha256,
            "model_source": record.model_source,
            "config_sha256": config_sha256(model.config, model.ttt),
            "data_ids_path": str(resolved / DATA_IDS_FILE) if (resolved / DATA_IDS_FILE).is_file() else None,
        }
    prov["tokenizer"] = tok_info
    prov["attention_backend_trained"] = model.ttt.attention_backend
    if attention_backend is not None:
        prov["attention_backend_requested"] = attention_backend
        set_attention_backend(model, attention_backend)
    prov["attention_backend"] = model.ttt.attention_backend
    return LoadedModel(model, tokenizer, prov)
