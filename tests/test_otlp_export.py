"""The OTLP/HTTP exporter sends each batch at most once, and loses none to idle connections.

Against real OTLP/HTTP receivers on loopback (tests/otlp.py): a collector slower than
OTEL_EXPORTER_OTLP_TIMEOUT gets each batch once and the proxy counts it as dropped; a collector
that closes idle keep-alive connections still gets every batch exactly once (the one retry left:
a request that provably did not reach it); shutdown gives up on a slow collector in time, and the
trace file beside it still gets the batch.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from otlp import HttpReceiver
from procs import start_proxy, start_sim

from pdproxy.telemetry.export import HttpExporter, ThreadedSink
from pdproxy.telemetry.otlp import KIND_SERVER, SpanData
from pdproxy.telemetry.tracefile import TraceFileExporter
from pdproxy.telemetry.tracing import Tracing

BODY = {"model": "sim-model", "prompt": "one two three", "max_tokens": 2}
SPANS_PER_REQUEST = 4  # single mode: root, pd.queue, pd.prefill, pd.decode


def emit_requests(tracing: Tracing, n: int) -> None:
    """`n` requests of five spans each, one trace apiece, as the recorder queues them."""
    for _ in range(n):
        now, trace_id = time.time_ns(), random.getrandbits(128)
        tracing.emit([SpanData("request", KIND_SERVER, trace_id, random.getrandbits(64), None, now, now + 1)
                      for _ in range(5)])


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


def test_shutdown_gives_up_on_a_slow_collector_in_time_and_the_file_gets_its_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "10")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    receiver = HttpReceiver(delay=3.0)
    trace_file = tmp_path / "spans.jsonl"
    drops: list[tuple[str, int]] = []
    span_id = random.getrandbits(64)

    async def run() -> float:
        tracing = Tracing({}, [HttpExporter(receiver.endpoint), ThreadedSink(TraceFileExporter(trace_file))], 64,
                          on_drop=lambda reason, count: drops.append((reason, count)))
        now = time.time_ns()
        tracing.emit([SpanData("request", KIND_SERVER, random.getrandbits(128), span_id, None, now, now + 1000)])
        for _ in range(1000):  # the batch reaches the collector, which then takes its time to answer
            if receiver.posts:
                break
            await asyncio.sleep(0.01)
        began = time.monotonic()
        await tracing.shutdown(timeout=0.3)
        return time.monotonic() - began

    try:
        took = asyncio.run(run())
        assert took < 2.0, f"shutdown waited {took:.1f} s for the collector"  # its answer comes after 3 s
        assert receiver.span_ids == [f"{span_id:016x}"]
        assert drops == []  # given up at exit, not refused: nothing to count any more
        # the slow collector did not keep the batch from the file, sent beside it
        (line,) = trace_file.read_text().splitlines()
        (span,) = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
        assert span["spanId"] == f"{span_id:016x}"
    finally:
        receiver.stop()


def test_spans_that_come_while_the_delays_post_is_sent_wait_for_the_delay_again(monkeypatch):
    """A post made because the schedule delay ran out is followed by the next one a delay later, not
    the moment it is answered: a busy proxy would otherwise post the few spans of every post's
    duration, one post after another (what the export did until 2026-12-02)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "1000")
    receiver = HttpReceiver(delay=0.3)

    async def run() -> None:
        tracing = Tracing({}, [HttpExporter(receiver.endpoint)], 4096, on_drop=lambda reason, count: None)
        emit_requests(tracing, 1)
        for _ in range(300):  # the delay's post, about a second later
            if receiver.posts:
                break
            await asyncio.sleep(0.01)
        sent = time.monotonic()
        emit_requests(tracing, 3)  # while that post is answered (0.3 s)
        await asyncio.sleep(0.6)
        posts_before_delay = receiver.posts if time.monotonic() - sent < 0.95 else None
        await tracing.shutdown(timeout=10)
        assert posts_before_delay in (1, None), "posted again as soon as the first post was answered"
        assert posts_before_delay is not None, "the machine was too slow to tell (0.95 s passed)"
        assert receiver.batches == [5, 15]

    try:
        asyncio.run(run())
    finally:
        receiver.stop()


def test_spans_that_come_while_a_full_batch_is_sent_wait_for_the_next_full_batch(monkeypatch):
    """Under load a post goes for each full batch; the few spans that came meanwhile go with the next
    one (or after the schedule delay), not as a post of their own each time. A batch holds whole
    requests (here five spans each): 102 of them, 510 spans, the most under 512."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "30000")  # only full batches, until the shutdown
    receiver = HttpReceiver(delay=0.3)

    async def until(condition) -> None:
        for _ in range(1000):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("not within 10 s")

    async def run() -> None:
        tracing = Tracing({}, [HttpExporter(receiver.endpoint)], 4096, on_drop=lambda reason, count: None)
        emit_requests(tracing, 104)  # 520 spans: a full batch posted at once, which takes 0.3 s
        await until(lambda: receiver.posts == 1)
        emit_requests(tracing, 6)  # meanwhile: 40 wait
        await asyncio.sleep(0.6)
        assert receiver.batches == [510]
        emit_requests(tracing, 100)  # 540: a full batch again
        await until(lambda: receiver.posts == 2)
        await asyncio.sleep(0.6)
        await tracing.shutdown(timeout=10)  # and the rest at the end
        assert receiver.batches == [510, 510, 30]
        # every request's spans in one post
        assert len(receiver.trace_posts) == 210 and all(len(posts) == 1 for posts in receiver.trace_posts.values())

    try:
        asyncio.run(run())
    finally:
        receiver.stop()
