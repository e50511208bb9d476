"""The OTLP/HTTP exporter sends each batch at most once, and loses none to idle connections.

Against real OTLP/HTTP receivers on loopback (tests/otlp.py): a collector slower than
OTEL_EXPORTER_OTLP_TIMEOUT gets each batch once and the proxy counts it as dropped; a collector
that closes idle keep-alive connections still gets every batch exactly once (the one retry left:
a request that provably did not reach it); and shutdown does not close the sinks under a send
still in progress.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from otlp import HttpReceiver
from procs import start_proxy, start_sim

from pdproxy.telemetry.otlp import KIND_SERVER, HttpTransport, SpanData
from pdproxy.telemetry.tracefile import TraceFileExporter
from pdproxy.telemetry.tracing import Tracing

BODY = {"model": "sim-model", "prompt": "one two three", "max_tokens": 2}
SPANS_PER_REQUEST = 4  # single mode: root, pd.queue, pd.prefill, pd.decode


@pytest.fixture(scope="module")
def sim():
    proc, url = start_sim("single", "--time-scale", "0.1")
    yield url
    proc.stop()


def dropped(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdproxy_spans_dropped_total{"))


def wait_for(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (result := condition()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return result


def test_a_collector_slower_than_the_timeout_gets_each_batch_once_and_it_is_counted(sim):
    timeout = 0.5
    receiver = HttpReceiver(delay=6 * timeout)  # answers long after the exporter has given up
    proxy, url = start_proxy("--decode", sim, "--otlp-endpoint", receiver.endpoint, "--otlp-protocol", "http/protobuf",
                             "--health-check-interval", "0",
                             env={"OTEL_BSP_SCHEDULE_DELAY": "20", "OTEL_EXPORTER_OTLP_TIMEOUT": str(timeout)})
    try:
        requests = 6
        for i in range(1, requests + 1):  # one request at a time: each its own batch, given up on, counted
            assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
            assert wait_for(lambda: dropped(url) == i * SPANS_PER_REQUEST), f"dropped {dropped(url)} after {i}"
        made = requests * SPANS_PER_REQUEST
        wait_for(lambda: len(receiver.span_ids) >= made, 5)  # the collector reads each before its long pause
        ids = receiver.span_ids
        print(f"\n{made} spans made, all counted as dropped; the collector was posted {len(ids)} of them "
              f"in {receiver.posts} requests")
        assert len(ids) == len(set(ids)) == made  # each batch reached it, and only once
        assert receiver.posts == requests
    finally:
        proxy.stop()
        receiver.stop()


def test_a_collector_closing_idle_connections_gets_every_batch_exactly_once(sim):
    receiver = HttpReceiver(idle_close=0.3)
    proxy, url = start_proxy("--decode", sim, "--otlp-endpoint", receiver.endpoint, "--otlp-protocol", "http/protobuf",
                             "--health-check-interval", "0", env={"OTEL_BSP_SCHEDULE_DELAY": "20"})
    try:
        made = 0
        for _ in range(3):
            for _ in range(3):
                assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
            made += 3 * SPANS_PER_REQUEST
            assert wait_for(lambda: len(receiver.span_ids) >= made)
            # the collector closes the kept-alive connection; the next batch must find that out, not lose itself
            assert wait_for(lambda: receiver.closed == receiver.connections)
        ids = receiver.span_ids
        assert len(ids) == len(set(ids)) == made
        assert receiver.connections >= 3  # a new one each round: the idle one had been closed by the collector
        assert dropped(url) == 0
    finally:
        proxy.stop()
        receiver.stop()


def test_shutdown_leaves_the_sinks_to_a_send_still_in_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "10")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    receiver = HttpReceiver(delay=2.0)
    trace_file = tmp_path / "spans.jsonl"
    drops: list[tuple[str, int]] = []
    tracing = Tracing({}, [HttpTransport(receiver.endpoint), TraceFileExporter(trace_file)], 64,
                      on_drop=lambda reason, count: drops.append((reason, count)))
    try:
        span_id = random.getrandbits(64)
        now = time.time_ns()
        tracing.emit([SpanData("request", KIND_SERVER, random.getrandbits(128), span_id, None, now, now + 1000)])
        assert wait_for(lambda: receiver.posts == 1, 10)  # the export thread now waits for the collector
        tracing.shutdown(timeout=0.05)
        assert tracing.worker.is_alive()  # shutdown did not wait out the slow collector...
        tracing.worker.join(15)
        assert not tracing.worker.is_alive()
        # ...nor pull the sinks from under it: the collector's answer counts, then the file gets the batch
        assert drops == []
        assert receiver.span_ids == [f"{span_id:016x}"]
        (line,) = trace_file.read_text().splitlines()
        (span,) = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
        assert span["spanId"] == f"{span_id:016x}"
    finally:
        receiver.stop()


def test_spans_that_come_while_a_full_batch_is_sent_wait_for_the_next_full_batch(monkeypatch):
    """Under load the export thread is woken for each full batch; the few spans that came meanwhile
    go with the next one (or after the schedule delay), not as a post of their own each time."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "30000")  # only full batches, until the shutdown
    receiver = HttpReceiver(delay=0.3)
    tracing = Tracing({}, [HttpTransport(receiver.endpoint)], 4096, on_drop=lambda reason, count: None)

    def spans(n: int) -> list[SpanData]:
        now = time.time_ns()
        return [SpanData("request", KIND_SERVER, random.getrandbits(128), random.getrandbits(64), None, now, now + 1)
                for _ in range(n)]

    try:
        tracing.emit(spans(520))  # a full batch (512): the thread wakes and posts it, which takes 0.3 s
        assert wait_for(lambda: receiver.posts == 1, 10)
        tracing.emit(spans(30))  # meanwhile: 38 wait
        time.sleep(0.6)
        assert receiver.batches == [512]
        tracing.emit(spans(500))  # 538: a full batch again
        assert wait_for(lambda: receiver.posts == 2, 10)
        time.sleep(0.6)
        tracing.shutdown(timeout=10)  # and the rest at the end
        assert receiver.batches == [512, 512, 26]
    finally:
        receiver.stop()
