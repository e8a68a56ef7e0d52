"""Joining the process group: a progress line while a rank waits for its peers, and one bound on how
long any peer may stay silent afterwards.

`join_process_group(timeout_s)` wraps `deepspeed.init_distributed`. While the rendezvous blocks (a rank
other than 0 waits for the master's TCP store; rank 0 waits for the other ranks to connect) a
background thread prints every `interval_s` seconds who this rank waits for:

    [rank 1 @ node1] waiting for master 10.77.0.1:29500 (rank 0) ... 10 s
    [rank 0 @ node0] waiting for the other 3 ranks to join at 10.77.0.1:29500 ... 10 s

and once joined, one line saying over what it talks (the master address and the socket interface the
collectives bind to, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME):

    [rank 1 @ node1] joined 2 ranks via master 10.77.0.1:29500, interface ttt0 (10.77.0.2)

`timeout_s` is every process group's timeout: the rendezvous itself, and afterwards every collective,
gives up after that many seconds without its peers (a node lost mid-run: power, kernel, network) and
raises, so the surviving ranks stop with `lost_peer_message` instead of hanging. A peer whose process
dies while its node stays up closes its sockets, and the survivors stop at once.

    from ds_ttt.train.rendezvous import join_process_group, lost_peer_message
    join_process_group(timeout_s=600, backend="gloo")       # launch/train.py, --dist_timeout
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from typing import Callable, Mapping, TextIO

DEFAULT_TIMEOUT_S = 1800  # torch's own default for gloo and NCCL process groups (30 min)
PROGRESS_INTERVAL_S = 10.0
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def rank_label(env: Mapping[str, str], host: str) -> str:
    return f"[rank {env.get('RANK', '0')} @ {host}]"


def master_of(env: Mapping[str, str]) -> str:
    return f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"


def waiting_line(env: Mapping[str, str], host: str, elapsed_s: float) -> str:
    """Who this rank waits for, from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    if rank == 0:
        who = f"the other {world - 1} ranks to join at {master_of(env)}"
    else:
        who = f"master {master_of(env)} (rank 0)"
    return f"{rank_label(env, host)} waiting for {who} ... {elapsed_s:.0f} s"


def interface_address(ifname: str) -> str | None:
    """The IPv4 address of a network interface (Linux SIOCGIFADDR), None if it has none."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def joined_line(env: Mapping[str, str], host: str) -> str:
    ifname = next((env[k] for k in IFNAME_VARIABLES if env.get(k)), None)
    if ifname is None:
        where = "interface chosen by the backend (set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to pin it)"
    else:
        where = f"interface {ifname} ({interface_address(ifname) or 'no IPv4 address'})"
    return f"{rank_label(env, host)} joined {env.get('WORLD_SIZE', '1')} ranks via master {master_of(env)}, {where}"


class ProgressPrinter:
    """Prints `line(elapsed_s)` every `interval_s` seconds on a daemon thread until stopped."""

    def __init__(self, line: Callable[[float], str], interval_s: float, stream: TextIO):
        self._line, self._interval_s, self._stream = line, interval_s, stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rendezvous-progress", daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.wait(self._interval_s):
            print(self._line(time.monotonic() - start), file=self._stream, flush=True)

    def __enter__(self) -> "ProgressPrinter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def bound_every_group(timeout_s: float) -> None:
    """Make `timeout_s` the timeout of every process group, not only the world's: torch's new_group()
    (DeepSpeed's data-parallel, pipeline and ZeRO groups) takes torch's module default (30 min), not
    init_process_group's timeout, so without this a step's all-reduce would wait 30 min for a lost node."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = datetime.timedelta(seconds=timeout_s)


def join_process_group(*, timeout_s: float, backend: str, interval_s: float = PROGRESS_INTERVAL_S,
                       stream: TextIO = sys.stderr, init: Callable[..., None] | None = None) -> None:
    """`deepspeed.init_distributed(backend, timeout=timeout_s)` with a progress line while it waits."""
    if init is None:
        import deepspeed
        init = deepspeed.init_distributed
    bound_every_group(timeout_s)
    env, host = dict(os.environ), socket.gethostname()
    with ProgressPrinter(lambda elapsed: waiting_line(env, host, elapsed), interval_s, stream):
        init(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    print(joined_line(env, host), file=stream, flush=True)


LOST_PEER_SIGNS = ("timed out", "timeout", "connection closed by peer", "connection reset", "broken pipe",
                   "socket closed", "connection refused", "no route to host")


def lost_peer_message(error: BaseException, *, timeout_s: float) -> str | None:
    """The one-line stop message when `error` is a collective that lost its peers, else None."""
    import torch.distributed as dist

    text = str(error)
    is_backend = isinstance(error, (dist.DistBackendError, dist.DistNetworkError))
    if not is_backend and not (isinstance(error, RuntimeError) and any(s in text.lower() for s in LOST_PEER_SIGNS)):
        return None
    first = text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__
    return (f"lost contact with a peer rank ({first}); a rank stops after at most --dist_timeout={timeout_s:g} s "
            "without its peers. Its node died or left the network: `latest` in --output still names the last "
            "whole checkpoint, so relaunch on every node with --resume RUN_DIR (same layout), or move the run "
            "to the nodes you have left with --resume RUN_DIR --output NEW_RUN --deepspeed_config OTHER.json")
