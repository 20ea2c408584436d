"""Running model-written programs: each in a child process of its own, with a time limit and whatever process,
user, memory, CPU, file, core-dump and network limits this OS allows. None of this makes untrusted code safe to
run: it bounds a program that loops, forks, eats memory, writes without end or starts children that try to outlive
it, on a machine the user chose to run it on.

Where Linux lets us (root, or user namespaces), the program is the first process of a PID namespace of its own
(`unshare --fork --pid --kill-child`): when it ends, or when the time limit kills `unshare`, the kernel ends every
process it started, a child in a session of its own included. Its output goes to files, not pipes, so nothing it
leaves behind can hold the run open, and `RLIMIT_FSIZE` bounds those files like any other it writes."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache

TIME_LIMIT_S = 10.0        # wall clock, per program
MEMORY_LIMIT = 2 << 30     # bytes of address space, per process
FILE_LIMIT = 16 << 20      # bytes any one file may grow to (RLIMIT_FSIZE): its stdout and stderr among them
PROCESS_LIMIT = 64         # processes of the unprivileged user it runs as (RLIMIT_NPROC; binds no root)
OUTPUT_LIMIT = 2000        # characters of a failed program's error kept for the samples log
READ_BACK = 64 << 10       # bytes of a program's stdout or stderr read back, from their end
UNPRIVILEGED = 65534       # nobody: the user a program runs as when we are root


@dataclass(frozen=True)
class Isolation:
    """How the program is started here: the command put before the interpreter, and what it gives."""

    prefix: tuple[str, ...]  # e.g. unshare --fork --pid --kill-child -n [-r]  [setpriv --reuid ...]
    processes: bool          # a PID namespace: nothing the program starts outlives it
    network: bool            # a network namespace with no interface up
    user: str | None         # the unprivileged user it runs as, and what it may still read; None: as we run
    flags: str               # how the table names the namespaces, e.g. "unshare -r -n --pid"


NO_ISOLATION = Isolation((), False, False, None, "")


@dataclass(frozen=True)
class Limits:
    """The limits that apply to every program on this machine, as the eval's table states them."""

    time_s: float
    memory: bool   # RLIMIT_AS
    cpu: bool      # RLIMIT_CPU (the time limit in CPU seconds as well)
    no_core: bool  # RLIMIT_CORE 0
    files: bool    # RLIMIT_FSIZE
    isolation: Isolation = NO_ISOLATION

    @property
    def network(self) -> bool:
        return self.isolation.network

    @property
    def cpu_s(self) -> int:
        """RLIMIT_CPU's whole seconds: the wall clock limit rounded up, so the wall clock ends a program first."""
        return int(self.time_s) + 1

    def describe(self) -> str:
        iso = self.isolation
        parts = [f"{self.time_s:g} s wall clock"]
        parts.append(f"memory {MEMORY_LIMIT >> 30} GiB (RLIMIT_AS)" if self.memory else "memory not limited")
        parts.append(f"CPU {self.cpu_s} s (RLIMIT_CPU)" if self.cpu else "CPU time not limited")
        parts.append(f"files {FILE_LIMIT >> 20} MiB each (RLIMIT_FSIZE)" if self.files else "file size not limited")
        parts.append("no core dumps" if self.no_core else "core dumps not limited")
        parts.append(f"every process it starts ended with it ({iso.flags})" if iso.processes else
                     "processes it detaches may outlive it (no PID namespace)")
        if iso.user is not None:
            parts.append(f"as {iso.user}, at most {PROCESS_LIMIT} processes (RLIMIT_NPROC)")
        else:
            parts.append("as the user running eval" + ("" if os.name != "posix" or os.geteuid() != 0 else " (root)"))
        parts.append("no network" if iso.network else "network not limited")
        return ", ".join(parts)


@dataclass(frozen=True)
class Run:
    """What a program did: its exit status (negative: the signal that ended it; None: it ran out of time) and
    the end of its output."""

    status: int | None
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.status is None

    def error_line(self) -> str:
        """The last line of its error output, else how it ended."""
        lines = self.stderr.strip().splitlines()
        if lines:
            return lines[-1][:OUTPUT_LIMIT]
        if self.status is None:
            return "timed out"
        if self.status < 0:
            return f"killed by {signal.Signals(-self.status).name}"
        return f"exit status {self.status}"


def _has_resource() -> bool:
    """The resource module (POSIX only) is there to set a child's limits."""
    return importlib.util.find_spec("resource") is not None


