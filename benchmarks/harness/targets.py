"""The proxies under test, side by side behind the same zero-delay upstreams.

One `Bench` starts a prefill and a decode `benchmarks/zero_upstream.py` once, then any target in
front of them, one at a time:

  direct        no proxy: the load generator straight to the decode instance
  pdproxy       tracing on, every span exported over OTLP/HTTP to a real receiver (otlp_sink.py or oteltap)
  pdproxy-off   --no-tracing;  pdproxy-noattr  tracing on, --no-stall-attribution;  pdproxy-2w  --workers 2
  pdproxy-before, pdproxy-off-before   the same from another source tree (--baseline-path)
  vllm-router   PyPI vllm-router in P/D mode (round_robin), installed when missing (peers.py)
  toy-proxy     vLLM's toy_proxy_server.py from vLLM's sdist (peers.py)
  floor, floor-lean   benchmarks/floor_proxy.py (aiohttp / httptools server): the floor of pdproxy's design

On a machine with 2 or more cores and pinning on, the target runs on CPU 1 and everything else
(load generator, upstreams, receiver) on CPU 0, so each proxy gets one whole core.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from . import peers
from .load import PhaseResult, run_load
from .procs import HERE, HOST, REPO, Proc, free_port, python_in, wait_port

TARGETS = ("direct", "pdproxy", "pdproxy-off", "vllm-router", "toy-proxy", "pdproxy-noattr", "pdproxy-before",
           "pdproxy-off-before", "pdproxy-2w")
TRACED = ("pdproxy", "pdproxy-noattr", "pdproxy-before", "pdproxy-2w")
BASELINE = ("pdproxy-before", "pdproxy-off-before")
FLOORS = {"floor": "aiohttp", "floor-lean": "httptools"}  # target -> floor_proxy.py's server


def with_baseline(targets: list[str], baseline_path: str | None) -> list[str]:
    """`targets`, and the two -before targets when there is a baseline tree to measure."""
    return list(targets) + (list(BASELINE) if baseline_path else [])


def interleaved(targets: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, target) for `rounds` rounds of every target, the order reversed every other round so that
    neither end of a round is always the same target."""
    for r in range(rounds):
        for name in targets if r % 2 == 0 else targets[::-1]:
            yield r, name


def form(src: str) -> str:
    """pdproxy/compiled.py's summary for the tree at `src`, as the proxy started from it sees itself."""
    out = python_in(src, ["-c", "from pdproxy import compiled; print(compiled.summary())"])
    return (out.stdout or out.stderr).strip().splitlines()[-1] if (out.stdout or out.stderr) else "?"


