"""The output directory must be shared by every node: rank 0 sees each rank's marker, or the run is
refused naming the hosts whose markers it cannot see (a node-local disk simulated by two folders).

    python -m pytest tests/unit/test_shared_output.py
"""

from __future__ import annotations

from ds_ttt.train.shared_output import missing_markers_message, write_marker

HOSTS = ["node-a", "node-a", "node-b", "node-b"]


def test_shared_directory_passes(tmp_path):
    check = tmp_path / "run" / ".shared-check-x"
    for rank, host in enumerate(HOSTS):
        write_marker(check, rank, host)
    assert missing_markers_message(check, HOSTS, tmp_path / "run") is None


def test_node_local_directory_is_refused_naming_the_hosts(tmp_path):
    # node-b's ranks write the same path on their own disk: rank 0 (node-a) never sees them
    on_a, on_b = tmp_path / "node-a" / "run" / ".shared-check-x", tmp_path / "node-b" / "run" / ".shared-check-x"
    for rank, host in enumerate(HOSTS):
        write_marker(on_a if host == "node-a" else on_b, rank, host)
    msg = missing_markers_message(on_a, HOSTS, tmp_path / "node-a" / "run")
    assert msg is not None and "\n" not in msg
    assert "rank 0 on node-a cannot see the markers that node-b (ranks 2, 3) wrote" in msg
    assert "node-a (" not in msg and "mounts at the same path" in msg


def test_a_marker_of_another_host_with_the_same_rank_does_not_count(tmp_path):
    check = tmp_path / ".shared-check-x"
    write_marker(check, 0, "node-a")
    write_marker(check, 1, "node-c")  # a different node's rank 1 (e.g. a stale or foreign launch)
    assert "node-b (ranks 1)" in missing_markers_message(check, ["node-a", "node-b"], tmp_path)
