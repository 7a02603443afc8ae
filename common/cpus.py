"""How many CPUs this process may really use: the default of `python -m serve --workers` and of
`python -m train --devices` on a host without GPUs. Imports nothing heavy."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup CPU limit (a container's
    `--cpus`, a Kubernetes CPU limit), which the affinity does not show."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cpus, quota)) if quota else max(1, cpus)


def _cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> int | None:
    """The cgroup's CPU limit rounded up to whole CPUs (v2 `cpu.max`, v1 `cpu.cfs_quota_us`); None if none."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            with open(os.path.join(root, quota_file)) as handle:
                fields = handle.read().split()
            if period_file is not None:
                with open(os.path.join(root, period_file)) as handle:
                    fields.append(handle.read().strip())
        except OSError:
            continue
        if len(fields) < 2 or fields[0] in ("max", "-1"):
            return None
        try:
            quota, period = int(fields[0]), int(fields[1])
        except ValueError:
            return None
        return -(-quota // period) if quota > 0 and period > 0 else None
    return None
