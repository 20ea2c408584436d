"""The default number of CPU threads, shared by the engine, bench and calibrate.

llama.cpp's rule (common's `cpu_get_num_math`): one thread per physical core, performance cores only on a
hybrid CPU; here also no more than the CPUs this process may run on (its affinity) and its cgroup's CPU
quota, so that a container limited to 2 CPUs runs 2 threads. Every reader takes a root folder, so that the
tests can hand it a fake /proc and /sys.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CPU_SYS = Path("sys/devices/system/cpu")
HYBRID_CORES = Path("sys/devices/cpu_core/cpus")  # a hybrid Intel CPU's performance cores
CGROUP_ROOT = Path("sys/fs/cgroup")
V1_CPU_FOLDERS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list such as ``0-3,8,10-11``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def read_text(path: Path) -> str | None:
    """The file's text, or None where it cannot be read."""
    try:
        return path.read_text()
    except OSError:
        return None


def usable_cpus(root: Path, affinity: set[int]) -> set[int]:
    """The CPUs of ``affinity`` to compute on: its performance cores on a hybrid CPU (all of it elsewhere, or
    where it holds none of them)."""
    text = read_text(root / HYBRID_CORES)
    performance = affinity & parse_cpu_list(text) if text else set()
    return performance or affinity


def physical_cores(root: Path, cpus: set[int]) -> int:
    """How many physical cores ``cpus`` span (SMT siblings count once); where the topology cannot be read,
    llama.cpp's guess: half of them from 5 up."""
    siblings = set()
    for cpu in cpus:
        text = read_text(root / CPU_SYS / f"cpu{cpu}" / "topology" / "thread_siblings_list")
        if text is None:
            return len(cpus) if len(cpus) <= 4 else len(cpus) // 2
        siblings.add(frozenset(parse_cpu_list(text)))
    return len(siblings)


def quota_cpus(folder: Path) -> float | None:
    """The CPUs one cgroup folder's quota allows (cgroup v2 cpu.max, v1 cpu.cfs_quota_us), None if unlimited."""
    text = read_text(folder / "cpu.max")
    if text is not None:
        fields = text.split()  # "QUOTA PERIOD" or "max PERIOD"
        return None if not fields or fields[0] == "max" else int(fields[0]) / int(fields[1])
    quota_text, period_text = read_text(folder / "cpu.cfs_quota_us"), read_text(folder / "cpu.cfs_period_us")
    if quota_text is None or period_text is None or int(quota_text) <= 0:
        return None
    return int(quota_text) / int(period_text)


def cgroup_cpus(root: Path) -> int | None:
    """The CPUs this process's cgroups allow, rounded up: the tightest quota from its own cgroup up to the
    root, in v2 and in v1's cpu controller; None where none is set."""
    folders = []
    for line in (read_text(root / "proc/self/cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        bases = [root / CGROUP_ROOT] if controllers == "" else (
            [root / CGROUP_ROOT / name for name in V1_CPU_FOLDERS] if "cpu" in controllers.split(",") else [])
        for base in bases:
            folder = base / path.strip().lstrip("/")
            folders += [folder, *(p for p in folder.parents if p.is_relative_to(base))]
    quotas = [q for folder in folders if (q := quota_cpus(folder)) is not None]
    return max(1, math.ceil(min(quotas))) if quotas else None


def process_affinity() -> set[int]:
    """The CPUs this process may run on (every CPU where the platform cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def default_threads(root: Path = Path("/"), affinity: set[int] | None = None) -> int:
    """One thread per physical (performance) core this process may use, within its cgroup's CPU quota."""
    cores = physical_cores(root, usable_cpus(root, process_affinity() if affinity is None else affinity))
    quota = cgroup_cpus(root)
    return max(1, min(cores, quota) if quota is not None else cores)
