"""The default thread count: llama.cpp's rule (physical, performance cores) within the process's affinity and
its cgroup's CPU quota, read from a fake /proc and /sys."""

from __future__ import annotations

from pathlib import Path

from specee_edge.threads import default_threads, parse_cpu_list


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
    assert default_threads(tmp_path, set(range(8))) == 4
    assert default_threads(tmp_path, {0, 1, 2}) == 3
