"""The shell code that runs inside a sandbox: the supervisor (PID 1) and the driver (the episode's persistent bash).

    argv = shell_argv(status_fd, stderr_fd, ulimits(600, 256 << 20, 4 << 30, 256), "/run/ds_ttt")
    # ["bash", "--noprofile", "--norc", "-c", SUPERVISOR, "bash", DRIVER]: bwrap's command (bwrap.py), or
    # the whole command line without isolation; RUN_FUNCTION is written to XFER/bash beforehand (shell.py)

bash runs as PID 1 of the sandbox (the SUPERVISOR: PID 1 ignores every signal sent from inside, so no
command can end the sandbox) and starts the DRIVER, the episode's shell. The host sends each command
NUL-terminated on the shell's stdin; the shell `eval`s it in itself (stdin /dev/null, stderr merged into
stdout), then writes `$?` to a separate status pipe (the framing: protocol.py). So `cd`, `export`,
functions and background jobs carry over, the output is exactly the command's bytes, and the exit code
is exact. If the shell itself is what runs (a builtin loop), or it exited (`exit 3`: exit code 3), the
supervisor starts a new shell in the same sandbox and reports the old one's exit.

The code is kept here as strings, not as .sh files shipped beside this module: it reaches bash through
`bash -c` (the sandbox sees no host path but the system directories, so no file of the package could be
run inside), the fds and the limits are put into it here, and its layout is visible to commands: bash
numbers the lines of a `-c` string in its messages, so a run_fresh command whose `cd` fails reads
`bash: line 1: cd: ...` only while the driver is one line.
"""

from __future__ import annotations

import shlex

# PID 1: moves the status / stderr pipes to fds 3 / 4, then runs the episode's shell, again each time it ends.
SUPERVISOR = ('exec 3>&{st} 4>&{err} {st}>&- {err}>&- 5>&2 2>/dev/null; '  # its own messages ("Killed ...") go nowhere
              'while :; do bash --noprofile --norc -c "$1" bash 2>&5 5>&-; builtin printf \'exit %d\\n\' "$?" >&3; done')
RUN_FUNCTION = '__ds_run() { builtin eval "$__ds_cmd"; }\n'
# The episode's shell.
# Requests arrive NUL-terminated on stdin: a kind ("shell": eval here; "fresh": in a subshell, stderr on
# fd 4) and a command. The status goes to fd 3; a command never holds fds 3, 4 or the request pipe.
DRIVER = ("{limits}; builtin printf 'ready %d\\n' $$ >&3; "
          # at a timeout the host sends SIGUSR1 before killing the command's processes: the trap returns
          # from __ds_run, so the rest of the command line is abandoned (as Ctrl-C would in a terminal)
          "trap 'builtin return 130 2>/dev/null' USR1; "
          # __ds_run comes from a file named `bash` (RUN_FUNCTION), so errors read `bash: x: command not found`
          # as in an interactive terminal (a function defined here would be reported as `environment: line 1`)
          "__o=$PWD; builtin cd {xfer} && shopt -u sourcepath && builtin source bash && shopt -s sourcepath; "
          "builtin cd \"$__o\"; unset OLDPWD __o; "
          "while builtin read -r -d '' __ds_kind && builtin read -r -d '' __ds_cmd; do "
          "if [ \"$__ds_kind\" = shell ]; then { __ds_run; } </dev/null 2>&1 3>&- 4>&-; "
          # "reap" (no command): after the host killed jobs of an earlier command, bash's own notices of
          # their deaths ("Killed  sleep 30") are written here, to /dev/null, not into the next command
          # (its answer is "reaped 0", never a command's status: a late one is skipped, not misread)
          "elif [ \"$__ds_kind\" = reap ]; then { builtin jobs; } >/dev/null 2>&1; "
          "builtin printf 'reaped 0\\n' >&3; continue; "
          "else ( builtin eval \"$__ds_cmd\" ) </dev/null 2>&4 3>&- 4>&-; fi; "
          "builtin printf '%d\\n' \"$?\" >&3; done")


def ulimits(cpu_seconds: int, file_bytes: int, memory_bytes: int, processes: int | None) -> str:
    """The driver's first command: RLIMIT_CORE 0, _CPU, _FSIZE, _AS per process, and _NPROC unless None
    (without bwrap the caller's own processes would count against it)."""
    limits = f"ulimit -c 0 -t {cpu_seconds} -f {file_bytes // 1024} -v {memory_bytes // 1024}"
    if processes is not None:
        limits += f" -u {processes}"
    return limits


def shell_argv(st_fd: int, err_fd: int, limits: str, xfer: str) -> list[str]:
    """The command that starts the supervisor: the status and stderr pipes arrive as fds st_fd and err_fd (moved
    to 3 and 4), `limits` opens the driver, `xfer` is the directory holding RUN_FUNCTION's file `bash` (as seen
    by the shell)."""
    return ["bash", "--noprofile", "--norc", "-c", SUPERVISOR.replace("{st}", str(st_fd)).replace("{err}", str(err_fd)), "bash",
            DRIVER.replace("{limits}", limits).replace("{xfer}", shlex.quote(xfer))]
