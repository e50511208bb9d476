"""Telemetry loss is never silent: a failed span export is said in the log at once (destination and
reason), then summarised at most once a minute, and its return is said too; /status shows each
destination's state; start-up says when the OTLP endpoint cannot be reached and refuses a trace file
it cannot write. Serving goes on meanwhile, every request answered."""

import logging
import os
import re
import sys
from pathlib import Path

import httpx
import pytest

import procs
from ledgers import ScriptedGroup, counter
from otlp import GrpcReceiver
from procs import HOST, free_port, start_proxy
from waits import wait_until

from pdproxy.telemetry.export import LossLog

BODY = {"model": "m", "prompt": "a b c", "max_tokens": 4, "stream": False}
SPANS_PER_REQUEST = 5  # root + queue, prefill, kv_transfer, decode
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_EXPORTER_OTLP_TIMEOUT": "2"}


@pytest.fixture(scope="module")
def backends():
    p, d = ScriptedGroup("prefill", 1), ScriptedGroup("decode", 1)
    yield p, d
    p.stop()
    d.stop()


def serve(url: str, n: int) -> None:
    with httpx.Client(timeout=10) as client:
        codes = [client.post(url + "/v1/completions", json=BODY).status_code for _ in range(n)]
    assert codes == [200] * n  # serving never notices the lost telemetry


def exporters(url: str) -> dict[str, dict]:
    return {e["kind"]: e for e in httpx.get(url + "/status").json()["telemetry"]["exporters"]}


def dropped(url: str) -> float:
    return counter(httpx.get(url + "/metrics").text, "pdproxy_spans_dropped_total", reason="export_failed")


def test_a_dead_collector_is_said_at_start_at_its_first_failure_and_when_it_is_back(backends):
    p, d = backends
    port = free_port()  # nothing listens there yet: the typo'd endpoint of the issue
    endpoint = f"http://{HOST}:{port}"
    proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--health-check-interval", "0",
                             "--otlp-endpoint", endpoint, env=FAST_EXPORT)
    receiver = None
    try:
        wait_until(lambda: "cannot be reached at start-up" in proxy.output(), "the start-up line")
        (line,) = [x for x in proxy.output().splitlines() if "cannot be reached" in x]
        assert "WARNING" in line and endpoint in line and "Connection refused" in line
        assert exporters(url)["otlp"]["state"] == "unreachable"

        serve(url, 20)
        wait_until(lambda: dropped(url) == 20 * SPANS_PER_REQUEST, "every span counted as dropped")
        failures = [x for x in proxy.output().splitlines() if "span export to OTLP" in x]
        # one line at once (several batches failed), no line per batch; the summary comes after a minute
        assert len(failures) == 1, failures
        assert f"grpc {endpoint} failed: UNAVAILABLE" in failures[0] and "refused" in failures[0]
        assert 'pdproxy_spans_dropped_total{reason="export_failed"}' in failures[0]
        state = exporters(url)["otlp"]
        assert state["state"] == "failing" and state["last_success"] is None
        assert state["spans_dropped"] == 20 * SPANS_PER_REQUEST and state["spans_sent"] == 0
        assert "refused" in state["last_error"]["reason"] and state["last_error"]["seconds_ago"] < 30

        receiver = GrpcReceiver(port)  # the collector comes up where it was expected
        # gRPC reconnects within its capped backoff (2 s): a batch or two more may be lost meanwhile
        def delivered():
            serve(url, 1)
            return exporters(url)["otlp"]["spans_sent"]
        wait_until(delivered, "a batch delivered to the collector once it is up", timeout=15, interval=0.3)
        back = [x for x in proxy.output().splitlines() if "works again" in x]
        assert len(back) == 1 and endpoint in back[0]
        lost = int(re.search(r"(\d+) span\(s\) were dropped meanwhile", back[0]).group(1))
        assert lost == dropped(url) >= 20 * SPANS_PER_REQUEST
        state = exporters(url)["otlp"]
        assert state["state"] == "ok" and state["last_success"]["seconds_ago"] < 30
        assert state["spans_sent"] == len(receiver.span_names())
    finally:
        proxy.stop()
        if receiver is not None:
            receiver.stop()


def test_a_full_disk_under_the_trace_file_is_said_and_shown(backends):
    p, d = backends
    # /dev/full: every write fails with ENOSPC, as on a full disk
    proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--health-check-interval", "0",
                             "--trace-file", "/dev/full", env=FAST_EXPORT)
    try:
        serve(url, 10)
        wait_until(lambda: dropped(url) == 10 * SPANS_PER_REQUEST, "every span counted as dropped")
        failures = [x for x in proxy.output().splitlines() if "span export to file" in x]
        assert len(failures) == 1, failures
        assert "/dev/full: No space left on device (ENOSPC)" in failures[0]
        state = exporters(url)["file"]
        assert state["state"] == "failing" and state["target"] == "/dev/full"
        assert state["spans_dropped"] == 10 * SPANS_PER_REQUEST
        assert "ENOSPC" in state["last_error"]["reason"]
    finally:
        proxy.stop()


