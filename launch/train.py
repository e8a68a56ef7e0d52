"""Meta-train a TTT Qwen3 with DeepSpeed's pipeline engine (the inner loop on the last stage).

    deepspeed --num_gpus 4 launch/train.py --deepspeed_config ds_configs/cpu_tiny.json \
        --data DATA/manifest.json --output RUN_DIR --max_steps N [--run_config ds_configs/run_cpu_tiny.json]
    ... --resume RUN_DIR                                   # continue exactly (RUN_DIR or a checkpoint dir)
    ... --start-stage-from RUN_DIR --data NEW/manifest.json --output NEW_RUN   # next data stage
    ... --model /models/Qwen3-8B --deepspeed_config ds_configs/qwen3_8b_pp4.json   # GPUs, a local Qwen3
    deepspeed --hostfile hostfile launch/train.py ...      # multi-node (docs/training.md "Many machines")
    ... --dist_timeout 600       # a rank stops after 600 s without its peers (a lost node); default 1800

TTT/run settings: a run-config JSON (`--run_config`, see ds_ttt/train/run_config.py), overridden by
the flags below and `--ttt key=value` (e.g. --ttt adaptive_layers=0 --ttt trainable_scope=all for the
SFT baseline). The resolved config is saved beside every checkpoint. On CPU use OMP_NUM_THREADS=1.
"""

import argparse
import json
import os
import pathlib
import sys

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".torch_extensions"))
os.environ.setdefault("WANDB_MODE", "offline")

import deepspeed  # noqa: E402
import torch  # noqa: E402

from ds_ttt.train.rendezvous import DEFAULT_TIMEOUT_S, join_process_group, lost_peer_message  # noqa: E402
from ds_ttt.train.run_config import load_run_config, parse_ttt_overrides  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    ap.add_argument("--run_config", help="run-config JSON (model, schedule, ttt block)")
    ap.add_argument("--data", help="DATA/manifest.json")
    ap.add_argument("--output", help="RUN_DIR (checkpoints, metrics.jsonl)")
    ap.add_argument("--max_steps", type=int, help="planned optimizer steps of this stage (fixed at the first launch)")
    ap.add_argument("--stop_at_step", type=int, help="end this launch early at this stage step (plan unchanged)")
    ap.add_argument("--preset", help="backbone preset (tiny, tiny-128, qwen3-8b)")
    ap.add_argument("--model", help="local Hugging Face Qwen3 directory")
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--save_interval", type=int)
    ap.add_argument("--wandb", action="store_true", default=None, help="log to wandb (offline unless WANDB_MODE)")
    ap.add_argument("--ttt", action="append", metavar="KEY=VALUE", help="TTT setting override (repeatable)")
    ap.add_argument("--resume", metavar="CKPT", help="continue a run: RUN_DIR (latest) or a checkpoint dir")
    ap.add_argument("--start-stage-from", dest="start_stage_from", metavar="CKPT",
                    help="begin a new data stage from a checkpoint (new --data and --output)")
    ap.add_argument("--dist_timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                    help="stop when the rendezvous or any collective waits this long for its peers (a lost node)")
    ap = deepspeed.add_config_arguments(ap)
    return ap.parse_args(argv)


def main(argv=None, *, on_save_phase=None) -> int:
    """`on_save_phase(phase, path)`: called at each phase of every checkpoint save (fault injection:
    tests/e2e/fault_injection.py)."""
    args = parse_args(argv)
    overrides = {k: getattr(args, k) for k in ("data", "output", "max_steps", "stop_at_step", "preset", "model",
                                               "epochs", "seed", "save_interval", "wandb")}
    base = None
    if args.resume:  # resume continues the checkpoint's run (its config, data and RUN_DIR) unless overridden
        from ds_ttt.train.checkpoint import resolve_checkpoint
        from ds_ttt.train.run_record import RunInfo
        base = RunInfo.read(resolve_checkpoint(args.resume)).run
    try:
        run = load_run_config(args.run_config, overrides, parse_ttt_overrides(args.ttt), base=base)
    except ValueError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"launch/train.py: error: {e}", file=sys.stderr)
        return 2
    with open(args.deepspeed_config) as f:
        ds = json.load(f)
    if not torch.cuda.is_available():  # no /dev/shm all-reduce buffers (they only serve inference)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if torch.cuda.is_available():  # before any collective: NCCL object collectives use the current device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    join_process_group(timeout_s=args.dist_timeout, backend="nccl" if torch.cuda.is_available() else "gloo")
    from ds_ttt.train.engine import Trainer
    try:
        Trainer.build(run, ds, resume=args.resume, start_stage_from=args.start_stage_from,
                      on_save_phase=on_save_phase).train()
    except (ValueError, FileNotFoundError) as e:  # config and checkpoint errors: one clear line (key, file, fix)
        if torch.distributed.get_rank() == 0:
            print(f"launch/train.py: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a collective lost its peers (a node died or left the network): say so, stop
        message = lost_peer_message(e, timeout_s=args.dist_timeout)
        if message is None:
            raise
        print(f"launch/train.py: error: rank {torch.distributed.get_rank()}: {message}", file=sys.stderr, flush=True)
        os._exit(3)  # no teardown: it would wait on the lost peers again
    finally:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
