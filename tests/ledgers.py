"""Helpers for the reliability tests: where a request is accounted for, and backends to fail it.

Every request must show up the same way in three places: what the client got, the proxy's trace
(one root span per request, found by `pd.request_id`), and the proxy's Prometheus counters.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx

from otlp import attrs
from procs import HOST, Proc, free_port
from waits import scaled


# -- counters -----------------------------------------------------------------------------


def counter(text: str, name: str, **labels: str) -> float:
    """Sum of a counter's samples whose labels include `labels` (Prometheus text format)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Counters:
    """Deltas of the proxy's request counters around some requests."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.before = self._scrape()

    def _scrape(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def delta(self, name: str, **labels: str) -> float:
        return counter(self._scrape(), name, **labels) - counter(self.before, name, **labels)

    def requests(self, code: int | str, failed_stage: str = "none") -> float:
        return self.delta("pdproxy_requests_total", code=str(code), failed_stage=failed_stage)

    def errors(self, stage: str, error_type: str) -> float:
        return self.delta("pdproxy_request_errors_total", stage=stage, error_type=error_type)


# -- traces -------------------------------------------------------------------------------


def spans_in(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue  # a line still being written
        for rs in message.get("resourceSpans", ()):
            for ss in rs.get("scopeSpans", ()):
                out.extend(ss.get("spans", ()))
    return out


def trace_of(path: Path, request_id: str, timeout: float = 10.0) -> dict[str, dict]:
    """The spans of the trace whose root has `pd.request_id` == request_id, by name (root as 'root')."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        spans = spans_in(path)
        roots = [s for s in spans if s.get("kind") == 2 and attrs(s).get("pd.request_id") == request_id
                 and attrs(s).get("pd.deployment") == "primary"]
        if roots:
            root = roots[0]
            named = {s["name"]: s for s in spans if s["traceId"] == root["traceId"] and s is not root}
            if "pd.queue" in named or time.monotonic() > deadline:
                return {"root": root, **named}
        if time.monotonic() > deadline:
            raise AssertionError(f"no trace for request {request_id} in {path}")
        time.sleep(0.05)


def is_error(span: dict) -> bool:
    return span.get("status", {}).get("code") == 2


# -- backends -----------------------------------------------------------------------------


class ScriptedGroup:
    """One scripted backend process serving `n` instances (ports) with one script and one journal."""

    def __init__(self, role: str, n: int = 1, *extra: str) -> None:
        self.ports = [free_port() for _ in range(n)]
        script = str(Path(__file__).with_name("scripted_backend.py"))
        args = [sys.executable, script, "--role", role, *extra]
        for port in self.ports:
            args += ["--port", str(port)]
        self.proc = Proc(args, name=f"scripted-{role}")
        self.urls = [f"http://{HOST}:{p}" for p in self.ports]
        self.url = self.urls[0]
        self.proc.wait_http(self.url + "/health")

    def script(self, *steps: dict) -> None:
        httpx.post(self.url + "/_reset", json={}).raise_for_status()
        httpx.post(self.url + "/_script", json=list(steps)).raise_for_status()  # e.g. 413 past aiohttp's 1 MiB

    def journal(self) -> list[dict]:
        return httpx.get(self.url + "/_journal").json()

    def stop(self) -> None:
        self.proc.stop()


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def sse_events(text: str) -> list[str]:
    return [e for e in text.split("\n\n") if e]
