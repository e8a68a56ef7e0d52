"""ds_ttt/train/rendezvous.py: the progress line of a rank waiting for its peers, the line saying over
which address and interface it joined, the timeout every process group gets, and the lost-peer stop
message. The real two-node rendezvous: tests/e2e/test_multinode.py.

    python -m pytest tests/unit/test_rendezvous.py
"""

from __future__ import annotations

import datetime
import io
import time

import torch.distributed.distributed_c10d as c10d

from ds_ttt.train import rendezvous
from ds_ttt.train.rendezvous import join_process_group, joined_line, lost_peer_message, waiting_line

ENV = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29500"}


def test_a_rank_names_the_master_it_waits_for():
    assert waiting_line(ENV, "node1", 10.2) == "[rank 1 @ node1] waiting for master 10.77.0.1:29500 (rank 0) ... 10 s"
    assert waiting_line({**ENV, "RANK": "0"}, "node0", 20) == \
        "[rank 0 @ node0] waiting for the other 3 ranks to join at 10.77.0.1:29500 ... 20 s"


def test_waiting_rank_prints_progress_until_joined(monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setattr(rendezvous.socket, "gethostname", lambda: "node1")
    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)  # restored afterwards
    monkeypatch.setattr(c10d, "default_pg_nccl_timeout", c10d.default_pg_nccl_timeout)
    calls, stream = [], io.StringIO()

    def slow_init(**kwargs):  # a master that answers after 0.5 s
        calls.append(kwargs)
        time.sleep(0.5)

    join_process_group(timeout_s=7, backend="gloo", interval_s=0.1, stream=stream, init=slow_init)
    lines = stream.getvalue().splitlines()
    assert calls == [{"dist_backend": "gloo", "timeout": datetime.timedelta(seconds=7)}]
    assert len(lines) >= 3, lines
    for line in lines[:-1]:
        assert line.startswith("[rank 1 @ node1] waiting for master 10.77.0.1:29500 (rank 0) ... "), line
    assert lines[-1] == "[rank 1 @ node1] joined 4 ranks via master 10.77.0.1:29500, interface lo (127.0.0.1)"
    # every later group (DeepSpeed's data-parallel and pipeline groups) gets the same bound
    assert c10d.default_pg_timeout == c10d.default_pg_nccl_timeout == datetime.timedelta(seconds=7)


def test_a_fast_rendezvous_prints_only_the_joined_line():
    stream = io.StringIO()
    join_process_group(timeout_s=1800, backend="gloo", interval_s=5, stream=stream, init=lambda **kw: None)
    assert [line.split("] ")[1].split(" ")[0] for line in stream.getvalue().splitlines()] == ["joined"]


def test_joined_line_without_a_pinned_interface_says_how_to_pin_it():
    line = joined_line({k: v for k, v in ENV.items()}, "node1")
    assert "via master 10.77.0.1:29500" in line and "set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME" in line


def test_lost_peer_message_only_for_a_lost_peer():
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms for recv operation")
    message = lost_peer_message(gloo, timeout_s=30)
    assert message.startswith("lost contact with a peer rank ([gloo/transport/tcp/unbound_buffer.cc:78] Timed out")
    assert "--dist_timeout=30 s" in message and "--resume RUN_DIR" in message and "--output NEW_RUN" in message
    assert lost_peer_message(RuntimeError("Connection closed by peer [10.77.0.2]:1234"), timeout_s=30) is not None
    assert lost_peer_message(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), timeout_s=30) is None
    assert lost_peer_message(ValueError("timed out"), timeout_s=30) is None
