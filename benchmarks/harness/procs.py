"""Child processes of a benchmark: each in its own process group, stopped with whatever it started.

Every child gets a session of its own (a signal to its group reaches its workers and anything it ran)
and, on Linux, is killed by the kernel if the benchmark itself dies (pdproxy.children.spawn), so an
interrupted run leaves nothing listening. Output goes to a log file, shown when the child fails to
come up.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

from . import stats

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # pdproxy from this tree when it is not installed (an installed one comes first)
from pdproxy.children import spawn  # noqa: E402

HOST = "127.0.0.1"
PRIORITY = -10  # niceness of every pinned benchmark process when run as root (see placed)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on HOST right now (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def placed(args: list[str], cpus: str | None) -> list[str]:
    """Pin to `cpus`, and when root, run at a higher priority than the rest of the machine: on a shared
    machine another user's work would otherwise preempt the proxy under test between two token events,
    which shows up as milliseconds of "added latency" that belong to no proxy. Every target, the load
    generator and the upstreams get the same treatment."""
    if cpus is not None and shutil.which("taskset"):
        args = ["taskset", "-c", cpus, *args]
    if os.geteuid() == 0 and shutil.which("nice"):
        args = ["nice", "-n", str(PRIORITY), *args]
    return args


def python_in(tree: str, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`python ARGS` with the pdproxy of source tree `tree` (its directory first on the path), to completion,
    output captured as text: how one run measures several builds side by side."""
    return subprocess.run([sys.executable, *args], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": tree, **(env or {})})


def wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {port}")


class Proc:
    """A child process in its own session, optionally pinned to CPUs; `url` is set once it serves HTTP."""

    def __init__(self, name: str, args: list[str], cpus: str | None = None, log: Path | None = None,
                 env: dict | None = None, cwd: str | None = None) -> None:
        self.name = name
        self.log = log
        self._fh: IO[bytes] = open(log, "wb") if log is not None else tempfile.TemporaryFile()
        self.url = ""
        self.popen = spawn(placed(args, cpus), stdout=self._fh, stderr=subprocess.STDOUT,
                           env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=cwd)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        """The end of what the process wrote (for error messages)."""
        if self.log is not None:
            return self.log.read_text(errors="replace")[-3000:]
        self._fh.flush()
        self._fh.seek(0)
        return self._fh.read().decode(errors="replace")[-3000:]

    def wait_http(self, url: str, timeout: float = 60.0) -> None:
        """Until `url` answers 200; an exit or the timeout raises with the process's output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.popen.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.05)
        raise TimeoutError(f"{self.name}: {url} not ready after {timeout}s:\n{self.output()}")

    def pids(self) -> list[int]:
        return stats.tree(self.popen.pid)

    def cpu_seconds(self) -> float:
        """User + system CPU of the process tree so far (a `taskset` wrapper execs, so the pid is the proxy)."""
        return stats.cpu_seconds(self.pids())

    def memory_mb(self, key: str) -> float:
        """VmRSS (now) or VmHWM (peak) summed over the tree, in MB."""
        return stats.memory_kb(self.pids(), key) / 1024

    def terminate(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the group, up to `grace` seconds, then SIGKILL; the process is reaped."""
        self.terminate()
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait()
        self._fh.close()


class Procs(list[Proc]):
    """The processes of one set-up, stopped together (SIGTERM to all at once, then each reaped) when the
    `with` block ends, however it ends."""

    def start(self, *args, **kwargs) -> Proc:
        proc = Proc(*args, **kwargs)
        self.append(proc)
        return proc

    def pdproxy(self, *args: str, **kwargs) -> Proc:
        proc = start_pdproxy(list(args), **kwargs)
        self.append(proc)
        return proc

    def stop(self, grace: float = 15.0) -> None:
        for proc in reversed(self):
            proc.terminate()
        for proc in reversed(self):
            proc.stop(grace)
        self.clear()

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_pdproxy(args: list[str], log: Path | None = None, env: dict | None = None, cpus: str | None = None,
                  cwd: str | None = None, ready: str = "/health", timeout: float = 30.0) -> Proc:
    """`python -m pdproxy ARGS --host HOST --port <free>` (serve, sim, ...), once `ready` answers 200."""
    port = free_port()
    proc = Proc(f"pdproxy {args[0]}", [sys.executable, "-m", "pdproxy", *args, "--host", HOST, "--port", str(port)],
                cpus, log, env, cwd)
    proc.url = f"http://{HOST}:{port}"
    try:
        proc.wait_http(proc.url + ready, timeout)
    except BaseException:
        proc.stop()
        raise
    return proc