class Bench:
    """The upstreams shared by every target, the targets, and the load against them."""

    def __init__(self, work_dir: str, *, pin: bool = True, workers: str = "1", otlp_receiver: str = "sink",
                 pdproxy_path: str | None = None, baseline_path: str | None = None, prompt_words: int = 256) -> None:
        self.work = Path(work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs = self.work / "logs"
        self.logs.mkdir(exist_ok=True)
        pin = pin and (os.cpu_count() or 1) >= 2
        self.proxy_cpus = "1" if pin else None
        self.other_cpus = "0" if pin else None
        self.workers, self.otlp_receiver, self.prompt_words = workers, otlp_receiver, prompt_words
        self.pdproxy_path, self.baseline_path = pdproxy_path, baseline_path
        self.upstreams: list[Proc] = []
        self.wrap: list[str] = []  # a command the proxies run under (benchmarks/instructions.py: valgrind)
        self.receiver_url = ""
        self.spans_received: dict | None = None  # the sink's count after the last traced target stopped
        self.prefill_port = self.decode_port = 0

    def start_upstreams(self) -> None:
        script = str(HERE / "zero_upstream.py")
        for role in ("prefill", "decode"):
            port = free_port()
            proc = Proc(f"upstream-{role}", [sys.executable, script, "--role", role, "--port", str(port)],
                        self.other_cpus, self.logs / f"upstream-{role}.log")
            proc.wait_http(f"http://{HOST}:{port}/health")
            self.upstreams.append(proc)
            setattr(self, f"{role}_port", port)

    def stop_all(self) -> None:
        for p in self.upstreams:
            p.stop()

    def load(self, url: str, proxy: Proc | None, **phase) -> PhaseResult:
        """One load phase from CPU 0 (see harness.load.run_load for the phase's settings)."""
        return run_load(self.work, url, proxy, prompt_words=self.prompt_words, cpus=self.other_cpus, **phase)

    def source(self, name: str) -> str:
        """The source tree a pdproxy target runs from."""
        if name.endswith("-before"):
            return self.baseline_path
        return self.pdproxy_path or str(REPO)

    def say_forms(self, targets: list[str]) -> None:
        """Print which form (compiled or pure Python) each pdproxy target ran in."""
        for name in targets:
            if name.startswith("pdproxy"):
                print(f"{name}: {form(self.source(name))}")

    @contextlib.contextmanager
    def running(self, name: str) -> Iterator[tuple[str, Proc | None]]:
        """`name` started, as (its base URL, its process or None for direct); stopped afterwards."""
        url, proxy, helpers = self.start_target(name)
        try:
            yield url, proxy
        finally:
            self.stop_target(name, proxy, helpers)

    def stop_target(self, name: str, proxy: Proc | None, helpers: list[Proc]) -> None:
        """Stop the target (SIGTERM: pdproxy flushes its span queue on the way out), then read how many spans
        the sink received, then stop its helpers."""
        if proxy is not None:
            proxy.stop()
        self.spans_received = None
        if name in TRACED and self.otlp_receiver == "sink":
            try:
                with urllib.request.urlopen(self.receiver_url + "/count", timeout=5) as r:
                    self.spans_received = json.loads(r.read())
            except OSError:
                pass
        for h in helpers:
            h.stop()

    def start_target(self, name: str) -> tuple[str, Proc | None, list[Proc]]:
        """Start `name`; returns its base URL, its process (None for direct) and helper processes."""
        prefill, decode = f"http://{HOST}:{self.prefill_port}", f"http://{HOST}:{self.decode_port}"
        if name == "direct":
            return decode, None, []
        port = free_port()
        url = f"http://{HOST}:{port}"
        helpers: list[Proc] = []
        log = self.logs / f"{name}.log"
        if name.startswith("pdproxy"):
            workers = 2 if name == "pdproxy-2w" else self.workers
            args = [*self.wrap, sys.executable, "-m", "pdproxy", "serve", "--host", HOST, "--port", str(port),
                    "--prefill", prefill, "--decode", decode, "--log-level", "warning", "--workers", str(workers)]
            if name in TRACED:
                receiver = self.start_receiver()
                helpers.append(receiver)
                args += ["--otlp-endpoint", self.receiver_url, "--otlp-protocol", "http/protobuf"]
            else:
                args.append("--no-tracing")
            if name == "pdproxy-noattr":
                args.append("--no-stall-attribution")
            src = self.source(name)  # `python -m` looks in the working directory first
            cpus = "0,1" if name == "pdproxy-2w" and self.proxy_cpus else self.proxy_cpus
            proc = Proc(name, args, cpus, log, env={"PYTHONPATH": src}, cwd=src)
            proc.wait_http(url + "/health")
        elif name == "vllm-router":
            exe = peers.vllm_router()
            args = [*self.wrap, exe, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                    "--host", HOST, "--port", str(port), "--prometheus-host", HOST,
                    "--prometheus-port", str(free_port()), "--policy", "round_robin", "--log-level", "warning"]
            proc = Proc(name, args, self.proxy_cpus, log)
            proc.wait_http(url + "/health", timeout=120)
        elif name == "toy-proxy":
            script = peers.toy_proxy(self.work)
            args = [sys.executable, str(script), "--host", HOST, "--port", str(port), "--prefiller-host", HOST,
                    "--prefiller-port", str(self.prefill_port), "--decoder-host", HOST, "--decoder-port",
                    str(self.decode_port)]
            proc = Proc(name, args, self.proxy_cpus, log)
            proc.wait_http(url + "/healthcheck")
        elif name in FLOORS:
            proc = Proc(name, [sys.executable, str(HERE / "floor_proxy.py"), prefill, decode, str(port), FLOORS[name]],
                        self.proxy_cpus, log)
            proc.wait_http(url + "/health")
        else:
            raise ValueError(name)
        return url, proc, helpers

    def start_receiver(self) -> Proc:
        """The OTLP/HTTP receiver a traced pdproxy exports to (on CPU 0); sets `receiver_url`."""
        port = free_port()
        if self.otlp_receiver == "oteltap":
            command = [shutil.which("oteltap") or "oteltap", "--port", str(port)]
        else:
            command = [sys.executable, str(HERE / "otlp_sink.py"), "--port", str(port)]
        receiver = Proc(self.otlp_receiver, command, self.other_cpus, self.logs / "otlp-receiver.log")
        wait_port(port)
        self.receiver_url = f"http://{HOST}:{port}"
        return receiver

