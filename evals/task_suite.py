"""Write the closed-loop held-out task suite as a Harbor dataset, and check every task's test.

    .venv/bin/python evals/task_suite.py --out TASKS --split test [--num-per-kind 12] [--kinds K ...]

Before the suite is accepted: every blind policy (ds_ttt/tasks/blind_policies.py: nothing, the
instruction echoed, constant answers, lists of numbers, copy or move everything) must fail every task
(else the suite is refused and removed, naming task and policy), every other instance's reference
solution is replayed blind on each task (suite.json records per task and per kind whether it needs the
observation, and each kind's replay rate), and each task's test is judged on two known agents: the
reference solution must pass (a task whose test it fails is refused, named, with its test log) and
doing nothing must fail (the blind policy `nothing` is that agent: Harbor's nop, no command and an
empty reply).
Layout and seeds: ds_ttt/tasks/suite.py; kinds: ds_ttt/tasks/kinds.py; docs/evaluation.md,
"Closed-loop tasks". Run it with Harbor:
    .venv-harbor/bin/harbor run -p TASKS --agent ds_ttt.serve.frontends.harbor_agent:TTTAgent \
        --env ds_ttt.serve.frontends.harbor_env:SandboxEnvironment --ak server_url=http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def main(argv=None) -> int:
    from ds_ttt.evaluation.closed_loop import verify_task
    from ds_ttt.tasks.blind_policies import BlindPolicyPasses, check_suite
    from ds_ttt.tasks.kinds import KINDS
    from ds_ttt.tasks.suite import TASK_SEEDS, load_suite, write_suite

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="a new directory")
    p.add_argument("--split", choices=sorted(TASK_SEEDS), default="test")
    p.add_argument("--num-per-kind", type=int, default=12)
    p.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=None, help="default: every kind")
    p.add_argument("--no-verify", action="store_true", help="skip the oracle / nop check of every test")
    a = p.parse_args(argv)

    def check_blind(tasks, guesses):
        return check_suite(tasks, guesses, progress=True)

    t0 = time.perf_counter()
    try:
        suite = write_suite(a.out, split=a.split, num_per_kind=a.num_per_kind, kinds=a.kinds, check_blind=check_blind)
    except BlindPolicyPasses as e:
        print(f"error: refused, {a.out} not written: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    if not a.no_verify:
        from tqdm import tqdm

        _, tasks = load_suite(a.out)

        def oracle(task):  # doing nothing is the gate's policy `nothing`, which has failed every task by now
            return verify_task(task, nop=False)

        with ThreadPoolExecutor(4) as pool:  # sandbox start-up is I/O-bound
            checked = list(tqdm(pool.map(oracle, tasks), total=len(tasks), desc="verify", unit="task"))
        bad = [(t, c) for t, c in zip(tasks, checked) if not c["valid"]]
        for t, c in bad:
            print(f"error: {t.path}: the reference solution FAILS its test:\n{c['oracle_log']}", file=sys.stderr)
        if bad:
            return 1
    print("blind policy: tasks solved / runs: " + ", ".join(f"{k} {v['solved']}/{v['runs']}"
                                                           for k, v in suite["blind_policies"].items()))
    print("kind: needs the observation, replay rate (fixed-script solves), coincident-answer rate, blind runs solved")
    for k, v in suite["kinds"].items():
        print(f"  {k:22s} {str(v['needs_observation']):5s} replay {v['replay_rate']:.2f} "
              f"coincidence {v['coincidence_rate']:.2f} blind {v['blind_solved']}/{v['blind_runs']}")
    kinds = collections.Counter(t["family"] for t in suite["tasks"])
    unseen = sum(not t["seen"] for t in suite["tasks"])
    print(f"written and blind-checked in {seconds:.0f} s; {suite['num_tasks']} tasks ({a.split} seeds from {suite['seed_base']}) in {a.out}: "
          + ", ".join(f"{f} {n}" for f, n in sorted(kinds.items())) + f"; {unseen} of unseen kinds"
          + ("" if a.no_verify else "; every test passes its reference solution and fails doing nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
