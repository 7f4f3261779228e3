"""How many CPUs this process may really use: its affinity mask, capped by its cgroup's
CPU quota (``docker run --cpus 2``, a Kubernetes CPU limit). Servers size their thread
pools by it (:mod:`sampling_server.threads`), trainers their decode threads."""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_quota(root: Path = _CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs the cgroup of this process may use per period (its CPU quota), or None when
    there is no quota (or no cgroup file to read)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    candidates: list[tuple[Path, str]] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        rel = rel.lstrip("/")
        if hierarchy == "0" and controllers == "":  # cgroup v2: one unified hierarchy
            candidates.append((root / rel / "cpu.max", "v2"))
            candidates.append((root / "cpu.max", "v2"))
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's hierarchy
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                candidates.append((mount / rel / "cpu.cfs_quota_us", "v1"))
                candidates.append((mount / "cpu.cfs_quota_us", "v1"))
    for path, version in candidates:
        try:
            if version == "v2":
                quota, period = path.read_text().split()[:2]
                return None if quota == "max" else int(quota) / int(period)
            quota_us = int(path.read_text())
            period_us = int((path.parent / "cpu.cfs_period_us").read_text())
            return None if quota_us <= 0 else quota_us / period_us
        except (OSError, ValueError):
            continue
    return None


def usable_cpus() -> int:
    """CPUs this process may run on: its CPU affinity, capped by its cgroup's CPU quota
    (rounded up); at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)
