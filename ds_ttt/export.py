"""Export a trained TTT model to a Hugging Face directory, and load such a directory back (`load_export`).

    python launch/export.py --checkpoint RUN --out EXPORT [--max-shard-size 5GB] [--dtype bfloat16]

    from ds_ttt.export import export_model, load_export
    export_model(model, "EXPORT", tokenizer=tok, provenance={...}, max_shard_size="2GB")
    model = load_export("EXPORT")              # TTTQwen3ForCausalLM: same logits, same adaptation

EXPORT/
  config.json                          transformers Qwen3Config (architectures = Qwen3ForCausalLM)
  generation_config.json               eos = <|im_end|>, <|endoftext|>
  model-0000K-of-0000N.safetensors     the backbone under standard Qwen3 names, greedily sharded
  model.safetensors.index.json         {"metadata": {"total_size"}, "weight_map": {name: shard}}
  prime.safetensors                    the meta-learned initial fast weights W_0 and their norms
                                       (model.layers.N.prime_layernorm.weight,
                                        model.layers.N.prime_mlp.{gate,up,down}_proj.weight)
  ttt_config.json                      TTTConfig, the adaptive-layer placement, the prime tensor list
                                       and provenance (checkpoint/manifest/config hashes, step)
  tokenizer.json, tokenizer_config.json, chat_template.jinja

The tokenizer is part of the export: ttt_config.json records the sha256 of tokenizer.json (and of a
compact vocabulary's qwen3_ids.json, which must be there: the special ids of a trimmed vocabulary
differ from Qwen3's), `load_for_inference` checks both, and a model whose embedding is smaller than
Qwen3's tokenizer is refused without its own tokenizer (the full Qwen3 tokenizer would give wrong ids).
A training checkpoint's tokenizer is the training manifest's tokenizer/ folder, checked against the
hash recorded at training (run_config.json's "tokenizer" when the trainer writes it, else the hash in
the training manifest whose sha256 run_config.json records).

Tied embeddings (`tie_word_embeddings: true`, Qwen3-0.6B..4B): lm_head.weight is the embedding, so it
is written once (as model.embed_tokens.weight; safetensors refuses shared tensors) and tied again at
load, as transformers does.

`transformers.AutoModelForCausalLM.from_pretrained(EXPORT)` reads only the index, so it loads the plain
backbone with no missing or unexpected keys (its logits equal ours with the prime branch off, i.e. with
prime down projections at zero). `load_export` loads the backbone through the same name-checked
adapter as Hugging Face checkpoints (ds_ttt/model/hf_adapter.py) and then requires prime.safetensors
to supply exactly the prime parameters the model lacks — nothing more, nothing less.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GenerationConfig, Qwen3Config

from ds_ttt.config import TTTConfig
from ds_ttt.data.tokenizer import QWEN3_IDS_FILE, QWEN3_TOKENIZER_SIZE, load_tokenizer, save_tokenizer
from ds_ttt.model.hf_adapter import copy_checked, is_prime_param, load_backbone_weights, load_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

EXPORT_FORMAT = "ds_ttt-export-v1"
TTT_CONFIG_FILE = "ttt_config.json"
PRIME_FILE = "prime.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IM_END_ID, ENDOFTEXT_ID = 151645, 151643
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """'5GB' / '500MB' / '100KiB' / 12345 -> bytes (decimal units as in transformers' max_shard_size)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size {size!r}: expected a byte count or e.g. '5GB', '500MB', '100KiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2) or "B"])


