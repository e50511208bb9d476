"""pdproxy's collector distribution started with a test copy of a configuration (interim helper
until tests/gotools.py lands)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import yaml

from procs import HOST, Proc, free_port

REPO = Path(__file__).resolve().parents[1]
BINARY = REPO / ".tools" / "otelcol-pdproxy" / "otelcol-pdproxy"


def collector_config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _loopback(endpoint: str) -> str:
    return f"{HOST}:{free_port()}"


class Collector:
    def __init__(self, config: dict, env: dict[str, str] | None = None, name: str = "otelcol") -> None:
        if not BINARY.is_file():
            pytest.skip(f"collector not built: {BINARY}")
        config = yaml.safe_load(yaml.safe_dump(config))
        self.otlp_grpc = self.otlp_http = None
        protocols = config["receivers"]["otlp"]["protocols"]
        if "grpc" in protocols:
            protocols["grpc"]["endpoint"] = self.otlp_grpc = _loopback("")
        if "http" in protocols:
            protocols["http"]["endpoint"] = self.otlp_http = _loopback("")
        health = config["extensions"]["health_check"]
        health["endpoint"] = _loopback("")
        if "prometheus" in config.get("exporters", {}):
            config["exporters"]["prometheus"]["endpoint"] = self.prometheus = _loopback("")
        config["service"]["telemetry"] = {"metrics": {"level": "none"}}
        self.path = Path(tempfile.mkstemp(prefix="otelcol-", suffix=".yaml")[1])
        self.path.write_text(yaml.safe_dump(config))
        self.args = [str(BINARY), f"--config={self.path}"]
        self.env = env or {}
        self.name = name
        self.health = f"http://{health['endpoint']}/"
        self.start()

    @property
    def otlp_grpc_url(self) -> str:
        return f"http://{self.otlp_grpc}"

    @property
    def otlp_http_url(self) -> str:
        return f"http://{self.otlp_http}"

    def start(self) -> None:
        self.proc = Proc(self.args, env=self.env, name=self.name)
        self.proc.wait_http(self.health, timeout=30)

    def kill(self) -> None:
        import os
        import signal

        os.killpg(self.proc.popen.pid, signal.SIGKILL)
        self.proc.popen.wait()

    def stop(self) -> None:
        self.proc.stop()
