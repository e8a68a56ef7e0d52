"""Generate trajectories by running scripted expert policies in real bash sandboxes.

    python data_prep/generate.py --out DIR --num N --seed S [--workers W] [--family memory|error_recovery|explore_edit]
                                 [--no-token-stats] [--no-isolation] [--no-cgroup-caps]

Writes DIR/trajectories.jsonl (canonical) and DIR/atif/<id>.json (ATIF), then prints a summary table
(families, rounds, tokens by kind with the Qwen3 tokenizer, speed). Deterministic for a seed.
Feed DIR, DIR/trajectories.jsonl or DIR/atif to data_prep/prepare.py: given the folder, prepare keeps
the trajectories.jsonl copy of each trajectory and lists the ATIF copies as duplicate copies.

The commands run in `ds_ttt.sandbox.Sandbox` (no network, writes confined to the sandbox, a
process cap, every process killed afterwards: docs/data.md). Where its namespaces are unavailable
this refuses (exit 2) and says why; --no-isolation accepts running without them, and each
trajectory records the isolation used in meta.isolation ("bwrap" or "none"). Each episode runs in a
cgroup of its own capping its total memory, processes and CPU (docs/sandbox.md); where none can be
made this refuses (exit 2) with the fix, and --no-cgroup-caps accepts running without, recorded in
meta.cgroup_caps ("cgroup-v1", "cgroup-v2", "systemd" or "none").
"""

import sys

from ds_ttt.data.cli import generate_main

if __name__ == "__main__":
    sys.exit(generate_main(description=__doc__))