def shard_state_dict(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy shards in name order; a tensor larger than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def sha256_file(path: str | pathlib.Path) -> str:
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


def export_model(model: TTTQwen3ForCausalLM, out_dir: str | pathlib.Path, *, tokenizer=None,
                 provenance: dict | None = None, max_shard_size: int | str = "5GB",
                 dtype: torch.dtype | None = None) -> dict:
    """Write `model` (and the tokenizer) to `out_dir` in the layout above; returns a summary dict."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + [out / INDEX_FILE, out / PRIME_FILE, out / "generation_config.json",
                                                     out / "data_ids.json"]:
        stale.unlink(missing_ok=True)  # a previous export with more shards must not leave files behind
    tied = is_tied(model)
    if tied != bool(getattr(model.config, "tie_word_embeddings", False)):
        raise ValueError(f"model.config.tie_word_embeddings={model.config.tie_word_embeddings} but lm_head.weight "
                         f"{'is' if tied else 'is not'} the embedding; tie or untie the model to match its config")
    state = {n: p.detach().to("cpu", dtype or p.dtype).contiguous() for n, p in model.state_dict().items()
             if not (tied and n == LM_HEAD)}  # a tied head is the embedding: written once
    backbone = {n: t for n, t in state.items() if not is_prime_param(n)}
    prime = {n: t for n, t in state.items() if is_prime_param(n)}
    shards = shard_state_dict(backbone, parse_size(max_shard_size))
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for n, t in shard.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                                             indent=2) + "\n")
    if prime:
        save_file(prime, str(out / PRIME_FILE), metadata={"format": "pt"})

    cfg = Qwen3Config.from_dict(model.config.to_dict())
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.dtype = dtype or next(model.parameters()).dtype
    # <|im_end|> / <|endoftext|>: the tokenizer's ids (a compact vocabulary has its own), else Qwen3's
    # when the vocabulary has them (tiny test vocabularies without a tokenizer have no such ids)
    ends = ((tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>"))
            if tokenizer is not None else (IM_END_ID, ENDOFTEXT_ID) if cfg.vocab_size > IM_END_ID else None)
    if ends is not None:
        cfg.eos_token_id, cfg.pad_token_id = ends
        GenerationConfig(eos_token_id=list(ends), pad_token_id=ends[1], do_sample=False).save_pretrained(str(out))
    cfg.save_pretrained(str(out))
    meta = {
        "format": EXPORT_FORMAT,
        "ttt": model.ttt.to_dict(),
        "num_adaptive": model.num_adaptive,
        "first_adaptive": model.first_adaptive,
        "prime_file": PRIME_FILE if prime else None,
        "prime_tensors": sorted(prime),
        "config_sha256": config_sha256(model.config, model.ttt),
        "provenance": provenance or {},
        "tokenizer": None,
    }
    if tokenizer is not None:
        check_tokenizer_fits(tokenizer, model.config, where=str(out))
        save_tokenizer(tokenizer, out)
        meta["tokenizer"] = tokenizer_record(out, tokenizer)
    else:
        for stale in TOKENIZER_FILES:
            (out / stale).unlink(missing_ok=True)
    (out / TTT_CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
    return {"out": str(out), "num_shards": len(shards), "backbone_bytes": total, "num_backbone_tensors": len(backbone),
            "num_prime_tensors": len(prime)}


LM_HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "qwen3_ids.json")


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


def checkpoint_tokenizer(info, config):
    """A training checkpoint's tokenizer: the one its data was rendered with (the training manifest's
    tokenizer/ folder), checked against the hash recorded at training. That record is run_config.json's
    "tokenizer" entry when the trainer writes one, else the training manifest's (whose own sha256 the
    checkpoint records, so a changed manifest is refused)."""
    d = _run_info_dict(info)
    where = pathlib.Path(d.get("checkpoint") or "checkpoint")
    recorded = (d.get("raw") or {}).get("tokenizer") or {}
    expected, recorded_in = recorded.get("sha256"), f"{where}/run_config.json"
    tok_dir = pathlib.Path(recorded["dir"]) if recorded.get("dir") else None
    manifest_path = d.get("manifest_path")
    if manifest_path and pathlib.Path(manifest_path).is_file():
        raw = pathlib.Path(manifest_path).read_bytes()
        got = hashlib.sha256(raw).hexdigest()
        if d.get("manifest_sha256") and got != d["manifest_sha256"]:
            raise ValueError(f"{manifest_path}: sha256 {got} but {where} was trained on {d['manifest_sha256']}; the "
                             "training data (and its tokenizer) changed after training, so the tokenizer cannot be "
                             "verified: restore that manifest directory")
        tok_meta = json.loads(raw)["tokenizer"]
        tok_dir = tok_dir or pathlib.Path(manifest_path).parent / tok_meta["dir"]
        if expected is None:
            expected, recorded_in = tok_meta["hash"], f"the training manifest {manifest_path}"
    if tok_dir is None and d.get("tokenizer_dir"):
        tok_dir = pathlib.Path(d["tokenizer_dir"])
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
    path = pathlib.Path(path)
    return (path / TTT_CONFIG_FILE).is_file() and (path / "config.json").is_file()


def read_export_meta(export_dir: str | pathlib.Path) -> dict:
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
DATA_IDS_FILE = "data_ids.json"  # the trainer's record of every data stage's train/test ids (exposure checks)


@dataclasses.dataclass
class LoadedModel:
    model: TTTQwen3ForCausalLM
    tokenizer: object  # the export's / training run's tokenizer (hash-checked), or Qwen3's for a full vocabulary
    provenance: dict  # kind, path, sha256, step, manifest_path, manifest_sha256, config_sha256, data_ids_path,
    #                   tokenizer (source, hashes), attention_backend (concrete) and _requested / _trained


def _run_info_dict(info) -> dict:
    if info is None:
        return {}
    if isinstance(info, dict):
        return dict(info)
    return {k: getattr(info, k) for k in dir(info) if not k.startswith("_") and not callable(getattr(info, k))}


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


def load_training_checkpoint(path: str | pathlib.Path, device: str = "cpu"):
    """The trainer's loader (ds_ttt/train/checkpoint.py) -> (model, RunInfo). One seam for tests."""
    from ds_ttt.train.checkpoint import load_model_from_checkpoint

    return load_model_from_checkpoint(str(path), device=device)


