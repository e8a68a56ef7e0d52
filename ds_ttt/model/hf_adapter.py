"""Hugging Face <-> ds_ttt weights: load a local Qwen3 checkpoint directory into the TTT model, whole
or one pipeline stage's tensors at a time.

    from ds_ttt.model.hf_adapter import load_hf_qwen3, load_hf_weights
    model = load_hf_qwen3("/models/Qwen3-8B", TTTConfig(), dtype=torch.bfloat16)     # one process
    load_hf_weights({hf_name: parameter, ...}, "/models/Qwen3-8B", config)           # one pipeline stage

Parameter names are identical to transformers' Qwen3ForCausalLM, so loading is a name-checked copy:
every checkpoint tensor must land on a model parameter with the same shape, and the only model
parameters allowed to be missing are the new prime ones (which keep their fresh initialisation,
down projection zero). Both single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`)
layouts are read with safetensors, one shard at a time (never the whole model in memory twice).
"""

from __future__ import annotations

import contextlib
import json
import pathlib

import torch
from safetensors import SafetensorError, safe_open
from transformers import Qwen3Config

from ds_ttt.config import TTTConfig
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM, aliases

PRIME_MARKERS = (".prime_mlp.", ".prime_layernorm.")


def is_prime_param(name: str) -> bool:
    return any(m in name for m in PRIME_MARKERS)


@contextlib.contextmanager
def open_safetensors(path: str | pathlib.Path):
    """safe_open that names the damaged file: a truncated or corrupt shard raises ValueError(path, fix)."""
    try:
        with safe_open(str(path), "pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{path}: not a complete safetensors file ({e}); the checkpoint or export is damaged: "
                         "copy or re-export it") from None


def checkpoint_shards(model_dir: pathlib.Path) -> dict[str, list[str]]:
    """{shard file name: [tensor names]} of a Hugging Face safetensors checkpoint directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
        return shards
    single = model_dir / "model.safetensors"
    if single.exists():
        with open_safetensors(single) as f:
            return {"model.safetensors": list(f.keys())}
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json; "
                            "pass a Hugging Face Qwen3 checkpoint directory (config.json + safetensors)")


def copy_checked(dst: torch.Tensor, src: torch.Tensor, *, name: str, where) -> None:
    """dst <- src (cast to dst's dtype) after checking the shape; the error names the file and tensor."""
    if src.shape != dst.shape:
        raise ValueError(f"{where}: {name} has shape {tuple(src.shape)}, model expects {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def load_qwen3_config(model_dir: str | pathlib.Path) -> Qwen3Config:
    path = pathlib.Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: --model must be a local Qwen3 checkpoint directory")
    cfg = Qwen3Config.from_pretrained(str(model_dir))
    if cfg.model_type != "qwen3":
        raise ValueError(f"{path}: model_type={cfg.model_type!r}, expected 'qwen3'")
    return cfg


@torch.no_grad()
def load_backbone_weights(model: TTTQwen3ForCausalLM, model_dir: str | pathlib.Path) -> list[str]:
    """Copy a checkpoint's tensors into `model`; returns the (prime) parameters left at their init.

    A tied model (`tie_word_embeddings`) has one parameter under both `model.embed_tokens.weight` and
    `lm_head.weight`: a checkpoint without `lm_head.weight` (transformers' save_pretrained drops it)
    fills both; one that also carries it must hold the same values."""
    model_dir = pathlib.Path(model_dir)
    params = dict(model.named_parameters(remove_duplicate=False))  # tied: both names, one Parameter
    loaded: dict[int, str] = {}  # id(parameter) -> the checkpoint name that filled it
    for shard, names in checkpoint_shards(model_dir).items():
        with open_safetensors(model_dir / shard) as f:
            for name in names:
                if name not in params:
                    raise KeyError(f"{model_dir / shard}: tensor {name!r} has no parameter in the TTT model "
                                   "(is this a Qwen3 checkpoint?)")
                p, src = params[name], f.get_tensor(name)
                if id(p) in loaded:  # the second name of a tied parameter
                    if not torch.equal(p, src.to(p.dtype)):
                        raise ValueError(f"{model_dir / shard}: {name} differs from {loaded[id(p)]} but config.json "
                                         "sets tie_word_embeddings=true (one shared matrix); fix the config or "
                                         "the checkpoint")
                    continue
                copy_checked(p, src, name=name, where=model_dir / shard)
                loaded[id(p)] = name
    missing = sorted(n for n, p in params.items() if id(p) not in loaded)
    not_prime = [n for n in missing if not is_prime_param(n)]
    if not_prime:
        tied_hint = (" (an untied model needs lm_head.weight: is tie_word_embeddings missing from config.json?)"
                     if not_prime == ["lm_head.weight"] else "")
        raise KeyError(f"{model_dir}: checkpoint lacks backbone tensors {not_prime[:5]}"
                       f"{' ...' if len(not_prime) > 5 else ''}{tied_hint}")
    return missing


@torch.no_grad()
def load_hf_weights(wanted: dict[str, torch.Tensor], model_dir: str | pathlib.Path, config: Qwen3Config) -> None:
    """Copy the tensors of `wanted` ({HF name: parameter}, e.g. one pipeline stage's) from a Hugging Face
    Qwen3 directory, reading only the shards that hold them; prime weights stay fresh. A name the
    checkpoint does not store is read under its alias (`qwen3.aliases`): with tied embeddings the last
    stage's `lm_head.weight` comes from `model.embed_tokens.weight` (transformers does not store the copy)."""
    model_dir = pathlib.Path(model_dir)
    shards = checkpoint_shards(model_dir)
    stored = {n for names in shards.values() for n in names}
    source: dict[str, list[str]] = {}  # checkpoint name -> the wanted names it fills
    for name in wanted:
        src = next((a for a in aliases(name, config) if a in stored), name)
        source.setdefault(src, []).append(name)
    seen = set()
    for shard, names in shards.items():
        mine = [n for n in names if n in source]
        if not mine:
            continue
        with safe_open(str(model_dir / shard), "pt") as f:
            for src in mine:
                tensor = f.get_tensor(src)
                for name in source[src]:
                    copy_checked(wanted[name], tensor, name=src, where=model_dir / shard)
                    seen.add(name)
    missing = [n for n in wanted if n not in seen and not is_prime_param(n)]
    if missing:
        raise KeyError(f"{model_dir}: checkpoint lacks backbone tensors {missing[:5]}")


def load_hf_qwen3(model_dir: str | pathlib.Path, ttt: TTTConfig, *, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> TTTQwen3ForCausalLM:
    """A TTT model whose backbone is the checkpoint in `model_dir` and whose prime MLPs are fresh."""
    cfg = load_qwen3_config(model_dir)
    with torch.device(device):
        model = TTTQwen3ForCausalLM(cfg, ttt).to_dtype(dtype)
    load_backbone_weights(model, model_dir)
    return model
