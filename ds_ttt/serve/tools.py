"""The agent's one tool, `bash`: parse a tool call and run it in an episode's sandboxed shell.

    from ds_ttt.serve.tools import BashToolRunner, parse_bash_call
    with BashToolRunner(timeout=10, setup_dir="task/environment") as tools:
        tools.execute({"function": {"name": "bash", "arguments": '{"command": "ls"}'}})   # -> "notes.txt"
    command, error = parse_bash_call("bash", '{"command": "ls"}')                         # ("ls", None)

Each command runs through `ds_ttt.sandbox.Sandbox`, the generator's own sandbox, so the observations
look exactly like the training data: one persistent bash per episode (a `cd`, an `export` or a
background job carries over to the next call) in a bubblewrap sandbox with no network, an unprivileged
uid, only its own size-capped working directory (`/app`, also HOME) and /tmp writable, C locale, fixed
PATH, stdin from /dev/null, a timeout that kills the command (the shell and its files stay), an output
cap and process/memory/file limits (docs/sandbox.md says what it protects and what it does not).
Without `bwrap` the runner refuses, naming the install command; isolation="none" accepts running the
model's commands with this machine's network, files and process table. The episode also runs in a
cgroup of its own capping its total memory, processes and CPU (cgroup_caps="none" declines).
The output is formatted by `format_observation` (exit code, timeout and shell-restart notes appended,
long output cut).

`parse_bash_call` is the one reading of a tool call: the closed-loop evaluation, the task CLI and the
Harbor agent (whose commands run in Harbor's environment instead) all report a bad call to the model
with its error text. The episode loop that calls `execute` is ds_ttt/serve/episode.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from ds_ttt.sandbox import Sandbox, format_observation


def parse_bash_call(function_name: str | None, arguments) -> tuple[str | None, str | None]:
    """(command, None) for a well-formed bash call, else (None, the error observation for the model).
    `arguments` is the call's JSON string (OpenAI's wire form) or an already parsed dict."""
    if function_name != "bash":
        return None, f"[error: unknown tool {function_name!r}; the only tool is bash]"
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else (arguments or {})
        command = args["command"]
        if not isinstance(command, str):
            raise TypeError("command must be a string")
    except (ValueError, KeyError, TypeError) as e:
        return None, f"[error: bad bash arguments: {e}]"
    return command, None


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
        """What the sandbox uses: "bwrap" (bubblewrap) or "none" (isolation="none")."""
        return self.sandbox.isolation

    @property
    def cgroup_caps(self) -> str:
        """How the episode is capped: "cgroup-v1", "cgroup-v2", "systemd" or "none" (cgroup_caps="none")."""
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
        command, error = parse_bash_call(fn.get("name"), fn.get("arguments"))
        if command is None:
            return error
        return format_observation(self.sandbox.run(command), max_chars=self.max_output_chars)
