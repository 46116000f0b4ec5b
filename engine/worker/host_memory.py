"""Free host memory as this process may use it: the host's, bounded by its container's limit.

In a Kubernetes pod /proc/meminfo shows the node's memory, not the pod's `limits.memory`, so
a KV cache sized from it on a large node outgrows the limit and the pod is OOM-killed (or,
with swap, pages until its probes fail). The cgroup's limit minus what it holds is the bound.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CgroupMemory:
    limit: int  # bytes the cgroup may hold
    usage: int  # bytes it holds, page cache included
    reclaimable: int  # the inactive page cache the kernel drops before it OOM-kills

    @property
    def room(self) -> int:
        return max(0, self.limit - (self.usage - self.reclaimable))


def meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"cannot read MemAvailable from {meminfo}")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except OSError:
        pass
    return 0


def _own_dir(mount: Path, proc_cgroup: Path, v2: bool) -> Path:
    """This process's cgroup under `mount`: the path /proc/self/cgroup names, where it exists
    there (a service's cgroup on the host); else the mount itself, which a container with
    its own cgroup namespace, or v1's bind mount of its cgroup, shows as the root."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return mount
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (controllers == "" if v2 else "memory" in controllers.split(",")):
            own = mount / path.lstrip("/")
            return own if own.is_dir() else mount
    return mount


def cgroup_memory(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> CgroupMemory | None:
    """This process's memory cgroup (v2 unified, else v1), or None where it sets no limit."""
    if (root / "memory.max").exists() or (root / "cgroup.controllers").exists():  # v2
        own = _own_dir(root, proc_cgroup, v2=True)
        limit, usage = _read_int(own / "memory.max"), _read_int(own / "memory.current")
        inactive = _stat(own / "memory.stat", "inactive_file")
    else:  # v1
        own = _own_dir(root / "memory", proc_cgroup, v2=False)
        limit, usage = _read_int(own / "memory.limit_in_bytes"), _read_int(own / "memory.usage_in_bytes")
        inactive = _stat(own / "memory.stat", "total_inactive_file")
    # v1 writes a page-rounded 2^63 for no limit
    if limit is None or usage is None or limit >= 1 << 62:
        return None
    return CgroupMemory(limit, usage, min(inactive, usage))


def available_host_memory(meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = CGROUP_ROOT,
                          proc_cgroup: Path = PROC_CGROUP) -> int:
    host = meminfo_available(meminfo)
    cgroup = cgroup_memory(cgroup_root, proc_cgroup)
    return host if cgroup is None else min(host, cgroup.room)
