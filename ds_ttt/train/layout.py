"""The pipeline layout: which decoder layers sit on which stage, and the one map from a pipeline
layer's local parameter names to the Hugging Face names of `TTTQwen3ForCausalLM`.

    from ds_ttt.train.layout import resolve_layout
    layout = resolve_layout(num_stages=4, num_layers=36, ttt=TTTConfig(), tied_embeddings=False)
    layout.spec_parts()            # [0, 10, 19, 28, 29]: stage s owns specs parts[s]:parts[s+1]
    layout.hf_name(0, "embed_tokens.weight")       # "model.embed_tokens.weight"

Spec list (ds_ttt/train/pipeline.py builds it): 0 embed; 1..P the P non-adaptive decoder layers;
P+1 the last stage (every adaptive layer, final norm, LM head, losses); with tied embeddings also
P+2, the last stage's `TiedLayerSpec` reference to the embedding (no parameters of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_ttt.config import TTTConfig


@dataclass(frozen=True)
class Layout:
    """Which decoder layers go where: non-last stages hold `prefix_per_stage[s]` non-adaptive layers
    (stage 0 also embeds); the last stage holds every adaptive layer + final norm + LM head + losses."""

    num_stages: int
    num_layers: int
    num_adaptive: int
    prefix_per_stage: tuple[int, ...]
    tied_embeddings: bool = False  # the last stage also holds a TiedLayerSpec of the embedding

    @property
    def first_adaptive(self) -> int:
        return self.num_layers - self.num_adaptive

    @property
    def num_specs(self) -> int:
        return self.first_adaptive + 2 + int(self.tied_embeddings)

    @property
    def last_spec(self) -> int:
        """Index of the last stage's LastStagePipe."""
        return self.first_adaptive + 1

    def spec_parts(self) -> list[int]:
        """DeepSpeed `parts` over the spec list [embed, prefix_0.., last(, tied head)]: stage s owns
        parts[s]:parts[s+1]."""
        if self.num_stages == 1:
            return [0, self.num_specs]
        parts, n = [0], 1  # the embed spec sits on stage 0
        for k in self.prefix_per_stage:
            n += k
            parts.append(n)
        parts.append(self.num_specs)
        return parts

    def stage_of(self, spec_idx: int) -> int:
        parts = self.spec_parts()
        return next(s for s in range(self.num_stages) if parts[s] <= spec_idx < parts[s + 1])

    def hf_name(self, spec_idx: int, local: str) -> str:
        """The Hugging Face name of parameter `local` of the pipeline layer at `spec_idx` (the one
        local-to-HF map: per-stage HF loading, checkpoint reassembly, trainable scope, tests)."""
        p = self.first_adaptive
        if spec_idx == 0:  # EmbedPipe: embed_tokens.weight
            return "model." + local
        if 1 <= spec_idx <= p:  # DecoderPipe of layer spec_idx - 1: layer.<...>
            return local.replace("layer.", f"model.layers.{spec_idx - 1}.", 1)
        if spec_idx == p + 1:  # LastStagePipe: layers.<j>.<...>, norm.weight, lm_head.weight
            if local.startswith("layers."):
                _, j, rest = local.split(".", 2)
                return f"model.layers.{p + int(j)}.{rest}"
            return local if local.startswith("lm_head.") else "model." + local
        raise IndexError(f"spec index {spec_idx} has no parameters of its own (specs 0..{p + 1} do)")

    def to_dict(self) -> dict:
        return {"num_stages": self.num_stages, "num_layers": self.num_layers, "num_adaptive": self.num_adaptive,
                "prefix_per_stage": list(self.prefix_per_stage), "tied_embeddings": self.tied_embeddings,
                "spec_parts": self.spec_parts()}

    # what from_dict needs of to_dict's record (spec_parts is derived from them)
    RECORD_FIELDS = ("num_stages", "num_layers", "num_adaptive", "prefix_per_stage", "tied_embeddings")

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        """From `to_dict` (every field of RECORD_FIELDS; RunInfo.read names a missing one)."""
        return cls(d["num_stages"], d["num_layers"], d["num_adaptive"], tuple(d["prefix_per_stage"]),
                   d["tied_embeddings"])


def resolve_layout(num_stages: int, num_layers: int, ttt: TTTConfig, partition: list[int] | None = None, *,
                   tied_embeddings: bool = False) -> Layout:
    """The layout for `num_stages` (default partition: the non-adaptive layers balanced over stages
    0..S-2); `tied_embeddings` = the backbone's config.tie_word_embeddings."""
    num_adaptive = ttt.num_adaptive(num_layers)
    num_prefix = num_layers - num_adaptive
    if num_stages == 1:
        return Layout(1, num_layers, num_adaptive, (), tied_embeddings)
    if num_prefix < num_stages - 1:
        raise ValueError(
            f"pipeline.stages={num_stages} needs at least {num_stages - 1} non-adaptive decoder layers for stages "
            f"0..{num_stages - 2} (the last stage holds exactly the adaptive layers), but the model has "
            f"{num_layers} layers of which {num_adaptive} are adaptive (ttt.adaptive_layers); lower "
            f"pipeline.stages or ttt.adaptive_layers")
    if partition is None:
        base, extra = divmod(num_prefix, num_stages - 1)
        per = tuple(base + (1 if s < extra else 0) for s in range(num_stages - 1))
    else:
        per = tuple(partition)
        if len(per) != num_stages - 1:
            raise ValueError(f"partition has {len(per)} entries; pipeline.stages={num_stages} needs "
                             f"{num_stages - 1} (non-adaptive layers per non-last stage)")
        if sum(per) != num_prefix:
            where = "put adaptive layers on a non-last stage" if sum(per) > num_prefix else \
                "leave non-adaptive layers on the last stage"
            raise ValueError(
                f"partition {list(per)} sums to {sum(per)} but the model has {num_prefix} non-adaptive layers "
                f"(layers 0..{num_prefix - 1}); it would {where}. Every adaptive layer must sit on the last "
                f"stage: make partition sum to {num_prefix}")
    return Layout(num_stages, num_layers, num_adaptive, per, tied_embeddings)
