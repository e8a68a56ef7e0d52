"""Export a trained TTT model to a Hugging Face directory: the safetensors writer.

    python launch/export.py --checkpoint RUN --out EXPORT [--max-shard-size 5GB] [--dtype bfloat16]

    from ds_ttt.export import export_model, export_checkpoint
    export_model(model, "EXPORT", tokenizer=tok, provenance={...}, max_shard_size="2GB")
    export_checkpoint("RUN", "EXPORT")         # a training checkpoint (or another export), with provenance

Reading an export back (`load_export`, `load_for_inference`) is ds_ttt/loading.py.

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
                                       (+ qwen3_ids.json for a compact vocabulary)
  data_ids.json                        the trainer's train/test ids per data stage (export_checkpoint)

The tokenizer is part of the export: ttt_config.json records the sha256 of tokenizer.json (and of a
compact vocabulary's qwen3_ids.json), which ds_ttt/loading.py checks when it loads the export.

Tied embeddings (`tie_word_embeddings: true`, Qwen3-0.6B..4B): lm_head.weight is the embedding, so it
is written once (as model.embed_tokens.weight; safetensors refuses shared tensors) and tied again at
load, as transformers does.

`transformers.AutoModelForCausalLM.from_pretrained(EXPORT)` reads only the index, so it loads the plain
backbone with no missing or unexpected keys (its logits equal ours with the prime branch off, i.e. with
prime down projections at zero).
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, Qwen3Config

from ds_ttt import loading
from ds_ttt.data.tokenizer import QWEN3_ADDED_TOKENS, QWEN3_IDS_FILE, save_tokenizer
from ds_ttt.loading import DATA_IDS_FILE, EXPORT_FORMAT, TTT_CONFIG_FILE, config_sha256, is_tied, tokenizer_record
from ds_ttt.model.hf_adapter import is_prime_param
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

PRIME_FILE = "prime.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD = "lm_head.weight"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   QWEN3_IDS_FILE)
# Qwen3's end tokens, for a model exported without a tokenizer (a tokenizer gives its own ids)
_QWEN3_TOKEN_IDS = {content: tid for tid, content, _ in QWEN3_ADDED_TOKENS}
IM_END_ID, ENDOFTEXT_ID = _QWEN3_TOKEN_IDS["<|im_end|>"], _QWEN3_TOKEN_IDS["<|endoftext|>"]
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


def export_model(model: TTTQwen3ForCausalLM, out_dir: str | pathlib.Path, *, tokenizer=None,
                 provenance: dict | None = None, max_shard_size: int | str = "5GB",
                 dtype: torch.dtype | None = None) -> dict:
    """Write `model` (and the tokenizer) to `out_dir` in the layout above; returns a summary dict."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + [out / INDEX_FILE, out / PRIME_FILE, out / "generation_config.json",
                                                     out / DATA_IDS_FILE]:
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
        loading.check_tokenizer_fits(tokenizer, model.config, where=str(out))
        save_tokenizer(tokenizer, out)
        meta["tokenizer"] = tokenizer_record(out, tokenizer)
    else:
        for stale in TOKENIZER_FILES:
            (out / stale).unlink(missing_ok=True)
    (out / TTT_CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
    return {"out": str(out), "num_shards": len(shards), "backbone_bytes": total, "num_backbone_tensors": len(backbone),
            "num_prime_tensors": len(prime)}


def export_checkpoint(checkpoint: str | pathlib.Path, out_dir: str | pathlib.Path, *, max_shard_size: int | str = "5GB",
                      dtype: torch.dtype | None = None) -> dict:
    """Training checkpoint (or another export) -> export directory, with provenance, the trainer's
    data_ids.json (so evaluations of the export can still check exposure) and the tokenizer."""
    if pathlib.Path(out_dir).resolve() == pathlib.Path(checkpoint).resolve():
        raise ValueError(f"--out {out_dir} is the checkpoint itself; export into a new directory")
    loaded = loading.load_for_inference(checkpoint, attention_backend=None)
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
