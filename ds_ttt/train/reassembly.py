"""Reassembly: a pipeline checkpoint (one file per pipeline layer) as one single-process
`TTTQwen3ForCausalLM`, without DeepSpeed. Evaluation, export and serving load trained models this way.

    from ds_ttt.train.reassembly import load_model_from_checkpoint
    model, info = load_model_from_checkpoint("runs/main/run")      # RUN_DIR or a checkpoint directory

Each `layer_NN-model_states.pt` holds pipeline spec NN's parameters under local names;
`Layout.hf_name` (the one local -> Hugging Face name map) turns them into the model's names. Files are
read with weights_only=True.
"""

from __future__ import annotations

import glob
import os

import torch

from ds_ttt.train.checkpoint import resolve_checkpoint
from ds_ttt.train.run_record import RunInfo


def load_model_from_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Reassemble a pipeline checkpoint into one `TTTQwen3ForCausalLM` (eval mode) + its RunInfo.

    Tied embeddings: the embedding (layer 0) and the last stage's `lm_head.weight` (one Parameter,
    kept equal by DeepSpeed's tied-gradient all-reduce) must hold the same values; the model gets one
    shared matrix."""
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    ckpt = resolve_checkpoint(path)
    info = RunInfo.read(ckpt)
    layout = info.pipeline_layout()
    with torch.device("meta"):
        model = TTTQwen3ForCausalLM(info.backbone_config(), info.ttt_config())
    state: dict[str, torch.Tensor] = {}
    for spec_idx in range(layout.last_spec + 1):  # the tied head reference (if any) saves no file
        files = sorted(glob.glob(str(ckpt / f"layer_{spec_idx:02d}-*model_states.pt")))
        if not files:
            raise FileNotFoundError(f"{ckpt}: no weights for pipeline layer {spec_idx} (layer_{spec_idx:02d}-*)")
        for local, tensor in torch.load(files[0], map_location="cpu", weights_only=True).items():
            if not local.endswith(".inv_freq"):  # RoPE's buffer: rebuilt from the config below
                state[layout.hf_name(spec_idx, local)] = tensor
    expected = set(model.state_dict())  # a tied model lists both names
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise KeyError(f"{ckpt}: checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if model.config.tie_word_embeddings:
        embed, head = state["model.embed_tokens.weight"], state.pop("lm_head.weight")
        if not torch.equal(embed, head):
            raise ValueError(f"{ckpt}: tied embeddings, but layer_00's embed_tokens.weight differs from the last "
                             "stage's lm_head.weight (the tied gradients were not reduced): the checkpoint is corrupt")
    model.load_state_dict(state, assign=True, strict=not model.config.tie_word_embeddings)
    if model.config.tie_word_embeddings:
        model.tie_weights()  # assign=True replaced the Parameter: share it again
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)  # rebuild the RoPE buffer off meta
    model.to(device).eval()
    return model, info