def resolve_attention_backend(model: TTTQwen3ForCausalLM, backend: str) -> str:
    """The concrete FlashBoB backend `backend` selects for this model's device and dtype ("auto": cuda on
    a GPU, the cpu kernel on a CPU), by FlashBoB's own resolution; raises if that kernel cannot run it."""
    # FlashBoB resolves (and checks) its backend from the tensors it gets; ask it with one probe query
    # of this model's device, dtype and head shape, so there is exactly one resolution rule.
    from ds_ttt.ops.flashbob import _validate as flashbob_resolve

    attn = model.model.layers[0].self_attn
    p = attn.q_proj.weight
    q = p.new_zeros(1, attn.config.num_attention_heads, 1, attn.head_dim)
    kv = p.new_zeros(1, attn.config.num_key_value_heads, 1, attn.head_dim)
    try:
        return flashbob_resolve(q, kv, kv, True, None, 0, None, 0, backend)
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
        tokenizer, tok_info = checkpoint_tokenizer(info, model.config)
        d = _run_info_dict(info)
        resolved = pathlib.Path(d.get("checkpoint") or path)
        prov = {
            "kind": "checkpoint",
            "path": str(path),
            "resolved": str(resolved),
            "sha256": checkpoint_sha256(resolved) if hash_files and resolved.exists() else None,
            "sha256_scope": "layer_*model_states.pt + run_config.json",
            "step": d.get("step"),
            "manifest_path": str(d["manifest_path"]) if d.get("manifest_path") else None,
            "manifest_sha256": d.get("manifest_sha256"),
            "model_source": d.get("model_source"),
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


def export_checkpoint(checkpoint: str | pathlib.Path, out_dir: str | pathlib.Path, *, max_shard_size: int | str = "5GB",
                      dtype: torch.dtype | None = None) -> dict:
    """Training checkpoint (or another export) -> export directory, with provenance, the trainer's
    data_ids.json (so evaluations of the export can still check exposure) and the tokenizer."""
    import shutil

    if pathlib.Path(out_dir).resolve() == pathlib.Path(checkpoint).resolve():
        raise ValueError(f"--out {out_dir} is the checkpoint itself; export into a new directory")
    loaded = load_for_inference(checkpoint, attention_backend=None)
    tokenizer = loaded.tokenizer  # the checkpoint's own (checked); Qwen3's only for a full-vocabulary model
    prov = {k: v for k, v in loaded.provenance.items()
            if k not in ("kind", "data_ids_path", "tokenizer") and not k.startswith("attention_backend")}
    prov["source_kind"] = loaded.provenance["kind"]
    summary = export_model(loaded.model, out_dir, tokenizer=tokenizer, provenance=prov, max_shard_size=max_shard_size,
                           dtype=dtype)
    src_ids = loaded.provenance.get("data_ids_path")
    if src_ids and pathlib.Path(src_ids).resolve() != (pathlib.Path(out_dir) / DATA_IDS_FILE).resolve():
        shutil.copyfile(src_ids, pathlib.Path(out_dir) / DATA_IDS_FILE)
    return summary
