"""Backbone presets as transformers `Qwen3Config` objects: the real Qwen3-8B shape and tiny CPU models.

    from ds_ttt.model.presets import backbone_config
    cfg = backbone_config("tiny")          # 8 layers, hidden 64, 4 q / 2 kv heads, full Qwen3 vocab
    cfg = backbone_config("qwen3-8b")      # 36 layers, hidden 4096, 32 / 8 heads, head_dim 128

Tiny presets keep Qwen3's architecture (qk-norm, GQA, RoPE theta 1e6, untied embeddings like the 8B) so
every code path of the 8B model runs on a laptop CPU; `tie_word_embeddings=True` builds the tied head of
Qwen3-0.6B..4B.
"""

from __future__ import annotations

from transformers import Qwen3Config

QWEN3_VOCAB_SIZE = 151936  # Qwen3's embedding rows: the table is padded beyond the tokenizer's 151,669 tokens


def qwen3_8b_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=QWEN3_VOCAB_SIZE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False, attention_bias=False,
        hidden_act="silu", torch_dtype="bfloat16",
    )


def tiny_qwen3_config(*, num_hidden_layers: int = 8, hidden_size: int = 64, intermediate_size: int = 128,
                      num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 16,
                      vocab_size: int = QWEN3_VOCAB_SIZE, max_position_embeddings: int = 16384,
                      tie_word_embeddings: bool = False) -> Qwen3Config:
    """A small Qwen3; `tie_word_embeddings=True` gives the tied head of Qwen3-0.6B..4B."""
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=tie_word_embeddings, attention_bias=False, hidden_act="silu", torch_dtype="float32",
    )


PRESETS = {
    "qwen3-8b": qwen3_8b_config,
    "tiny": tiny_qwen3_config,
    "tiny-128": lambda: tiny_qwen3_config(hidden_size=128, intermediate_size=256, head_dim=32),
    # the main job's model (ds_configs/run_cpu_tiny.json): 5 layers = 3 frozen-path layers and 2 adaptive layers (one
    # layer per stage of the 4-stage cpu_tiny.json layout, both adaptive ones on the last); wide enough to store facts,
    # small enough for the main job's 1,000 steps on 2 CPU cores
    "tiny-mem": lambda: tiny_qwen3_config(num_hidden_layers=5, hidden_size=128, intermediate_size=256, head_dim=32),
}


def backbone_config(name: str) -> Qwen3Config:
    """A preset by name; raises naming the known presets."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)} "
                         "(or pass a local Qwen3 checkpoint directory)")
    return PRESETS[name]()
