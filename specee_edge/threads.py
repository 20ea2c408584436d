"""The default number of CPU threads, shared by the engine, bench and calibrate.

llama.cpp's rule (common's `cpu_get_num_math`): one thread per physical core, performance cores only on a
hybrid CPU; here also no more than the CPUs this process may run on (its affinity) and its cgroup's CPU
quota, so that a container limited to 2 CPUs runs 2 threads. Every reader takes a root folder, so that the
tests can hand it a fake /proc and /sys. Where there is no /sys (macOS, Windows) the operating system says
how many cores there are, as llama.cpp asks it (`cpu_get_num_physical_cores`); the calls into it are apart
from the pure functions that read their answers, so that the tests can hand those a fake answer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import struct
import sys
from collections.abc import Callable
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


def sibling_cores(root: Path, cpus: set[int]) -> int | None:
    """How many physical cores ``cpus`` span (SMT siblings count once); None where the topology cannot be
    read."""
    siblings = set()
    for cpu in cpus:
        text = read_text(root / CPU_SYS / f"cpu{cpu}" / "topology" / "thread_siblings_list")
        if text is None:
            return None
        siblings.add(frozenset(parse_cpu_list(text)))
    return len(siblings)


def guessed_cores(cpus: int) -> int:
    """llama.cpp's guess where nothing tells the cores: all of ``cpus`` up to 4, half of them from 5 up."""
    return cpus if cpus <= 4 else cpus // 2


def macos_cores(sysctl: Callable[[str], int | None]) -> int | None:
    """The performance cores of a Mac (``hw.perflevel0``: an M1 Pro's 8 of its 10 cores), else its physical
    cores (a macOS before 12 has no perflevels); None where ``sysctl`` answers neither."""
    return sysctl("hw.perflevel0.physicalcpu") or sysctl("hw.physicalcpu")


def read_sysctl_int(name: str) -> int | None:
    """A 32-bit integer of macOS's sysctl by name; None where the call fails (or there is no sysctlbyname)."""
    try:
        sysctlbyname = ctypes.CDLL(ctypes.util.find_library("c")).sysctlbyname
    except (OSError, AttributeError):
        return None
    sysctlbyname.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                             ctypes.c_size_t]
    sysctlbyname.restype = ctypes.c_int
    value, size = ctypes.c_int32(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int32))
    failed = sysctlbyname(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0)
    return None if failed else value.value


RELATION_PROCESSOR_CORE = 0  # LOGICAL_PROCESSOR_RELATIONSHIP's RelationProcessorCore
RECORD_HEAD = struct.Struct("<II")  # SYSTEM_LOGICAL_PROCESSOR_INFORMATION_EX: Relationship, Size
EFFICIENCY_CLASS_OFFSET = 9  # in a record: after the head, PROCESSOR_RELATIONSHIP's Flags byte


def windows_cores(records: bytes) -> int | None:
    """The performance cores among the processor-core records of Windows's GetLogicalProcessorInformationEx
    (one record a physical core, its SMT threads in it): those of the highest efficiency class, which is 0
    for every core but on a hybrid CPU; None where there is no record. llama.cpp counts every core here;
    keeping the highest class only is the rule /sys and macOS follow, performance cores."""
    classes = []
    offset = 0
    while offset + RECORD_HEAD.size <= len(records):
        relationship, size = RECORD_HEAD.unpack_from(records, offset)
        if size <= EFFICIENCY_CLASS_OFFSET or offset + size > len(records):
            break  # a torn record: stop rather than loop forever or read past the buffer
        if relationship == RELATION_PROCESSOR_CORE:
            classes.append(records[offset + EFFICIENCY_CLASS_OFFSET])
        offset += size
    return classes.count(max(classes)) if classes else None


def processor_core_records() -> bytes | None:
    """Windows's processor-core records (GetLogicalProcessorInformationEx(RelationProcessorCore)); None where
    the call fails (or there is no kernel32)."""
    try:
        query = ctypes.WinDLL("kernel32").GetLogicalProcessorInformationEx  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        return None
    query.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
    query.restype = ctypes.c_int
    size = ctypes.c_uint32(0)
    query(RELATION_PROCESSOR_CORE, None, ctypes.byref(size))  # fails, and says how large a buffer it needs
    if size.value == 0:
        return None
    buffer = ctypes.create_string_buffer(size.value)
    if not query(RELATION_PROCESSOR_CORE, buffer, ctypes.byref(size)):
        return None
    return buffer.raw[:size.value]


def reported_cores(platform: str) -> int | None:
    """The physical (performance) cores the operating system reports where there is no /sys to read: on
    macOS and Windows; None elsewhere or where the call fails."""
    if platform == "darwin":
        return macos_cores(read_sysctl_int)
    if platform == "win32":
        records = processor_core_records()
        return windows_cores(records) if records else None
    return None


def physical_cores(root: Path, cpus: set[int], platform: str) -> int:
    """How many physical cores ``cpus`` span: from the topology in /sys, else as the operating system reports
    them (no more than ``cpus``), else llama.cpp's guess."""
    cores = sibling_cores(root, cpus)
    if cores is None and (reported := reported_cores(platform)):
        cores = min(reported, len(cpus))
    return guessed_cores(len(cpus)) if cores is None else cores


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


def default_threads(root: Path = Path("/"), affinity: set[int] | None = None, platform: str = sys.platform) -> int:
    """One thread per physical (performance) core this process may use, within its cgroup's CPU quota."""
    cpus = usable_cpus(root, process_affinity() if affinity is None else affinity)
    cores = physical_cores(root, cpus, platform)
    quota = cgroup_cpus(root)
    return max(1, min(cores, quota) if quota is not None else cores)
