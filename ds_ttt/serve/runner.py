"""Try a model on a real task: the agent's bash tool calls run in a sandboxed throwaway directory.

    .venv/bin/python -m ds_ttt.serve.runner --model EXPORT --task "Count the lines of notes.txt" \
        [--setup-dir DIR] [--max-rounds 20] [--timeout 10] [--temperature 0] [--max-new-tokens 512] [--keep] \
        [--device cpu] [--attention-backend {auto,reference,cpu,cuda}] [--no-isolation] [--no-cgroup-caps]

Each command runs through `ds_ttt.sandbox.Sandbox`, the generator's own sandbox, so the
observations look exactly like the training data: one persistent bash per episode (a `cd`, an
`export` or a background job carries over to the next call) in a bubblewrap sandbox with no network,
an unprivileged uid, only its own size-capped working directory (`/app`, also HOME) and /tmp writable,
C locale, fixed PATH, stdin from /dev/null, a timeout that kills the command (the shell and its files
stay), an output cap and process/memory/file limits (docs/sandbox.md says what it protects and what
it does not). Without `bwrap` the runner refuses, naming the install command; --no-isolation accepts
running the model's commands with this machine's network, files and process table. The episode also
runs in a cgroup of its own capping its total memory, processes and CPU; where none can be made the
runner refuses with the fix, and --no-cgroup-caps accepts running without.
The output is formatted by `format_observation` (exit code, timeout and shell-restart notes appended,
long output cut). With --keep the working directory is copied out to the printed directory at the end.
Prints one JSON line per round (message, observation, observation loss) and a final summary, which
records the sandbox isolation used ("bwrap" or "none"), the cgroup caps used ("cgroup-v1", "cgroup-v2",
"systemd" or "none") and the attention backend.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ds_ttt.sandbox import Sandbox, format_observation


class BashToolRunner:
    """Executes `bash` tool calls (arguments {"command": ...}) in one episode's sandbox and shell.

    `sandbox_options` go to `Sandbox` (limits such as max_disk_bytes, max_processes)."""

    def __init__(self, *, timeout: float = 10.0, max_output_chars: int = 2000, keep: bool = False,
                 setup_dir: str | Path | None = None, isolation: str = "required", **sandbox_options):
        self.sandbox = Sandbox(keep=keep, timeout=timeout, isolation=isolation, **sandbox_options)
        self.max_output_chars = max_output_chars
        if setup_dir is not None:
            self.sandbox.add_tree(setup_dir)

    @property
    def root(self) -> Path:
        return self.sandbox.root

    @property
    def isolation(self) -> str:
        """What the sandbox uses: "bwrap" (bubblewrap) or "none" (--no-isolation)."""
        return self.sandbox.isolation

    @property
    def cgroup_caps(self) -> str:
        """How the episode is capped: "cgroup-v1", "cgroup-v2", "systemd" or "none" (--no-cgroup-caps)."""
        return self.sandbox.cgroup_caps

    def __enter__(self) -> "BashToolRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sandbox.__exit__(None, None, None)

    def execute(self, call: dict) -> str:
        """The observation text for one tool call (errors are reported to the agent, never raised)."""
        fn = call.get("function", call)
        name = fn.get("name")
        if name != "bash":
            return f"[error: unknown tool {name!r}; the only tool is bash]"
        try:
            args = fn.get("arguments")
            args = json.loads(args) if isinstance(args, str) else (args or {})
            command = args["command"]
            if not isinstance(command, str):
                raise TypeError("command must be a string")
        except (ValueError, KeyError, TypeError) as e:
            return f"[error: bad bash arguments: {e}]"
        return format_observation(self.sandbox.run(command), max_chars=self.max_output_chars)


def run_episode(session, task: str, runner: BashToolRunner, *, max_rounds: int = 20, on_round=None) -> dict:
    """act → execute every tool call → observe, until an action makes no tool call or max_rounds."""
    session.reset(task)
    rounds = []
    finished, stop = False, "max_rounds"
    for _ in range(max_rounds):
        message = session.act()
        calls = message.get("tool_calls") or []
        invalid = message.get("invalid_tool_calls") or []
        if not calls and not invalid:  # a final answer, unless generation hit max_new_tokens
            rounds.append({"round": session.round, "message": message})
            finished = not message.get("truncated")
            stop = "answer" if finished else "truncated"
            if on_round:
                on_round(rounds[-1])
            break
        outputs = [runner.execute(c) for c in calls] + [f"[error: invalid tool call: {b['error']}]" for b in invalid]
        loss = session.observe(outputs)
        rounds.append({"round": session.round, "message": message, "outputs": outputs, "obs_loss": loss})
        if on_round:
            on_round(rounds[-1])
    return {"task": task, "finished": finished, "stop": stop, "num_rounds": len(rounds), "rounds": rounds,
            "num_tokens": len(session.input_ids)}


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
    p.add_argument("--keep", action="store_true", help="keep the sandbox directory")
    p.add_argument("--no-isolation", action="store_true",
                   help="run the model's commands without bubblewrap (with this machine's network, files and "
                        "process table) where it is unavailable; recorded in the summary")
    p.add_argument("--no-cgroup-caps", action="store_true",
                   help="run the episode without a cgroup capping its total memory, processes and CPU where none can "
                        "be made; recorded in the summary")
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
        result = run_episode(session, args.task, runner, max_rounds=args.max_rounds,
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
