"""The framing between the host and the sandbox's shell: requests on its stdin, status lines on a pipe of their own.

    os.write(requests_fd, encode_request("shell", "cd src && make"))   # b"shell\\0cd src && make\\0"
    reader = StatusReader(status_fd)                                   # non-blocking pipe
    reader.read_line()   # ("status", 0) | ("exit", 3) | ("ready", 2) | ("reaped", 0) | None (no whole line yet)
    drain(output_fd, buf, cap)                                         # what is there, at most cap + 1 bytes kept

Host -> shell, on the shell's stdin: NUL-terminated pairs (kind, command). Kinds: "shell" (eval in the
episode's shell, stderr merged into stdout), "fresh" (in a subshell, stderr on a pipe of its own: run_fresh,
Harbor's exec) and "reap" (no command: the shell takes note of jobs the host killed, `REAP_REQUEST`). A
command cannot contain NUL, so the framing needs no escaping.

Shell -> host, on the status pipe (the shell's fd 3), one line each: "<code>" after a command, "exit <code>"
when the shell ended (the supervisor writes it, then starts a new shell), "ready <pid>" when a shell
has started (its pid inside the sandbox), "reaped 0" after a reap. EOF reads as ("exit", 137), and so
does anything else (not the protocol: the shell is treated as gone). A command's own output goes to a
separate pipe, so nothing it prints can be read as a status.

The other side of the protocol is the shell code in `supervisor.py`; `command.py` (`CommandChannel.run`) drives it, through `process.py`.
"""

from __future__ import annotations

import errno
import os

READ_CHUNK = 1 << 16
REAP_REQUEST = b"reap\0\0"  # 7 bytes: always written whole to a pipe with room


def encode_request(kind: str, payload: str) -> bytes:
    """One request: kind ("shell", "fresh") and command, each NUL-terminated (the command holds no NUL)."""
    return f"{kind}\0{payload}\0".encode()


def parse_status_line(line: bytes) -> tuple[str, int]:
    """("status", code), ("exit", code), ("ready", inner pid) or ("reaped", 0); ("exit", 137) for anything else."""
    words = line.decode(errors="replace").split()
    try:
        if len(words) == 1:
            return ("status", int(words[0]))
        if len(words) == 2 and words[0] in ("exit", "ready", "reaped"):
            return (words[0], int(words[1]))
    except ValueError:
        pass
    return ("exit", 137)  # not the protocol: treat the shell as gone


class StatusReader:
    """The status pipe's lines, read without blocking (a partial line waits in the buffer for the rest)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = b""

    def read_line(self) -> tuple[str, int] | None:
        """One line of the status pipe (`parse_status_line`), None when no whole line has arrived; EOF -> ("exit", 137)."""
        while b"\n" not in self.buf:
            try:
                chunk = os.read(self.fd, 64)
            except BlockingIOError:
                return None
            if not chunk:
                return ("exit", 137) if not self.buf else None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return parse_status_line(line)


def drain(fd: int, buf: bytearray, cap: int) -> None:
    """Read what is there; keep at most cap + 1 bytes in buf (the rest is counted as dropped)."""
    while True:
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno == errno.EAGAIN:
                return
            raise
        if not chunk:
            return
        buf += chunk[: max(0, cap + 1 - len(buf))]
        if len(buf) > cap:
            return
