"""What the episode's cgroup costs the sandbox: per command and per episode start, with and without, in one run.

    .venv/bin/python benchmarks/sandbox_cost.py [--commands 400] [--episodes 60] \
        [--out benchmarks/results/sandbox_cost.json] [--force]

Both arms are ds_ttt.sandbox.Sandbox with bubblewrap; "caps" has its cgroup (cgroup_caps="required":
memory, pids and CPU caps, an OOM check around each command), "none" has not (cgroup_caps="none").
Measured in one process, interleaved so that load drifts hit both arms alike:

  per_command   wall time of `sb.run("true")`, one sandbox of each arm open side by side, the arms
                alternating (which goes first alternates too), --commands pairs after a warm-up;
  start         an episode's start and end: Sandbox(...), its first command `true`, close(); --episodes
                pairs, alternating;
  cgroup_only   create_episode_cgroup + remove alone (what "start" adds, without the sandbox around it).

For each: median, mean and p90 per arm, and the paired difference caps - none (median and mean) with a
95 % bootstrap interval (2000 resamples of the pairs, seed 0). Targets (the sandbox's cgroup caps): <= 5 ms per command
and <= 100 ms per episode start. It refuses while the lead measures (/tmp/ds_ttt_measuring) or when the
1-minute load is >= 2.5 (unless --force, recorded), and records the load at the start and the end.
Writes the JSON and a Markdown table beside it (same name, .md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TARGET_COMMAND_MS = 5.0
TARGET_START_MS = 100.0


def summary(times_ms: list[float]) -> dict:
    s = sorted(times_ms)
    return {"median_ms": round(statistics.median(s), 3), "mean_ms": round(statistics.fmean(s), 3),
            "p90_ms": round(s[int(0.9 * len(s))], 3), "n": len(s)}


def paired_difference(caps: list[float], none: list[float], resamples: int = 2000) -> dict:
    """caps - none per pair: median and mean, each with a 95 % bootstrap interval over the pairs."""
    diffs = [a - b for a, b in zip(caps, none)]
    rng = random.Random(0)
    medians, means = [], []
    for _ in range(resamples):
        sample = [diffs[rng.randrange(len(diffs))] for _ in diffs]
        medians.append(statistics.median(sample))
        means.append(statistics.fmean(sample))
    medians.sort()
    means.sort()
    lo, hi = int(0.025 * resamples), int(0.975 * resamples) - 1
    return {"median_ms": round(statistics.median(diffs), 3), "median_ci95_ms": [round(medians[lo], 3), round(medians[hi], 3)],
            "mean_ms": round(statistics.fmean(diffs), 3), "mean_ci95_ms": [round(means[lo], 3), round(means[hi], 3)]}


def per_command(Sandbox, n: int) -> dict:
    times = {"caps": [], "none": []}
    with Sandbox(timeout=10.0, cgroup_caps="required") as caps, Sandbox(timeout=10.0, cgroup_caps="none") as none:
        arms = {"caps": caps, "none": none}
        for sb in arms.values():
            for _ in range(20):  # warm-up: the sandbox starts at its first command
                assert sb.run("true").exit_code == 0
        for i in range(n):
            for arm in (("caps", "none") if i % 2 == 0 else ("none", "caps")):
                t0 = time.perf_counter()
                res = arms[arm].run("true")
                times[arm].append((time.perf_counter() - t0) * 1e3)
                assert res.exit_code == 0, res
        assert caps.cgroup_caps != "none" and none.cgroup_caps == "none"
    return {"caps": summary(times["caps"]), "none": summary(times["none"]),
            "caps_minus_none": paired_difference(times["caps"], times["none"])}


def start(Sandbox, n: int) -> dict:
    times = {"caps": [], "none": []}
    for i in range(n):
        for arm in (("caps", "none") if i % 2 == 0 else ("none", "caps")):
            t0 = time.perf_counter()
            with Sandbox(timeout=10.0, cgroup_caps="required" if arm == "caps" else "none") as sb:
                assert sb.run("true").exit_code == 0
            times[arm].append((time.perf_counter() - t0) * 1e3)
    return {"caps": summary(times["caps"]), "none": summary(times["none"]),
            "caps_minus_none": paired_difference(times["caps"], times["none"])}


def cgroup_only(n: int) -> dict:
    from ds_ttt.sandbox.caps import CgroupCaps, create_episode_cgroup

    times = []
    for i in range(n):
        t0 = time.perf_counter()
        group = create_episode_cgroup(f"ds_ttt_bench_{os.getpid()}_{i}", CgroupCaps(memory_bytes=4 << 30, processes=272, cpus=1.0))
        group.remove()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"backend": group.backend, **summary(times)}


def markdown(res: dict) -> str:
    pc, st = res["per_command"], res["start"]

    def row(name, part, target):
        d = part["caps_minus_none"]
        return (f"| {name} | {part['none']['median_ms']:.3f} | {part['caps']['median_ms']:.3f} | "
                f"{d['median_ms']:+.3f} [{d['median_ci95_ms'][0]:+.3f}, {d['median_ci95_ms'][1]:+.3f}] | "
                f"{d['mean_ms']:+.3f} [{d['mean_ci95_ms'][0]:+.3f}, {d['mean_ci95_ms'][1]:+.3f}] | <= {target:g} ms |")

    return "\n".join([
        "# What the episode's cgroup costs the sandbox", "",
        f"`benchmarks/sandbox_cost.py` at {res['commit']}, {res['cpus']} CPUs, cgroup backend `{res['backend']}`; "
        f"load {res['load_start'][0]:.2f} at the start and {res['load_end'][0]:.2f} at the end (1-minute averages)"
        + (" (run with --force)" if res["forced"] else "") + ".", "",
        "Milliseconds; medians per arm; the difference caps - none per interleaved pair, with its 95 % bootstrap interval.", "",
        "| | no cgroup | cgroup | difference, median [95 % CI] | difference, mean [95 % CI] | target |",
        "| --- | --- | --- | --- | --- | --- |",
        row(f"one command (`true`), {pc['caps']['n']} pairs", pc, TARGET_COMMAND_MS),
        row(f"episode start (make, first command, close), {st['caps']['n']} pairs", st, TARGET_START_MS),
        "",
        f"Making and removing the cgroup alone: median {res['cgroup_only']['median_ms']:.2f} ms "
        f"(p90 {res['cgroup_only']['p90_ms']:.2f}, {res['cgroup_only']['n']} times).", ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commands", type=int, default=400)
    ap.add_argument("--episodes", type=int, default=60)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sandbox_cost.json"))
    ap.add_argument("--force", action="store_true", help="run even under load (recorded)")
    args = ap.parse_args(argv)
    load_start = os.getloadavg()
    if Path("/tmp/ds_ttt_measuring").exists():
        print("the lead is measuring (/tmp/ds_ttt_measuring exists): not starting", file=sys.stderr)
        return 3
    if load_start[0] >= 2.5 and not args.force:
        print(f"1-minute load {load_start[0]:.2f} >= 2.5: not starting (retry later, or --force)", file=sys.stderr)
        return 3
    from ds_ttt.sandbox import Sandbox

    t0 = time.time()
    res = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True).stdout.strip(),
           "cpus": os.cpu_count(), "forced": args.force, "load_start": [round(x, 2) for x in load_start]}
    res["per_command"] = per_command(Sandbox, args.commands)
    res["start"] = start(Sandbox, args.episodes)
    res["cgroup_only"] = cgroup_only(50)
    res["backend"] = res["cgroup_only"]["backend"]
    res["load_end"] = [round(x, 2) for x in os.getloadavg()]
    res["wall_s"] = round(time.time() - t0, 1)
    res["targets_met"] = (res["per_command"]["caps_minus_none"]["median_ci95_ms"][1] <= TARGET_COMMAND_MS
                          and res["start"]["caps_minus_none"]["median_ci95_ms"][1] <= TARGET_START_MS)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
