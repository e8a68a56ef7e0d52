"""launch/train.py with a Qwen3-8B-shaped backbone of fewer layers (the GPU check's layer fit).

    deepspeed --num_gpus 1 gpu_check/train_layers.py --layers 24 --run_config RUN.json ...

Registers the backbone preset `qwen3-8b-<N>l` (ds_ttt.model.presets.qwen3_8b_config with
num_hidden_layers=N; everything else is Qwen3-8B's shape) in this process, then runs launch/train.py
unchanged with the remaining arguments. The run config must name that preset. Used by
gpu_check/bench_trainer.py only when the full 36 layers do not fit on the one lent GPU.
"""

import runpy
import sys
from pathlib import Path

from ds_ttt.model import presets

REPO = Path(__file__).resolve().parents[1]


def register(layers: int) -> str:
    if not 1 <= layers <= 36:
        raise SystemExit(f"train_layers.py: --layers must be in 1..36, got {layers}")
    name = f"qwen3-8b-{layers}l"

    def config():
        cfg = presets.qwen3_8b_config()
        cfg.num_hidden_layers = layers
        return cfg
    presets.PRESETS[name] = config
    return name


def split_layers(argv: list[str]) -> tuple[int, list[str]]:
    """(N, the other arguments in order) from argv holding `--layers N` anywhere (the deepspeed
    launcher puts its --local_rank first)."""
    if "--layers" not in argv or argv.index("--layers") + 1 >= len(argv):
        raise SystemExit("usage: train_layers.py --layers N [launch/train.py arguments]")
    i = argv.index("--layers")
    try:
        layers = int(argv[i + 1])
    except ValueError:
        raise SystemExit(f"train_layers.py: --layers must be an integer, got {argv[i + 1]!r}") from None
    return layers, argv[:i] + argv[i + 2:]


def main(argv: list[str]) -> None:
    layers, rest = split_layers(argv)
    register(layers)
    script = REPO / "launch" / "train.py"
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
