"""Try a model on a real task: the agent's bash tool calls run in a sandboxed throwaway directory.

    .venv/bin/python -m ds_ttt.serve.frontends.task_cli --model EXPORT --task "Count the lines of notes.txt" \
        [--setup-dir DIR] [--max-rounds 20] [--timeout 10] [--temperature 0] [--max-new-tokens 512] [--keep] \
        [--device cpu] [--attention-backend {auto,reference,cpu,cuda}] [--no-isolation] [--no-cgroup-caps]

The episode is the one loop (ds_ttt/serve/episode.py) on an in-process AgentSession, its commands run
by `BashToolRunner` (ds_ttt/serve/tools.py): the generator's own sandbox, one persistent bash per
episode in a bubblewrap sandbox with no network (docs/sandbox.md). Without `bwrap` the runner refuses,
naming the install command; --no-isolation accepts running the model's commands with this machine's
network, files and process table. The episode also runs in a cgroup of its own capping its total
memory, processes and CPU; where none can be made the runner refuses with the fix, and
--no-cgroup-caps accepts running without. With --keep the working directory is copied out to the
printed directory at the end.
Prints one JSON line per round (message, observation, observation loss) and a final summary, which
records the sandbox isolation used ("bwrap" or "none"), the cgroup caps used ("cgroup-v1", "cgroup-v2",
"systemd" or "none") and the attention backend. Exit status 0 when the episode ended with an answer.
"""

from __future__ import annotations

import json
import sys

from ds_ttt.serve.episode import SessionAgent, run_episode
from ds_ttt.serve.tools import BashToolRunner


def run_task(session, task: str, tools, *, max_rounds: int = 20, on_round=None) -> dict:
    """Reset `session` with `task` and run the episode loop; a JSON-friendly record of it."""
    session.reset(task)
    episode = run_episode(SessionAgent(session), tools, max_rounds=max_rounds,
                          on_round=on_round and (lambda r: on_round(r.to_dict())))
    return {"task": task, "finished": episode.finished, "stop": episode.stop, "num_rounds": len(episode.rounds),
            "rounds": [r.to_dict() for r in episode.rounds], "num_tokens": len(session.input_ids)}


def main(argv=None) -> int:
    import argparse

    from ds_ttt.config import ATTENTION_BACKENDS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="export directory")
    p.add_argument("--task", required=True)
    p.add_argument("--setup-dir", default=None, help="copied into the sandbox before the episode")
    p.add_argument("--max-rounds", type=int, default=20)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per command")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="reference",
                   help="attention kernel: reference (default), auto (cuda on a GPU, cpu kernel on a CPU), cpu, cuda")
    for flag, help_text in (
            ("--keep", "keep the sandbox directory"),
            ("--no-isolation", "run the model's commands without bubblewrap (with this machine's network, files and "
                               "process table) where it is unavailable; recorded in the summary"),
            ("--no-cgroup-caps", "run the episode without a cgroup capping its total memory, processes and CPU where "
                                 "none can be made; recorded in the summary")):
        p.add_argument(flag, action="store_true", help=help_text)
    args = p.parse_args(argv)
    from ds_ttt.serve.session import AgentSession

    session = AgentSession(args.model, device=args.device, temperature=args.temperature,
                           max_new_tokens=args.max_new_tokens, attention_backend=args.attention_backend)
    if args.no_isolation:
        print("warning: --no-isolation: the model's commands run with this machine's network, write access and "
              "process table", file=sys.stderr, flush=True)
    if args.no_cgroup_caps:
        print("warning: --no-cgroup-caps: the model's commands can use all of this machine's memory, processes and CPU",
              file=sys.stderr, flush=True)
    with BashToolRunner(timeout=args.timeout, keep=args.keep, setup_dir=args.setup_dir,
                        isolation="none" if args.no_isolation else "required",
                        cgroup_caps="none" if args.no_cgroup_caps else "required") as runner:
        result = run_task(session, args.task, runner, max_rounds=args.max_rounds,
                          on_round=lambda r: print(json.dumps(r, ensure_ascii=False), flush=True))
        summary = {k: v for k, v in result.items() if k != "rounds"}
        summary["attention_backend"] = session.agent.attention_backend
        summary["isolation"] = runner.isolation
        summary["cgroup_caps"] = runner.cgroup_caps
        if args.keep:
            summary["sandbox"] = str(runner.root)
    print(json.dumps(summary), flush=True)
    return 0 if result["finished"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
