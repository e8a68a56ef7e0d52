"""Multi-rank worker for tests/e2e/test_pipeline_equivalence.py: one optimizer step of the TTT pipeline
engine, recording the loss and every parameter's update.

    torchrun --nproc_per_node 4 tests/e2e/pipeline_worker.py OUT_DIR

Runs these layouts in one launch (4 CPU ranks): "pp4" = 4 stages x 1 dp, ZeRO-0, no clipping;
"pp2dp2" = 2 stages x 2 dp, ZeRO-1, gradient clipping at a norm the gradients exceed, with a weighted
observation loss; "bug_pp4_zero0_clip" = 4 stages with clipping but without ZeRO (DeepSpeed 0.19.8 clips with stage 0's norm only: the
trainer refuses it); "sft_pp4" = no adaptive layers under trainable_scope 'suffix' (no inner loop, frozen stages
0-2; only the final norm and head train: the pipeline case of a frozen prefix, not the SFT recipe, which is 'all'); "prime_pp4" / "prime_pp2dp2" = trainable_scope 'prime' (the 8B default: stages without a
trainable parameter run no backward); "tied_pp4" = tied embeddings (TiedLayerSpec between stage 0 and
the last stage; 4 stages, ZeRO-1, clipping: cpu_tiny's layout); "pp4" and "tied_pp4" load their
backbone from an untied / tied checkpoint written by transformers' save_pretrained (HF_LOADED); "prime_pp4_bf16" = the Qwen3-8B
recipe's engine settings (bf16, ZeRO-1, clipping 1.0, 'prime'). The optimizer is SGD with lr 1 (a client optimizer), so each parameter's update is
exactly minus its (clipped, data-parallel averaged) gradient. The trajectories have 1 to 5 rounds with
1 or 6 action tokens each, so the token-weighted objective differs from a mean of micro-batch means.
Rank files: OUT_DIR/<layout>/rank<R>.pt = {"loss", "delta": {HF name: tensor}}.
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
from ds_ttt.train.data_loader import Sample, TrajectoryBatches
from ds_ttt.train.layout import resolve_layout

ALL = dict(adaptive_layers=2, trainable_scope="all", inner_lr=0.5)
PRIME = dict(adaptive_layers=2, trainable_scope="prime", inner_lr=0.5)
LAYOUTS = {
    # name: (stages, zero stage, gradient_clipping, micro, gas, TTT settings, tied embeddings)
    "pp4": (4, 0, 0.0, 2, 2, ALL, False),
    "pp2dp2": (2, 1, 0.05, 1, 2, dict(ALL, obs_loss_weight=0.5, obs_loss_with_end=True), False),
    # DeepSpeed 0.19.8's bug (why the trainer refuses this combination): clipping without ZeRO in fp32
    "bug_pp4_zero0_clip": (4, 0, 0.05, 1, 2, ALL, False),
    "sft_pp4": (4, 1, 0.0, 1, 2, dict(adaptive_layers=0, trainable_scope="suffix"), False),
    "prime_pp4": (4, 1, 0.05, 1, 2, PRIME, False),
    "prime_pp2dp2": (2, 1, 0.0, 1, 2, PRIME, False),
    "tied_pp4": (4, 1, 0.05, 1, 2, ALL, True),  # also cpu_tiny's engine layout (4 stages, ZeRO-1, clipping)
}
# The Qwen3-8B recipe's engine path (qwen3_8b_pp4.json: bf16, ZeRO-1, clipping 1.0, scope 'prime'): bf16
# boundaries cross as byte views, the frozen stages' optimizers hold only the unused anchor.
BF16_LAYOUTS = {"prime_pp4_bf16": (4, 1, 1.0, 1, 2, PRIME, False)}


def layout_of(name: str) -> tuple:
    return LAYOUTS[name] if name in LAYOUTS else BF16_LAYOUTS[name]


def backbone(tied: bool = False):
    return tiny_qwen3_config(num_hidden_layers=8, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=tied)


# Layouts whose backbone comes from a checkpoint that transformers' Qwen3ForCausalLM.save_pretrained wrote
# (tied: no lm_head.weight on disk): the reference loads it with load_hf_qwen3, every pipeline stage with
# the trainer's load_hf_weights (ds_ttt/model/hf_adapter.py); only the prime weights, absent from the
# checkpoint, are copied.
HF_LOADED = {"pp4", "tied_pp4"}


def hf_checkpoint(root: pathlib.Path, tied: bool) -> pathlib.Path:
    """A deterministic transformers Qwen3 checkpoint (the same weights in every process)."""
    from transformers import Qwen3ForCausalLM

    path = root / ("hf_tied" if tied else "hf_untied")
    if not (path / "config.json").exists():
        torch.manual_seed(11)
        Qwen3ForCausalLM(backbone(tied)).save_pretrained(path)
    return path


def make_reference(name: str, hf_root: pathlib.Path | None = None) -> TTTQwen3ForCausalLM:
    """The single-process model of a layout (from its HF checkpoint under `hf_root` for HF_LOADED)."""
    ttt = TTTConfig(**layout_of(name)[5])
    if name in HF_LOADED:
        from ds_ttt.model.hf_adapter import load_hf_qwen3
        path = hf_checkpoint(hf_root, layout_of(name)[6])  # (writing it first draws random numbers)
        torch.manual_seed(0)
        model = load_hf_qwen3(path, ttt)
    else:
        torch.manual_seed(0)
        model = TTTQwen3ForCausalLM(backbone(layout_of(name)[6]), ttt)
    with torch.no_grad():  # non-zero prime down projections: the inner updates change the outer loss
        for layer in model.adaptive_layers:
            layer.prime_mlp.down_proj.weight.normal_(0, 0.05)
    model.set_trainable_scope()
    return model


NUM_ROUNDS = [1, 4, 1, 5, 1, 2, 1, 3]


def make_samples(n: int = 8) -> list[Sample]:
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        num_rounds, prompt, num_action = NUM_ROUNDS[i], 3 + i % 4, 1 if i % 2 == 0 else 6
        one_round = [0, 0] + [1] * num_action + [0] + [2] * 5 + [0]  # header, action, header, observation, end
        kinds = [0] * prompt + one_round * num_rounds
        rounds = [0] * prompt + [r for r in range(1, num_rounds + 1) for _ in one_round]
        out.append(Sample(f"s{i}", torch.randint(0, 256, (len(kinds),), generator=g).tolist(), kinds, rounds))
    return out


def batches(stages: int, micro: int, gas: int, dp_rank: int = 0) -> TrajectoryBatches:
    dp = 4 // stages
    samples = make_samples()
    return TrajectoryBatches(samples, num_samples=len(samples), train_batch_size=micro * gas * dp,
                             micro_batch_size=micro, gradient_accumulation_steps=gas, dp_rank=dp_rank, dp_size=dp,
                             seed=0, bucket=16, capacity=4096)


def run_layout(name: str, out: pathlib.Path) -> None:
    import deepspeed
    import torch.distributed as dist

    from ds_ttt.model.hf_adapter import load_hf_weights
    from ds_ttt.train.engine import set_step_objective
    from ds_ttt.train.pipeline import TTTPipelineModule

    stages, zero, clip, micro, gas, _, tied = layout_of(name)
    ref = make_reference(name, out)
    layout = resolve_layout(stages, 8, ref.ttt, tied_embeddings=tied)
    module = TTTPipelineModule(ref.config, ref.ttt, layout, seed=0)
    full = ref.state_dict()  # a tied model lists the shared matrix under both names
    named = list(module.local_hf_named_parameters())
    if name in HF_LOADED:  # the trainer's per-stage --model loading
        load_hf_weights({hf: p for _, _, hf, p in named}, hf_checkpoint(out, tied), ref.config)
    with torch.no_grad():
        for _, local, hf, p in named:
            if name not in HF_LOADED or ".prime_" in hf:
                p.copy_(full[hf])
    params = [p for p in module.parameters() if p.requires_grad]
    ds = {"train_batch_size": micro * gas * (4 // stages), "train_micro_batch_size_per_gpu": micro,
          "gradient_accumulation_steps": gas, "pipeline": {"stages": stages, "activation_checkpoint_interval": 1,
                                                           "use_reentrant": False},
          "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True,
          "gradient_clipping": clip, "steps_per_print": 10**6, "bf16": {"enabled": name in BF16_LAYOUTS}}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=params,
                                           optimizer=torch.optim.SGD(params, lr=1.0), config=ds)
    # after initialize: with bf16 DeepSpeed has cast the weights (the cast is no update)
    before = {hf: p.detach().clone() for _, _, hf, p in module.local_hf_named_parameters()}
    data = batches(stages, micro, gas, engine.grid.data_parallel_id)
    it = data.iterate(0) if engine.is_first_stage() or engine.is_last_stage() else None
    last = module.last_stage_layer()
    if last is not None:  # the trainer's own per-step call (token counts of the global batch)
        set_step_objective(last, engine, data, 0, ref.ttt)
    loss = engine.train_batch(data_iter=it)
    if engine.grid.data_parallel_id == 0:
        delta = {hf: before[hf] - p.detach() for _, _, hf, p in module.local_hf_named_parameters()}
        (out / name).mkdir(parents=True, exist_ok=True)
        torch.save({"loss": float(loss), "delta": delta}, out / name / f"rank{dist.get_rank()}.pt")
    dist.barrier()


def main() -> None:
    import deepspeed

    out = pathlib.Path(sys.argv[1])
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    if torch.distributed.get_rank() == 0:
        for tied in (False, True):
            hf_checkpoint(out, tied)
    torch.distributed.barrier()
    for name in [*LAYOUTS, *BF16_LAYOUTS]:
        run_layout(name, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