def _candidates(euid: int) -> list[Isolation]:
    """The ways to isolate a program, best first. As root: namespaces, then the program as nobody (reading what
    the interpreter needs where nobody cannot: a Python under /root), then as root; as another user, the same
    namespaces inside a user namespace of its own (`-r`: plain `unshare -n` needs root)."""
    unshare = shutil.which("unshare")
    if unshare is None or sys.platform != "linux":
        return []
    namespaces = (unshare, "--fork", "--pid", "--kill-child", "--net")
    if euid != 0:
        return [Isolation((unshare, "--map-root-user", *namespaces[1:]), True, True, None, "unshare -r -n --pid")]
    found: list[Isolation] = []
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        drop = (setpriv, f"--reuid={UNPRIVILEGED}", f"--regid={UNPRIVILEGED}", "--clear-groups", "--no-new-privs")
        found.append(Isolation((*namespaces, *drop), True, True, "nobody", "unshare -n --pid"))
        found.append(Isolation((*namespaces, *drop[:-1], "--inh-caps=-all,+dac_read_search",
                                "--ambient-caps=+dac_read_search", drop[-1]), True, True,
                               "nobody (reading any file: this Python is where nobody cannot read)", "unshare -n --pid"))
    found.append(Isolation(namespaces, True, True, None, "unshare -n --pid"))
    return found


@cache
def isolation() -> Isolation:
    """The best of `_candidates` under which this Python starts with its own library (one that cannot read it may
    find another Python's on the way, as /usr/lib's), else none."""
    if os.name != "posix":
        return NO_ISOLATION
    for candidate in _candidates(os.geteuid()):
        try:
            probe = subprocess.run([*candidate.prefix, sys.executable, "-I", "-c", "import json; print(json.__file__)"],
                                   capture_output=True, timeout=30, cwd="/", env={"PATH": os.defpath})
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0 and probe.stdout.decode(errors="replace").strip() == json.__file__:
            return candidate
    return NO_ISOLATION


def limits(time_s: float = TIME_LIMIT_S) -> Limits:
    posix = _has_resource()
    return Limits(time_s=time_s, memory=posix and sys.platform != "darwin",  # macOS refuses RLIMIT_AS
                  cpu=posix, no_core=posix, files=posix, isolation=isolation())


def _preexec(applied: Limits):
    """The child's limits, set between fork and exec (POSIX); they pass through unshare and setpriv."""
    if not (applied.memory or applied.cpu or applied.no_core or applied.files):
        return None

    def set_limits() -> None:
        import resource

        if applied.memory:
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        if applied.cpu:
            resource.setrlimit(resource.RLIMIT_CPU, (applied.cpu_s, applied.cpu_s))
        if applied.no_core:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if applied.files:
            resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
        if applied.isolation.user is not None:  # counted for nobody once setpriv has dropped root
            resource.setrlimit(resource.RLIMIT_NPROC, (PROCESS_LIMIT, PROCESS_LIMIT))

    return set_limits


def _tail(path: str) -> str:
    """The last READ_BACK bytes of a file the program wrote, as text."""
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - READ_BACK))
        return f.read().decode(errors="replace")


def run_program(source: str, applied: Limits, stdin: bytes = b"") -> Run:
    """Run `source` with this Python in isolated mode (-I), in an empty temporary directory, `stdin` as its input,
    a bare environment and its own session, under `applied`. It returns within the time limit and a moment,
    whatever the program starts; with a PID namespace, nothing it started is left running."""
    with tempfile.TemporaryDirectory(prefix="specee-eval-") as work:
        path = os.path.join(work, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        if applied.isolation.user is not None:
            os.chown(work, UNPRIVILEGED, UNPRIVILEGED)  # the one place it may write
        out_path, err_path, in_path = (os.path.join(work, name) for name in (".stdout", ".stderr", ".stdin"))
        with open(in_path, "wb") as f:
            f.write(stdin)
        with open(in_path, "rb") as given, open(out_path, "wb") as out, open(err_path, "wb") as err:
            child = subprocess.Popen([*applied.isolation.prefix, sys.executable, "-I", path], cwd=work, stdin=given,
                                     stdout=out, stderr=err, env={"PATH": os.defpath, "PYTHONHASHSEED": "0"},
                                     preexec_fn=_preexec(applied), start_new_session=True)
        try:
            status: int | None = child.wait(timeout=applied.time_s)
        except subprocess.TimeoutExpired:
            _kill(child)
            status = 0 if child.returncode == 0 else None  # it exited 0 as the limit came: not a time-out
        return Run(status, _tail(out_path), _tail(err_path))


def _kill(child: subprocess.Popen) -> None:
    """End the program and whatever it started: its session's process group, and with a PID namespace every
    process in it (killing `unshare` kills the namespace's first process, and with it the rest)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):
        child.kill()
    child.wait()
