"""A collector that is down, silent, refusing or slower than the export timeout never slows serving;
the span queue stays bounded and every span is accounted for: what the collector acknowledged plus
what the proxy counted as dropped is exactly what it made, and no batch is sent twice."""

import socket
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from ledgers import ScriptedGroup, counter, proc_rss
from otlp import HttpReceiver
from procs import HOST, free_port, start_proxy
from waits import scaled

BODY = {"model": "m", "prompt": "a b c", "max_tokens": 4, "stream": False}
N = 150
SPANS_PER_REQUEST = 5  # root + queue, prefill, kv_transfer, decode


class Refusing(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def black_hole():
    """Accepts connections (the kernel does, from the backlog) and never answers."""
    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen(1024)
    return f"http://{HOST}:{sock.getsockname()[1]}", sock.close, lambda: 0, list


def refusing():
    server = ThreadingHTTPServer((HOST, 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://{HOST}:{server.server_port}", server.shutdown, lambda: 0, list


TIMEOUT = 1.0  # OTEL_EXPORTER_OTLP_TIMEOUT of the proxy under test


def slow():
    """Answers every export, 200, but only 5x the exporter's timeout after it arrived: the exporter
    has given up on each one by then (so each is counted as dropped), and must not send it again."""
    receiver = HttpReceiver(delay=5 * TIMEOUT)
    return receiver.endpoint, receiver.stop, lambda: 0, lambda: receiver.span_ids  # none acknowledged in time


def down():
    return f"http://{HOST}:{free_port()}", lambda: None, lambda: 0, list


@pytest.fixture(scope="module")
def backends():
    p, d = ScriptedGroup("prefill", 1), ScriptedGroup("decode", 1)
    yield p, d
    p.stop()
    d.stop()


@pytest.fixture(scope="module")
def untraced(backends):
    """A proxy that creates no spans, on the same instances: the yardstick for serving latency, measured
    beside the traced proxy, request for request (a baseline from another moment measures the machine)."""
    p, d = backends
    proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--health-check-interval", "0", "--no-tracing")
    yield url
    proxy.stop()


def timed_post(client: httpx.Client, url: str) -> tuple[bool, float]:
    started = time.monotonic()
    ok = client.post(url + "/v1/completions", json=BODY).status_code == 200
    return ok, time.monotonic() - started


def side_by_side(client: httpx.Client, traced_url: str, untraced_url: str) -> tuple[bool, float, float]:
    """One request through each proxy, back to back: (both succeeded, traced latency, untraced latency)."""
    ok_u, untraced = timed_post(client, untraced_url)
    ok_t, traced = timed_post(client, traced_url)
    return ok_u and ok_t, traced, untraced


def serve_load(url: str, untraced_url: str) -> tuple[list[float], list[float]]:
    """N requests through the traced proxy, each beside one through the untraced one: both latency lists."""
    with httpx.Client(timeout=10) as client:
        for _ in range(10):
            client.post(url + "/v1/completions", json=BODY)  # warm-up
            client.post(untraced_url + "/v1/completions", json=BODY)
        pairs = [side_by_side(client, url, untraced_url) for _ in range(N)]
    assert all(ok for ok, _, _ in pairs)
    return [t for _, t, _ in pairs], [u for _, _, u in pairs]


@pytest.mark.parametrize("collector", [black_hole, refusing, slow, down], ids=["silent", "refusing", "slow", "down"])
def test_collector_outage_leaves_serving_latency_alone_and_counts_every_span(backends, untraced, collector):
    p, d = backends
    endpoint, close, received, posted = collector()  # posted: span ids the collector was sent
    proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--health-check-interval", "0",
                             "--otlp-endpoint", endpoint, "--otlp-protocol", "http/protobuf", "--span-queue-size", "64",
                             env={"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_EXPORTER_OTLP_TIMEOUT": str(TIMEOUT)})
    try:
        rss_before = proc_rss(proxy.popen.pid)
        latencies, baseline = serve_load(url, untraced)
        base, out = statistics.median(baseline), statistics.median(latencies)
        print(f"\nmedian latency side by side: no tracing {base * 1000:.1f} ms, collector {collector.__name__} "
              f"{out * 1000:.1f} ms; p99 {sorted(latencies)[int(N * 0.99)] * 1000:.1f} ms")
        assert out < base * 2 + 0.010  # generous: span creation costs something, the outage nothing
        assert max(latencies) < max(baseline) + scaled(1.0)  # no request ever waits for the exporter
        assert proc_rss(proxy.popen.pid) - rss_before < 30 * 2**20  # the queue is bounded
        made = (N + 10) * SPANS_PER_REQUEST
        deadline, dropped = time.monotonic() + scaled(20), 0.0
        while time.monotonic() < deadline:
            dropped = counter(httpx.get(url + "/metrics").text, "pdproxy_spans_dropped_total")
            if dropped + received() >= made:
                break
            time.sleep(0.25)
        print(f"spans made {made}, received by the collector {received()}, counted as dropped {dropped:.0f}")
        assert dropped + received() == made  # every span either arrived or is counted as lost
        ids = posted()
        assert len(ids) == len(set(ids))  # no batch was sent twice
        if collector is slow:
            print(f"the slow collector was posted {len(ids)} spans, each once")
            assert 0 < len(ids) <= made  # it was sent batches, each counted as dropped after the timeout
    finally:
        proxy.stop()
        close()
