"""Jaeger v2 as a real trace store for tests: the binary tools/build-jaeger.sh builds, started with
deploy/jaeger/jaeger.yaml (in-memory storage) on free loopback ports, queried by trace id."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from gotools import build
from procs import HOST, Proc, free_port
from waits import scaled

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "deploy" / "jaeger" / "jaeger.yaml"


def jaeger_binary() -> Path:
    """Built by tools/build-jaeger.sh (CI starts it in the background; a no-op when fresh)."""
    return build("tools/build-jaeger.sh")


class Jaeger:
    """One Jaeger process; `otlp_grpc` is the host:port the collector exports kept traces to."""

    def __init__(self, name: str = "jaeger") -> None:
        binary = jaeger_binary()
        ports = {key: free_port() for key in ("OTLP_GRPC", "OTLP_HTTP", "QUERY_HTTP", "QUERY_GRPC", "HEALTH")}
        env = {f"JAEGER_{key}_ENDPOINT": f"{HOST}:{port}" for key, port in ports.items()}
        env["JAEGER_LOG_LEVEL"] = "warn"
        self.otlp_grpc = env["JAEGER_OTLP_GRPC_ENDPOINT"]
        self.url = f"http://{env['JAEGER_QUERY_HTTP_ENDPOINT']}"
        self.args = [str(binary), f"--config={CONFIG}"]
        self.env = env
        self.name = name
        self.proc = self._start()

    def _start(self, timeout: float = 30.0) -> Proc:
        """Started when its health check says every component runs: the query API answers
        before the OTLP receiver listens."""
        proc = Proc(self.args, env=self.env, name=self.name)
        health = f"http://{self.env['JAEGER_HEALTH_ENDPOINT']}/status"
        deadline = time.monotonic() + scaled(timeout)
        while True:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited {proc.popen.returncode}:\n{proc.output()[-4000:]}")
            try:
                with urllib.request.urlopen(health, timeout=1) as r:
                    if r.status == 200:
                        return proc
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not healthy after {timeout}s:\n{proc.output()[-4000:]}")
            time.sleep(0.1)

    def trace(self, trace_id: str) -> list[dict]:
        """Every stored span of a trace (OTLP/JSON dicts with `service` added), or [] if unknown.

        `raw_traces=true`: the spans as stored, without the query service's adjusters (which
        would, for example, rename a duplicated span id instead of showing it twice)."""
        url = f"{self.url}/api/v3/traces/{trace_id}?raw_traces=true"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return []
            raise
        spans = []
        for rs in body["result"].get("resourceSpans", []):
            resource = {a["key"]: next(iter(a["value"].values())) for a in rs.get("resource", {}).get("attributes", [])}
            for ss in rs.get("scopeSpans", []):
                for span in ss.get("spans", []):
                    spans.append({**span, "service": resource.get("service.name")})
        return spans

    def stop(self) -> None:
        self.proc.stop()
