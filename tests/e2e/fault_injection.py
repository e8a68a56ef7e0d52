"""Fault injection for real launches: launch/train.py, SIGKILLed (every rank and the launcher at once)
at one phase of one checkpoint save, as a crash would.

Every rank runs this file in place of launch/train.py, with one extra flag in front of the trainer's:

    python -m torch.distributed.run --nproc_per_node 4 tests/e2e/fault_injection.py --kill-at renamed@4 \
        --deepspeed_config DS.json --run_config RUN.json --resume RUN/step_00000002

`--kill-at PHASE[@STEP]`: PHASE is one of ds_ttt.train.checkpoint.SAVE_PHASES; without @STEP every
save is a target. The kill goes through the trainer's `on_save_phase` hook (rank 0 calls it at each
phase of a save), so the library carries no test code. tests/e2e/test_pipeline_train.py uses it; the
in-process kills of tests/unit/test_train_checkpoint.py use the same hook.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import signal
import sys

from ds_ttt.train.checkpoint import SAVE_PHASES, TMP_PREFIX, step_of

ROOT = pathlib.Path(__file__).resolve().parents[2]
KILL_FLAG = "--kill-at"


def kill_launch() -> None:
    """SIGKILL this node's whole launch at once, as a crash would: the process groups of every rank
    (the children of this rank's launcher; torchrun starts each in its own session) and of the
    launcher, this process last. Linux only (reads /proc). Without a launcher (no LOCAL_RANK) only
    this process dies: its parent and group are not ours to kill."""
    parent, me = os.getppid(), os.getpid()
    if "LOCAL_RANK" not in os.environ:
        os.kill(me, signal.SIGKILL)
    ranks = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:  # field 4: the parent pid
                ranks.append(int(entry))
    groups = []
    for pid in ranks + [parent]:
        try:
            groups.append(os.getpgid(pid))
        except ProcessLookupError:
            pass
    own = os.getpgrp()
    for group in dict.fromkeys(groups):
        if group != own:
            os.killpg(group, signal.SIGKILL)
    os.killpg(own, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def kill_at(spec: str):
    """The `on_save_phase(phase, path)` hook that kills the launch at `spec` = PHASE[@STEP]."""
    phase, _, at = spec.partition("@")
    if phase not in SAVE_PHASES:
        raise ValueError(f"{KILL_FLAG} {spec!r}: unknown phase {phase!r}; one of {', '.join(SAVE_PHASES)}")
    step = int(at) if at else None

    def hook(now: str, path: pathlib.Path) -> None:
        # `path` is the save's folder: `.tmp-<tag>` before the rename, its final name after
        if now == phase and (step is None or step_of(path.name.removeprefix(TMP_PREFIX)) == step):
            kill_launch()
    return hook


def main(argv: list[str]) -> int:
    """Run launch/train.py's main on argv without `--kill-at SPEC`, with the kill hook installed."""
    where = argv.index(KILL_FLAG)
    hook = kill_at(argv[where + 1])
    spec = importlib.util.spec_from_file_location("launch_train", ROOT / "launch" / "train.py")
    launch_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch_train)
    return launch_train.main(argv[:where] + argv[where + 2:], on_save_phase=hook)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
