"""Running model-written programs: each in a child process of its own, with a time limit and whatever memory,
CPU, core-dump and network limits this OS allows. None of this makes untrusted code safe to run: it bounds a
program that loops, eats memory or writes a core, on a machine the user chose to run it on."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache

TIME_LIMIT_S = 10.0        # wall clock, per program
MEMORY_LIMIT = 2 << 30     # bytes of address space, per program
OUTPUT_LIMIT = 2000        # characters of a failed program's error kept for the samples log


@dataclass(frozen=True)
class Limits:
    """The limits that apply to every program on this machine, as the eval's table states them."""

    time_s: float
    memory: bool   # RLIMIT_AS
    cpu: bool      # RLIMIT_CPU (the time limit in CPU seconds as well)
    no_core: bool  # RLIMIT_CORE 0
    network: bool  # a network namespace of its own, with no interfaces up (unshare -n)

    def describe(self) -> str:
        parts = [f"{self.time_s:g} s wall clock"]
        parts.append(f"memory {MEMORY_LIMIT >> 30} GiB (RLIMIT_AS)" if self.memory else "memory not limited")
        parts.append(f"CPU {self.time_s:g} s (RLIMIT_CPU)" if self.cpu else "CPU time not limited")
        parts.append("no core dumps" if self.no_core else "core dumps not limited")
        parts.append("no network (unshare -n)" if self.network else "network not limited")
        return ", ".join(parts)


@dataclass(frozen=True)
class Outcome:
    passed: bool
    reason: str  # "passed", "timed out", or the program's last line of error output (its exit status without one)


def _has_resource() -> bool:
    """The resource module (POSIX only) is there to set a child's limits."""
    return importlib.util.find_spec("resource") is not None


@cache
def _network_namespace() -> bool:
    """`unshare -n` works here (Linux, as root or with user namespaces allowed): a program then has no network."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def limits(time_s: float = TIME_LIMIT_S) -> Limits:
    posix = _has_resource()
    return Limits(time_s=time_s, memory=posix and sys.platform != "darwin",  # macOS refuses RLIMIT_AS
                  cpu=posix, no_core=posix, network=_network_namespace())


def _preexec(applied: Limits):
    """The child's limits, set between fork and exec (POSIX)."""
    if not (applied.memory or applied.cpu or applied.no_core):
        return None

    def set_limits() -> None:
        import resource

        if applied.memory:
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        if applied.cpu:
            cpu = int(applied.time_s) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        if applied.no_core:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return set_limits


def run_program(source: str, applied: Limits) -> Outcome:
    """Run `source` with this Python in isolated mode (-I), in an empty temporary directory, no input, a bare
    environment and its own session, under `applied`; it passes when it exits with status 0."""
    with tempfile.TemporaryDirectory(prefix="specee-eval-") as work:
        path = os.path.join(work, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        command = [sys.executable, "-I", path]
        if applied.network:
            command = [shutil.which("unshare") or "unshare", "-n", *command]
        child = subprocess.Popen(command, cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, env={"PATH": os.defpath, "PYTHONHASHSEED": "0"},
                                 preexec_fn=_preexec(applied), start_new_session=True)
        try:
            _, err = child.communicate(timeout=applied.time_s)
        except subprocess.TimeoutExpired:
            _kill_group(child)
            return Outcome(False, "timed out")
    if child.returncode == 0:
        return Outcome(True, "passed")
    lines = err.decode(errors="replace").strip().splitlines()
    return Outcome(False, lines[-1][:OUTPUT_LIMIT] if lines else f"exit status {child.returncode}")


def _kill_group(child: subprocess.Popen) -> None:
    """End the program and whatever it started (its session's process group), then reap it."""
    try:
        os.killpg(child.pid, 9)
    except (ProcessLookupError, PermissionError, AttributeError):
        child.kill()
    child.communicate()