def unwritable_places(tmp: Path) -> list[tuple[str, str]]:
    """(trace file path, what start-up must say): a directory in the way, and a file without write
    permission (for root, whom file modes do not stop, a read-only sysfs file)."""
    places = [(str(tmp), "Is a directory (EISDIR)")]
    if os.geteuid() != 0:
        locked = tmp / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        places.append((str(locked / "traces.jsonl"), "Permission denied (EACCES)"))
    elif Path("/sys/kernel/notes").exists():
        places.append(("/sys/kernel/notes", "Permission denied (EACCES)"))
    return places


def test_a_trace_file_that_cannot_be_written_is_refused_at_start_in_one_line(tmp_path):
    for path, reason in unwritable_places(tmp_path):
        r = procs.run([sys.executable, "-m", "pdproxy", "serve", "--port", str(free_port()), "--decode",
                       f"http://{HOST}:{free_port()}", "--trace-file", path], timeout=30)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == f"pdproxy serve: error: cannot write the trace file {path}: {reason}", r.stderr


def test_loss_is_said_once_then_summarised_then_its_end(caplog):
    caplog.set_level(logging.WARNING, "pdproxy.export")
    loss = LossLog("span export to OTLP grpc http://c:4317", "export_failed", every=60)
    for second in range(0, 50, 5):  # a batch lost every 5 s for 50 s: one line
        loss.lost(5, "UNAVAILABLE: connection refused", 1000.0 + second)
    assert [r.getMessage() for r in caplog.records] == [
        "span export to OTLP grpc http://c:4317 failed: UNAVAILABLE: connection refused; 5 span(s) dropped "
        '(counted in pdproxy_spans_dropped_total{reason="export_failed"}); while this goes on, a summary follows at '
        "most every 60 s"]
    loss.lost(7, "HTTP 503", 1061.0)  # a minute after the first line: the summary of what was not said
    assert caplog.records[-1].getMessage() == ("span export to OTLP grpc http://c:4317 failed again: 10 more time(s), "
                                               "52 span(s) dropped in the last 61 s; last: HTTP 503")
    loss.lost(5, "HTTP 503", 1070.0)
    assert len(caplog.records) == 2
    loss.recovered(1090.0)
    assert caplog.records[-1].getMessage() == ("span export to OTLP grpc http://c:4317 works again after 90 s; "
                                               "62 span(s) were dropped meanwhile")
    loss.recovered(1095.0)  # nothing to say twice
    loss.lost(1, "x", 2000.0)  # a new outage starts with its own first line
    assert len(caplog.records) == 4 and "failed: x; 1 span(s) dropped" in caplog.records[-1].getMessage()


def test_a_full_span_queue_is_said_once_and_when_it_has_room_again(caplog, monkeypatch):
    """The queue in front of a destination that does not answer fills; what does not fit is said, not
    only counted, and so is the moment it has room again. In /status: the queue's own drops."""
    import asyncio

    from test_otlp_export import emit_requests

    from pdproxy.telemetry.tracing import Tracing

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    caplog.set_level(logging.WARNING, "pdproxy.export")

    class Stuck:
        """A destination that takes a batch only when let go."""
        error = None

        def __init__(self) -> None:
            self.go = asyncio.Event()

        async def send(self, payload: bytes) -> bool:
            await self.go.wait()
            return True

        async def close(self) -> None:
            pass

    async def run() -> None:
        sink = Stuck()
        drops: list[tuple[str, int]] = []
        tracing = Tracing({}, [sink], 20, on_drop=lambda reason, count: drops.append((reason, count)))
        emit_requests(tracing, 1)  # 5 spans: sent, and stuck
        await asyncio.sleep(0.1)
        emit_requests(tracing, 8)  # 4 fit the queue of 20, 4 do not
        queue = [r.getMessage() for r in caplog.records if "span queue" in r.getMessage()]
        assert queue == ["span queue (20 spans, --span-queue-size) is full: spans come faster than the destinations "
                         "take them; 5 span(s) dropped (counted in pdproxy_spans_dropped_total{reason=\"queue_full\"}); "
                         "while this goes on, a summary follows at most every 60 s"]
        assert drops == [("queue_full", 5)] * 4
        assert tracing.status()["queue"] == {"spans": 20, "capacity": 20, "spans_dropped_full": 20}
        sink.go.set()
        await tracing.shutdown(timeout=5)
        back = [r.getMessage() for r in caplog.records if "has room again" in r.getMessage()]
        assert len(back) == 1 and "20 span(s) were dropped meanwhile" in back[0]
        assert tracing.status()["exporters"][0]["spans_sent"] == 25

    asyncio.run(run())
