"""The output directory must be one filesystem for every rank: checked at startup.

Every rank writes its DeepSpeed files into one `.tmp-<tag>/` folder that rank 0 then renames and names
in `latest` (ds_ttt/train/checkpoint.py). That is a checkpoint only if all nodes see the same folder:
RUN_DIR must sit on a filesystem every node mounts at the same path (NFS, Lustre, GPFS, ...). On
node-local disks rank 0 would rename a folder holding only its own node's files.

The check (`check_shared_output`, every rank, at the start of train()): rank 0 picks a fresh folder
name RUN_DIR/.shared-check-<nonce>/ and broadcasts it; each rank writes a marker named by its rank and
hostname; after a barrier rank 0 lists the folder and every rank refuses (ValueError naming the hosts
whose markers rank 0 cannot see) unless all are there; rank 0 then removes the folder.

    from ds_ttt.train.shared_output import check_shared_output
    check_shared_output(run_dir)                        # after torch.distributed is initialised
"""

from __future__ import annotations

import pathlib
import shutil
import socket
import uuid

CHECK_PREFIX = ".shared-check-"


def marker_name(rank: int, host: str) -> str:
    return f"rank_{rank:05d}@{host}"


def write_marker(check_dir: pathlib.Path, rank: int, host: str) -> None:
    check_dir.mkdir(parents=True, exist_ok=True)  # on a node-local disk each node makes its own
    (check_dir / marker_name(rank, host)).write_text(f"{rank} {host}\n")


def missing_markers_message(check_dir: pathlib.Path, hosts_by_rank: list[str], run_dir: pathlib.Path) -> str | None:
    """None when every rank's marker is visible in check_dir, else the one-line refusal."""
    seen = {p.name for p in check_dir.iterdir()} if check_dir.is_dir() else set()
    missing: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts_by_rank):
        if marker_name(rank, host) not in seen:
            missing.setdefault(host, []).append(rank)
    if not missing:
        return None
    hosts = ", ".join(f"{host} (ranks {', '.join(map(str, ranks))})" for host, ranks in sorted(missing.items()))
    return (f"--output {run_dir} is not one shared filesystem: rank 0 on {hosts_by_rank[0]} cannot see the markers "
            f"that {hosts} wrote into {check_dir}; every rank writes into each checkpoint folder that rank 0 "
            "renames, so put --output on a filesystem that every node mounts at the same path (NFS, Lustre, ...)")


def check_shared_output(run_dir: str | pathlib.Path, *, host: str | None = None) -> None:
    """Refuse (ValueError on every rank) unless rank 0 sees a marker from every rank in RUN_DIR."""
    import torch.distributed as dist

    run_dir = pathlib.Path(run_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    host = host or socket.gethostname()
    shared = [f"{CHECK_PREFIX}{uuid.uuid4().hex[:12]}" if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)  # one fresh name per launch: stale markers never count
    check_dir = run_dir / shared[0]
    hosts_by_rank: list[str | None] = [None] * world
    dist.all_gather_object(hosts_by_rank, host)
    write_marker(check_dir, rank, host)
    dist.barrier()
    verdict = [missing_markers_message(check_dir, hosts_by_rank, run_dir) if rank == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    dist.barrier()  # every rank has read the verdict: the markers can go
    shutil.rmtree(check_dir, ignore_errors=True)  # each node's own copy, when not shared
    if verdict[0] is not None:
        raise ValueError(verdict[0])
