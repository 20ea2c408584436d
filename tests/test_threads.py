"""The default thread count: llama.cpp's rule (physical, performance cores) within the process's affinity and
its cgroup's CPU quota, read from a fake /proc and /sys; on macOS and Windows from fake answers of the
operating system's calls."""

from __future__ import annotations

import struct
from pathlib import Path

from specee_edge import threads
from specee_edge.threads import default_threads, macos_cores, parse_cpu_list, reported_cores, windows_cores


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def smt_machine(root: Path, cores: int) -> None:
    """``cores`` cores of two threads each: CPU c and c + cores are siblings."""
    for core in range(cores):
        for cpu in (core, core + cores):
            write(root, f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", f"{core},{core + cores}")


def test_cpu_lists():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("") == set()


def test_one_thread_per_physical_core_without_a_cap_of_8(tmp_path):
    smt_machine(tmp_path, 16)
    assert default_threads(tmp_path, set(range(32))) == 16


def test_affinity_limits_the_cores(tmp_path):
    smt_machine(tmp_path, 16)
    assert default_threads(tmp_path, {0, 1}) == 2
    assert default_threads(tmp_path, {0, 16}) == 1  # two threads of one core


def test_performance_cores_only_on_a_hybrid_cpu(tmp_path):
    smt_machine(tmp_path, 8)  # CPUs 0-15; 0-3 and 8-11 are P-cores' threads, the rest E-cores (no SMT really)
    write(tmp_path, "sys/devices/cpu_core/cpus", "0-3,8-11")
    assert default_threads(tmp_path, set(range(16))) == 4
    assert default_threads(tmp_path, {4, 5}) == 2  # pinned to E-cores only: those


def test_cgroup_v2_quota(tmp_path):
    smt_machine(tmp_path, 16)
    write(tmp_path, "proc/self/cgroup", "0::/docker/abc")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "max 100000")
    write(tmp_path, "sys/fs/cgroup/docker/abc/cpu.max", "max 100000")
    assert default_threads(tmp_path, set(range(32))) == 16
    write(tmp_path, "sys/fs/cgroup/docker/cpu.max", "150000 100000")  # a parent's 1.5 CPUs
    assert default_threads(tmp_path, set(range(32))) == 2


def test_cgroup_v2_quota_seen_from_inside_a_container(tmp_path):
    smt_machine(tmp_path, 16)
    write(tmp_path, "proc/self/cgroup", "0::/")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "200000 100000")
    assert default_threads(tmp_path, set(range(32))) == 2


def test_cgroup_v1_quota(tmp_path):
    smt_machine(tmp_path, 16)
    write(tmp_path, "proc/self/cgroup", "4:memory:/x\n3:cpu,cpuacct:/kubepods/pod1\n0::/")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/cpu.cfs_quota_us", "300000")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/cpu.cfs_period_us", "100000")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000")
    assert default_threads(tmp_path, set(range(32))) == 3


def test_without_topology_llama_cpps_guess(tmp_path):
    assert default_threads(tmp_path, set(range(8)), platform="linux") == 4
    assert default_threads(tmp_path, {0, 1, 2}, platform="linux") == 3
    assert reported_cores("linux") is None


M1_PRO = {"hw.perflevel0.physicalcpu": 8, "hw.perflevel1.physicalcpu": 2, "hw.physicalcpu": 10}


def test_macos_performance_cores_else_physical_ones():
    assert macos_cores(M1_PRO.get) == 8
    assert macos_cores({"hw.physicalcpu": 6, "hw.logicalcpu": 12}.get) == 6  # macOS 11: no perflevels
    assert macos_cores({}.get) is None


def core_record(efficiency_class: int = 0, smt: bool = False) -> bytes:
    """One RelationProcessorCore record of GetLogicalProcessorInformationEx as 64-bit Windows writes it: the
    head (Relationship, Size), PROCESSOR_RELATIONSHIP (Flags, EfficiencyClass, Reserved[20], GroupCount) and
    one GROUP_AFFINITY (Mask, Group, Reserved[3])."""
    return struct.pack("<IIBB20xHQH6x", 0, 48, int(smt), efficiency_class, 1, 0b11 if smt else 0b1, 0)


def test_windows_physical_cores():
    assert windows_cores(core_record() * 6) == 6  # 6 cores without SMT
    assert windows_cores(core_record(smt=True) * 8) == 8  # 8 cores of 2 threads each
    assert windows_cores(core_record(1, smt=True) * 6 + core_record(0) * 8) == 6  # hybrid: 6 P-cores, 8 E-cores
    assert windows_cores(b"") is None
    assert windows_cores(core_record() * 2 + core_record()[:20]) == 2  # a torn record ends the count


def test_macos_and_windows_ask_the_operating_system(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "read_sysctl_int", M1_PRO.get)
    assert default_threads(tmp_path, set(range(10)), platform="darwin") == 8
    monkeypatch.setattr(threads, "processor_core_records", lambda: core_record() * 6)
    assert default_threads(tmp_path, set(range(6)), platform="win32") == 6
    assert default_threads(tmp_path, {0, 1}, platform="win32") == 2  # no more than the CPUs it may use


def test_a_failed_call_falls_back_to_llama_cpps_guess(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "read_sysctl_int", lambda name: None)
    assert default_threads(tmp_path, set(range(10)), platform="darwin") == 5
    monkeypatch.setattr(threads, "processor_core_records", lambda: None)
    assert default_threads(tmp_path, set(range(6)), platform="win32") == 3
