"""What one command returns (`CommandResult`) and the tool-result text an agent sees of it (`format_observation`).

    res = sb.run("make test")                       # CommandResult(command, output, exit_code, timed_out, ...)
    text = format_observation(res)                  # the output, "[exit code: 2]", "[command timed out]", ...

`Shell.run` / `run_fresh` (shell.py) make the results; the generator (ds_ttt/data/generator.py), the serve
runner and the Harbor agent (ds_ttt/serve/) turn them into observations with `format_observation`, so a
trajectory, a served episode and a Harbor trial read alike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CommandResult:
    command: str
    output: str
    exit_code: int
    timed_out: bool = False
    output_truncated: bool = False  # the output passed max_output_bytes: the command was killed there
    output_bytes: int = 0  # bytes of output the host read (at most max_output_bytes + one chunk)
    shell_restarted: bool = False  # the shell exited or had to be killed: a new one started in the same sandbox
    files_lost: bool = False  # the whole sandbox had to be restarted: its files are gone
    stderr: str = ""  # only for run_fresh (Harbor's exec); run() merges stderr into output
    raw: bytes = b""  # the output's bytes (for binary transfers)
    process_limit_hit: bool = False  # the command left the sandbox at its process limit: its processes were killed
    memory_limit_hit: bool = False  # the kernel killed a process at the episode's memory cap during the command: the command was stopped (exit code 137), unless its line finished before the host saw the kill
    memory_limit_earlier: bool = False  # ... since the previous command (a background job was killed there)
    memory_limit_bytes: int = 0  # the episode's memory cap (for the note), 0 without a cgroup


def format_observation(result: CommandResult, max_chars: int = 2000) -> str:
    """The tool-result text the agent sees: the real output, trimmed of trailing newlines, with the exit
    status appended when non-zero (and a note when the command timed out, the output was cut, or the
    shell had to be restarted)."""
    out = result.output.rstrip("\n")
    notes = []
    if result.output_truncated:
        out = out[:max_chars]
        notes.append(f"[output truncated: the command was killed after {result.output_bytes} bytes of output]")
    elif len(out) > max_chars:
        notes.append(f"[output truncated: {len(result.output)} chars]")
        out = out[:max_chars]
    if result.timed_out:
        notes.append("[command timed out]")
    elif not result.output_truncated and result.exit_code != 0:
        notes.append(f"[exit code: {result.exit_code}]")
    if result.process_limit_hit:
        notes.append("[the sandbox was at its process limit: every process this command started was killed]")
    if result.memory_limit_earlier:
        notes.append(f"[a background process was killed: the sandbox reached its memory limit of "
                     f"{result.memory_limit_bytes >> 20} MiB after the previous command]")
    if result.memory_limit_hit and result.exit_code == 137:
        notes.append(f"[command killed: the sandbox reached its memory limit of {result.memory_limit_bytes >> 20} MiB]")
    elif result.memory_limit_hit:  # the command line ended before the host saw the kill (see shell.py's docstring)
        notes.append(f"[a process of this command was killed: the sandbox reached its memory limit of "
                     f"{result.memory_limit_bytes >> 20} MiB]")
    if result.files_lost:
        notes.append("[the sandbox was restarted: its files are lost; the working directory, variables and "
                     "background jobs are reset]")
    elif result.shell_restarted:
        notes.append("[the shell was restarted: files are kept; the working directory, variables and background "
                     "jobs are reset]")
    if notes:
        out += ("\n" if out else "") + "\n".join(notes)
    return out if out else "(no output)"
