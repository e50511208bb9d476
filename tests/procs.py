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
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pdproxy import children
from waits import scaled

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Proc:
    """A child process whose output goes to a log file that tests can read on failure."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, name: str = "proc"):
        self.args = args
        self.log = Path(tempfile.mkstemp(prefix=f"pdproxy-{name}-", suffix=".log")[1])
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._fh = open(self.log, "wb")
        self.popen = spawn(args, stdout=self._fh, stderr=subprocess.STDOUT, env=full_env)

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
    proc = Proc([sys.executable, script, "--port", str(port), "--upstream", upstream], name="tokenize-backend")
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
