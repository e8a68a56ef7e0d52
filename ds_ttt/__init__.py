"""ds_ttt: a DeepSpeed trainer for test-time-training (TTT) terminal agents on Qwen3.

Layout (see README.md, "Layout"):
  ds_ttt/config.py        validated dataclass configs (model, TTT, training)
  ds_ttt/model/           single-device Qwen3 + fast-weight prime MLPs + the event loop
  ds_ttt/ops/flashbob/    exact backward-over-backward attention (reference / C++ / CUDA)
  ds_ttt/data/            tokenizer, trajectory rendering, importers, manifests, generator
  ds_ttt/train/           DeepSpeed pipeline engine, checkpoints, schedule, logging
"""

__version__ = "0.1.0"
