"""The CPU KV cache's "free memory" inside a container: the host's MemAvailable, bounded by
the memory cgroup's limit minus what the cgroup holds (v1 and v2 layouts, as files)."""
from pathlib import Path

import pytest

from pdserve.engine.worker.host_memory import available_host_memory, cgroup_memory

GiB = 1 << 30


def at_root(tmp_path: Path) -> Path:
    """/proc/self/cgroup of a process in its container's own namespace: every controller at /."""
    path = tmp_path / "cgroup"
    path.write_text("4:memory:/\n1:name=systemd:/\n0::/\n")
    return path


def meminfo(tmp_path: Path, available_gib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {64 * GiB // 1024} kB\nMemAvailable:   {available_gib * GiB // 1024} kB\n")
    return path


def cgroup_v2(tmp_path: Path, limit: str, current: int, inactive_file: int) -> Path:
    root = tmp_path / "v2"
    root.mkdir()
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    (root / "memory.stat").write_text(f"anon {current - inactive_file}\ninactive_file {inactive_file}\n")
    return root


def cgroup_v1(tmp_path: Path, limit: int, usage: int, inactive_file: int) -> Path:
    root = tmp_path / "v1"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (root / "memory" / "memory.stat").write_text(f"cache 0\ninactive_file 7\ntotal_inactive_file {inactive_file}\n")
    return root


def test_a_pods_limit_bounds_the_free_memory_a_node_reports(tmp_path):
    """A 4 GiB pod holding 1.5 GiB (0.5 of it reclaimable page cache) on a node with 22 GiB free."""
    root = cgroup_v2(tmp_path, str(4 * GiB), 3 * GiB // 2, GiB // 2)
    assert available_host_memory(meminfo(tmp_path, 22), root, at_root(tmp_path)) == 3 * GiB


def test_cgroup_v1_is_read_with_its_own_file_names(tmp_path):
    root = cgroup_v1(tmp_path, 2 * GiB, GiB, GiB // 4)
    assert cgroup_memory(root, at_root(tmp_path)).room == 2 * GiB - 3 * GiB // 4
    assert available_host_memory(meminfo(tmp_path, 22), root, at_root(tmp_path)) == 2 * GiB - 3 * GiB // 4


@pytest.mark.parametrize("layout", ["v2 max", "v1 unlimited", "none"])
def test_no_limit_leaves_the_hosts_free_memory(tmp_path, layout):
    if layout == "v2 max":
        root = cgroup_v2(tmp_path, "max", GiB, 0)
    elif layout == "v1 unlimited":  # the kernel's page-rounded 2^63
        root = cgroup_v1(tmp_path, 9223372036854771712, GiB, 0)
    else:
        root = tmp_path / "empty"
        root.mkdir()
    assert cgroup_memory(root, at_root(tmp_path)) is None
    assert available_host_memory(meminfo(tmp_path, 22), root, at_root(tmp_path)) == 22 * GiB


def test_a_node_with_less_free_than_the_pods_room_gives_the_node_s(tmp_path):
    root = cgroup_v2(tmp_path, str(16 * GiB), GiB, 0)
    assert available_host_memory(meminfo(tmp_path, 4), root, at_root(tmp_path)) == 4 * GiB


def test_a_cgroup_at_its_limit_has_no_room(tmp_path):
    root = cgroup_v2(tmp_path, str(GiB), GiB + 4096, 0)
    assert available_host_memory(meminfo(tmp_path, 22), root, at_root(tmp_path)) == 0


def test_a_service_on_the_host_reads_its_own_cgroup_not_the_root(tmp_path):
    """v2 on a host: the root has no memory.max; a systemd service's MemoryMax sits in the
    cgroup /proc/self/cgroup names."""
    root = tmp_path / "v2host"
    (root / "system.slice" / "pdserve.service").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    own = root / "system.slice" / "pdserve.service"
    (own / "memory.max").write_text(f"{8 * GiB}\n")
    (own / "memory.current").write_text(f"{2 * GiB}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/system.slice/pdserve.service\n")
    assert available_host_memory(meminfo(tmp_path, 22), root, proc) == 6 * GiB


def test_a_v1_container_whose_cgroup_path_is_not_mounted_reads_its_mount(tmp_path):
    """podman on cgroup v1 without a cgroup namespace: /proc/self/cgroup names the host's
    path, and the container's own cgroup is bind-mounted at /sys/fs/cgroup/memory."""
    root = cgroup_v1(tmp_path, 4 * GiB, GiB, 0)
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/libpod_parent/libpod-5bed6b38\n0::/libpod_parent/libpod-5bed6b38\n")
    assert available_host_memory(meminfo(tmp_path, 22), root, proc) == 3 * GiB
