"""Go-built tools for tests: build them (cached), and run a Collector-style service on loopback.

Each tool has an idempotent build script that prints the binary's path on its last stdout line
(`collector/build.sh`, `tools/build-*.sh`); `.ci/run` starts them all in the background before
pytest, so here they normally return at once. `Collector` runs any binary that takes an OpenTelemetry
Collector configuration (`--config FILE`): our distribution, and Collector-based tools such as
Jaeger v2. Its listeners are moved to free ports on 127.0.0.1 so tests can run side by side.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import yaml

import procs
from procs import FILES, HOST, Proc, free_port
from waits import scaled

REPO = Path(__file__).resolve().parents[1]
COLLECTOR_DIR = REPO / "collector"


@functools.cache
def build(script: str) -> Path:
    """Run a build script of the repository (a no-op when its binary is fresh); its binary's path.

    Without Go, a developer's machine skips the tests that need it; CI (CI=true) fails instead."""
    if not shutil.which("go") and not os.environ.get("CI"):
        pytest.skip("go is not installed: the Go-built tools cannot be built here")
    r = procs.run(["bash", str(REPO / script)], timeout=1800)  # a timeout kills go and its compilers too
    assert r.returncode == 0, f"{script} failed:\n{r.stderr[-4000:]}"
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path.is_file() and os.access(path, os.X_OK), path
    return path


def collector_binary() -> Path:
    """pdproxy's Collector distribution (collector/builder-config.yaml)."""
    return build("collector/build.sh")


def load_config(name: str) -> dict:
    """One of the committed configurations in collector/, as a dict a test may modify."""
    return yaml.safe_load((COLLECTOR_DIR / name).read_text())


def validate(config: Path, binary: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`otelcol validate`: loads the configuration and builds every component, starts nothing."""
    binary = binary or collector_binary()
    return subprocess.run([str(binary), "validate", f"--config={config}"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def on_loopback(config: dict) -> tuple[dict, dict[str, int]]:
    """A copy of `config` whose listeners bind free ports on 127.0.0.1, and those ports.

    Ports are named `otlp/grpc`, `otlp/http` (receiver id / protocol), `prometheus` (exporter id),
    `health_check` (extension id; `jaeger_query/http` for an extension's `http:`/`grpc:` servers)
    and `telemetry` (the collector's own metrics, which would otherwise all take :8888)."""
    cfg = copy.deepcopy(config)
    ports: dict[str, int] = {}

    def listen(name: str) -> str:
        ports[name] = free_port()
        return f"{HOST}:{ports[name]}"

    for rid, receiver in (cfg.get("receivers") or {}).items():
        for proto, body in ((receiver or {}).get("protocols") or {}).items():
            body = body if body is not None else receiver["protocols"].setdefault(proto, {})
            body["endpoint"] = listen(f"{rid}/{proto}")
    for eid, exporter in (cfg.get("exporters") or {}).items():
        if eid.split("/")[0] == "prometheus":
            exporter["endpoint"] = listen(eid)
    for xid, extension in (cfg.get("extensions") or {}).items():
        if not extension:
            continue
        if "endpoint" in extension:
            extension["endpoint"] = listen(xid)
        for proto in ("http", "grpc"):
            if isinstance(extension.get(proto), dict):
                extension[proto]["endpoint"] = listen(f"{xid}/{proto}")
    telemetry = cfg.setdefault("service", {}).setdefault("telemetry", {})
    telemetry["metrics"] = {"level": "basic", "readers": [{"pull": {"exporter": {"prometheus": {
        "host": HOST, "port": free_port()}}}}]}
    ports["telemetry"] = telemetry["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"]["port"]
    return cfg, ports


class Collector:
    """A Collector-style process on loopback, restartable on the same ports (outage tests)."""

    def __init__(self, config: dict, binary: Path | None = None, env: dict[str, str] | None = None,
                 name: str = "otelcol") -> None:
        self.binary = binary or collector_binary()
        self.config, self.ports = on_loopback(config)
        self.env = env or {}
        self.name = name
        self.dir = FILES.scratch(name)
        self.config_path = self.dir / "config.yaml"
        self.write_config()
        self.proc: Proc | None = None
        self.logs: list[str] = []

    def write_config(self) -> None:
        """Write `self.config` (changed by a test between two runs) where the next start reads it."""
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))

    def url(self, port: str) -> str:
        return f"http://{HOST}:{self.ports[port]}"

    @property
    def otlp_grpc(self) -> str:
        return self.url("otlp/grpc")

    @property
    def otlp_http(self) -> str:
        return self.url("otlp/http")

    def start(self, timeout: float = 30.0) -> None:
        """Start, and return once it is ready: health_check says so, or without one (other
        distributions), every receiver listens."""
        self.proc = Proc([str(self.binary), f"--config={self.config_path}"], env=self.env, name=self.name)
        if "health_check" in self.ports:
            # health_check answers 503 until every pipeline has started, then 200
            self.proc.wait_http(self.url("health_check"), timeout=timeout)
            return
        ids = self.config.get("receivers") or {}
        receivers = [port for name, port in self.ports.items() if any(name.startswith(rid + "/") for rid in ids)]
        deadline = time.monotonic() + scaled(timeout)
        for port in receivers:
            while True:
                if self.proc.popen.poll() is not None:
                    raise RuntimeError(f"{self.name} exited {self.proc.popen.returncode}:\n{self.proc.output()[-6000:]}")
                try:
                    socket.create_connection((HOST, port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self.name}: nothing listens on {port}:\n{self.proc.output()[-6000:]}")
                    time.sleep(0.1)

    def stop(self) -> None:
        if self.proc:
            self.proc.stop(timeout=15)
            self.logs.append(self.proc.output())
            self.proc = None

    def output(self) -> str:
        return "\n".join(self.logs + ([self.proc.output()] if self.proc else []))

    def metrics(self) -> str:
        """The collector's own telemetry (otelcol_receiver_accepted_spans_total, ...)."""
        with urllib.request.urlopen(self.url("telemetry") + "/metrics", timeout=5) as r:
            return r.read().decode()


@contextmanager
def running_collector(config: dict, binary: Path | None = None, env: dict[str, str] | None = None,
                      name: str = "otelcol") -> Iterator[Collector]:
    """Start a collector with `config` on free loopback ports, healthy on entry, stopped on exit."""
    c = Collector(config, binary=binary, env=env, name=name)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(c.dir, ignore_errors=True)
