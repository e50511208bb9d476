"""Start pdproxy components as real processes on loopback and wait until they answer.

Every process a test starts here runs in a session of its own and is SIGKILLed by the kernel if
pytest dies (pdproxy/children.py); each is also listed in STARTED, so that conftest.py can kill
the group of whatever a test left running (a failing test included) and, at the end, anything left.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pdproxy import children
from waits import scaled

if TYPE_CHECKING:
    import pytest

HOST = "127.0.0.1"
STARTED: list[subprocess.Popen] = []  # every process group a test started, in order


def spawn(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen in its own session, dying with pytest, listed in STARTED."""
    popen = children.spawn(args, **popen_kwargs)
    STARTED.append(popen)
    return popen


def kill_groups(popens: list[subprocess.Popen]) -> list[str]:
    """SIGKILL the whole process group of each of `popens` and reap it; the commands that were still running."""
    running = [" ".join(map(str, p.args))[:200] for p in popens if p.poll() is None]
    for p in popens:
        # After its leader is reaped a group may still hold what the leader started; it is still ours unless
        # the pid was reused (the kernel hands out no pid still in use as a group id).
        if p.returncode is None or not os.path.exists(f"/proc/{p.pid}"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            p.wait()
    return running


atexit.register(lambda: kill_groups(STARTED))  # pytest itself interrupted, or a script importing this


def run(args: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(args, capture_output=True, text=True) in a session of its own: on a timeout (or an
    interrupted test) its whole group is killed, not only its first process (a build's compilers)."""
    popen = spawn(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    finally:
        kill_groups([popen])
    return subprocess.CompletedProcess(args, popen.returncode, stdout, stderr)


def running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections and port 0 (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = _ephemeral_low()
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port for a server a test starts: nothing listens on it now, it was not handed out before in this session
    (a server's port and its metrics port asked for back to back could be one and the same, and the server then
    answers its health check on the metrics port before failing to bind its own), and it lies below the ports the
    kernel gives outgoing connections, so no client socket takes it before the server binds it."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, _EPHEMERAL_LOW) if _EPHEMERAL_LOW > 11000 else 0
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port found in 1000 tries")


class TestFiles:
    """Where the processes a test starts, and the tools it runs, keep their files: a directory of the running
    test's own under pytest's base temporary directory (conftest.py names the test and gives the base).

    A log stays while its process runs; once the process stopped, it goes at the end of a test that passed. A
    tool's directory goes at the end of the test that made it, or, made by a module's or session's fixture, at
    the end of the session. A failed test keeps its own directory and everything still in use, and its report
    names them. After a session that passed pytest removes the whole base directory (pyproject.toml's
    tmp_path_retention_policy). Outside pytest everything goes under the system's temporary directory."""

    def __init__(self) -> None:
        self.factory: pytest.TempPathFactory | None = None  # set by conftest.py for the session
        self._name = "outside-tests"
        self._dir: Path | None = None
        self._scopes: list[str] = []  # the fixtures being set up, innermost last
        # a log and its process; a tool's directory and whether a fixture wider than the test made it
        self._pending: list[tuple[Path, subprocess.Popen | None, bool]] = []
        self._kept: set[Path] = set()

    def begin_test(self, name: str) -> None:
        self._name, self._dir = re.sub(r"[^\w-]", "_", name)[:60], None

    @contextlib.contextmanager
    def fixture(self, scope: str) -> Iterator[None]:
        """While a fixture of `scope` is set up: what it makes may outlive the test."""
        self._scopes.append(scope)
        try:
            yield
        finally:
            self._scopes.pop()

    def dir(self) -> Path:
        """The running test's directory, made when it first holds something."""
        if self._dir is None:
            self._dir = (self.factory.mktemp(self._name) if self.factory
                         else Path(tempfile.mkdtemp(prefix=f"pdproxy-{self._name}-")))
        return self._dir

    def log(self, name: str) -> Path:
        fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=self.dir())
        os.close(fd)
        return Path(path)

    def watch(self, log: Path, popen: subprocess.Popen) -> None:
        self._pending.append((log, popen, False))

    def scratch(self, name: str) -> Path:
        """A directory for a tool's config and data."""
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.dir()))
        self._pending.append((path, None, any(scope != "function" for scope in self._scopes)))
        return path

    def keep(self) -> list[Path]:
        """The running test failed: what it made and everything still in use stays; returns their paths."""
        kept = [p for p in [self._dir, *(path for path, _, _ in self._pending)] if p is not None and p.exists()]
        self._kept.update(kept)
        return kept

    def end_test(self) -> None:
        """Remove what the test no longer uses, unless kept, and its directory if that left it empty."""
        self._remove([(path, popen, wide) for path, popen, wide in self._pending
                      if (popen.poll() is not None if popen is not None else not wide)])
        if self._dir is not None and self._dir not in self._kept:
            with contextlib.suppress(OSError):
                self._dir.rmdir()  # only when empty: a wider fixture's files may still be there

    def end_session(self) -> None:
        self._remove(list(self._pending))
        base = self.factory.getbasetemp() if self.factory else None
        if base is not None and base.is_dir():  # pytest may have removed it already (a session that passed)
            for directory in base.iterdir():
                with contextlib.suppress(OSError):
                    directory.rmdir()

    def _remove(self, entries: list[tuple[Path, subprocess.Popen | None, bool]]) -> None:
        for entry in entries:
            self._pending.remove(entry)
            path = entry[0]
            if not any(path.is_relative_to(kept) for kept in self._kept):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)


FILES = TestFiles()


class Proc:
    """A child process whose output goes to a log file that tests can read on failure (FILES says where)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, name: str = "proc"):
        self.args = args
        self.log = FILES.log(name)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._fh = open(self.log, "wb")
        self.popen = spawn(args, stdout=self._fh, stderr=subprocess.STDOUT, env=full_env)
        FILES.watch(self.log, self.popen)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_http(self, url: str, timeout: float = 20.0) -> None:
        """Until `url` answers below 500 (the process is up); fails at once if the process exits."""
        deadline = time.monotonic() + scaled(timeout)
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args} exited {self.popen.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status < 500:
                        return
            except Exception:
                time.sleep(0.05)
        raise TimeoutError(f"{url} not ready after {scaled(timeout):.0f}s:\n{self.output()}")

    def stop(self, timeout: float = 10.0) -> int:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(scaled(timeout))
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self._fh.close()
        return self.popen.returncode


def pdproxy(*args: str, env: dict[str, str] | None = None, name: str = "pdproxy") -> Proc:
    return Proc([sys.executable, "-m", "pdproxy", *args], env=env, name=name)


def start_sim(role: str, *extra: str, port: int | None = None, model: str = "sim-model",
              env: dict[str, str] | None = None) -> tuple[Proc, str]:
    """A simulated vLLM instance; returns the process and its base URL."""
    port = port or free_port()
    proc = pdproxy("sim", "--role", role, "--host", HOST, "--port", str(port), "--model", model, *extra, env=env,
                   name=f"sim-{role}")
    url = f"http://{HOST}:{port}"
    proc.wait_http(url + "/health")
    return proc, url


def start_proxy(*args: str, env: dict[str, str] | None = None, port: int | None = None) -> tuple[Proc, str]:
    port = port or free_port()
    proc = pdproxy("serve", "--host", HOST, "--port", str(port), *args, env=env, name="serve")
    url = f"http://{HOST}:{port}"
    proc.wait_http(url + "/health")
    return proc, url


def start_scripted(role: str, *extra: str, port: int | None = None) -> tuple[Proc, str]:
    """The scripted vLLM-like instance of tests/scripted_backend.py (exact bytes and faults)."""
    port = port or free_port()
    script = str(Path(__file__).with_name("scripted_backend.py"))
    proc = Proc([sys.executable, script, "--port", str(port), "--role", role, *extra], name=f"scripted-{role}")
    url = f"http://{HOST}:{port}"
    proc.wait_http(url + "/health")
    return proc, url


def start_tokenize_backend(upstream: str) -> tuple[Proc, str]:
    """A passthrough to `upstream` whose /tokenize a test controls (tests/tokenize_backend.py)."""
    port = free_port()
    script = str(Path(__file__).with_name("tokenize_backend.py"))
    proc = Proc([sys.executable, script, "--port", str(port), "--upstream", upstream], name="tokenize-backend",
                env={"PYTHONPATH": str(Path(__file__).parent)})  # it builds on no_tokenize_backend (PYTHONSAFEPATH)
    url = f"http://{HOST}:{port}"
    proc.wait_http(url + "/health")
    return proc, url


def raw_post(body: dict, request_id: str | None = None, path: str = "/v1/completions") -> bytes:
    """The bytes of a POST, for tests that drive a socket by hand (hang up, stop reading, ...)."""
    data = json.dumps(body).encode()
    rid = b"X-Request-Id: %s\r\n" % request_id.encode() if request_id else b""
    return (b"POST %s HTTP/1.1\r\nHost: pdproxy\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
            % (path.encode(), rid, len(data), data))


def unaccepting_listener() -> tuple[socket.socket, list[socket.socket]]:
    """A listening socket whose accept queue is full (Linux drops further SYNs, no RST): a connect to it
    neither succeeds nor is refused, so only a connect timeout ends it. Returns the listener and the
    connections that fill its queue; close them all when done."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(0)
    fillers: list[socket.socket] = []
    while len(fillers) < 8:
        probe = socket.socket()
        probe.settimeout(0.5)
        try:
            probe.connect(listener.getsockname())
        except TimeoutError:
            probe.close()
            return listener, fillers
        fillers.append(probe)
    raise RuntimeError("the accept queue never filled up")
