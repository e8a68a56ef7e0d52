"""DeepSpeed's checkpoint loader made weights_only: `engine.load_checkpoint` unpickles nothing but the
few DeepSpeed objects its files hold.

    from ds_ttt.train.safe_loading import use_safe_loading
    use_safe_loading(engine)            # before engine.load_checkpoint (checkpoint.load_checkpoint does it)

DeepSpeed 0.19.8's TorchCheckpointEngine.load calls torch.load(..., weights_only=False) for every
file of `engine.load_checkpoint` (model states, pipeline layer files, ZeRO optimizer partitions).
`use_safe_loading` swaps in a subclass whose load is torch.load(weights_only=True) with only
`deepspeed_safe_globals()` allow-listed, so a file holding any other object fails to load. Other
checkpoint engines (nebula, fast, decoupled) are refused. tests/unit/test_safe_loading.py checks both.
"""

from __future__ import annotations

import torch


def deepspeed_safe_globals() -> list:
    """The DeepSpeed objects inside its checkpoint files, besides tensors and containers (read off the
    pickles' globals of a ZeRO-1 pipeline checkpoint, DeepSpeed 0.19.8): the ZeRO optimizer's loss
    scaler, its stage enum and its parameter-fragment addresses."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def use_safe_loading(engine) -> None:
    """Make `engine.load_checkpoint` load every file with weights_only=True (see the module docstring)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise ValueError(f"the DeepSpeed config selects the checkpoint engine {type(engine.checkpoint_engine).__name__}; "
                         "ds_ttt loads checkpoints only through the torch engine with weights_only=True: remove "
                         "the checkpoint-engine setting (nebula / fast / decoupled) from the DeepSpeed config")
    allowed = deepspeed_safe_globals()

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)

    safe = SafeTorchCheckpointEngine(None)  # DeepSpeed's config is the engine's private; copy the one setting it sets
    safe.zipfile_serialization = engine.checkpoint_engine.zipfile_serialization
    engine.checkpoint_engine = safe
