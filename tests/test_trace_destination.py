"""Tracing is never silently off: the start-up log and /status say where spans go, or why none are made."""

from __future__ import annotations

import time

import httpx
import pytest

from procs import free_port, start_proxy
from waits import scaled

CLEAN = {name: "" for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                               "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                               "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER")}


def started(*args: str, env: dict[str, str] | None = None) -> tuple[str, dict]:
    """The proxy's start-up log and its /status, for a proxy whose (absent) instance is never probed."""
    proc, url = start_proxy("--decode", f"http://127.0.0.1:{free_port()}", "--health-check-interval", "0", *args,
                            env={**CLEAN, **(env or {})})
    try:
        status = httpx.get(url + "/status").json()
        deadline = time.monotonic() + scaled(5)
        while "traces:" not in proc.output() and time.monotonic() < deadline:
            time.sleep(0.05)
        return proc.output(), status
    finally:
        proc.stop()


def test_no_destination_says_tracing_is_off_and_how_to_turn_it_on() -> None:
    log, status = started()
    line = next(x for x in log.splitlines() if "traces:" in x)
    assert "WARNING" in line and "traces: off (no OTLP endpoint and no trace file)" in line
    assert "--otlp-endpoint" in line and "OTEL_EXPORTER_OTLP_ENDPOINT" in line and "--trace-file" in line
    tracing = status["tracing"]
    assert tracing["enabled"] is False and tracing["off_reason"] == "no OTLP endpoint and no trace file"
    assert tracing["summary"] in line


def test_flags_name_the_endpoint_protocol_and_file(tmp_path) -> None:
    port = free_port()  # nothing listens: the line states the destination, not that it is reachable
    trace_file = tmp_path / "spans.jsonl"
    log, status = started("--otlp-endpoint", f"http://127.0.0.1:{port}", "--otlp-protocol", "http/protobuf",
                          "--trace-file", str(trace_file))
    expected = f"traces: OTLP http/protobuf to http://127.0.0.1:{port}/v1/traces and file {trace_file}"
    assert expected in log
    tracing = status["tracing"]
    assert tracing["enabled"] is True and tracing["otlp_protocol"] == "http/protobuf"
    assert tracing["otlp_endpoint"] == f"http://127.0.0.1:{port}/v1/traces" and tracing["trace_file"] == str(trace_file)


@pytest.mark.parametrize("args, env, expected", [
    ((), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4999"}, "traces: OTLP grpc to http://127.0.0.1:4999"),
    (("--no-tracing", "--trace-file", "/nonexistent/x.jsonl"), {}, "traces: off (--no-tracing); drop --no-tracing"),
    (("--trace-file", "SPANS"), {"OTEL_SDK_DISABLED": "true"}, "traces: off (OTEL_SDK_DISABLED=true)"),
])
def test_environment_and_switches_are_reported(args, env, expected, tmp_path) -> None:
    args = tuple(str(tmp_path / "spans.jsonl") if a == "SPANS" else a for a in args)
    log, status = started(*args, env=env)
    assert expected in log
    assert status["tracing"]["summary"] in log
