"""Shadow mode: the same live requests also go to a baseline, which can never hurt the primary."""

import statistics
import time

import httpx
import pytest

from otlp import TapReceiver, attrs
from procs import free_port, start_proxy, start_scripted
from waits import wait_until

BODY = {"model": "m", "prompt": "a b c", "max_tokens": 8, "stream": True}


@pytest.fixture(scope="module")
def backends():
    started = [start_scripted("prefill"), start_scripted("decode"), start_scripted("decode")]
    try:
        yield [url for _, url in started]
    finally:
        for proc, _ in started:
            proc.stop()


def reset(*urls):
    for url in urls:
        httpx.post(url + "/_reset", json={})


def journal(url, at_least):
    """A scripted instance's journal once it holds `at_least` requests (else None: not yet)."""
    entries = httpx.get(url + "/_journal").json()
    return entries if len(entries) >= at_least else None


def metric(url, name, **labels):
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.split()[-1])
    return total


def run_load(url, n=20):
    latencies = []
    with httpx.Client(timeout=20) as client:
        for i in range(n):
            started = time.monotonic()
            r = client.post(url + "/v1/completions", json=BODY, headers={"X-Request-Id": f"req-{i}"})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            latencies.append(time.monotonic() - started)
    return latencies


def test_shadow_gets_the_same_requests_in_the_same_trace(backends):
    p, d, shadow = backends
    reset(p, d, shadow)
    tap = TapReceiver()
    proxy, url = start_proxy("--prefill", p, "--decode", d, "--shadow-url", shadow, "--health-check-interval", "0",
                             "--otlp-endpoint", tap.endpoint, "--otlp-protocol", "http/protobuf",
                             env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        run_load(url, 5)
        mirrored = wait_until(lambda: journal(shadow, 5), "the shadow to get the 5 mirrored requests")
        primary = httpx.get(d + "/_journal").json()
        assert sorted(e["headers"]["x-request-id"] for e in mirrored) == [f"req-{i}" for i in range(5)]
        assert all(e["body"] == BODY for e in mirrored)  # the shadow is a single instance: the client's body as is
        assert all("kv_transfer_params" in e["body"] for e in primary)
        def roots_of_req0():
            roots = [s for s in tap.spans() if attrs(s).get("pd.request_id") == "req-0" and s["kind"] == 2]
            return roots if len(roots) == 2 else None

        roots = wait_until(roots_of_req0, "both root spans of req-0 (primary and shadow)")
        by_deployment = {attrs(s)["pd.deployment"]: s for s in roots}
        assert set(by_deployment) == {"primary", "shadow"}
        assert by_deployment["shadow"]["traceId"] == by_deployment["primary"]["traceId"]
        assert by_deployment["shadow"]["parentSpanId"] == by_deployment["primary"]["spanId"]
        assert attrs(by_deployment["shadow"])["pd.mode"] == "single"
        assert metric(url, "pdproxy_requests_total", deployment="shadow") == 5
        assert metric(url, "pdproxy_requests_total", deployment="primary") == 5
    finally:
        proxy.stop()
        tap.stop()


def run_side_by_side(url, yardstick, n=20):
    """n requests through `url`, each beside one through the proxy without a shadow: both latency lists."""
    pairs = [(run_load(yardstick, 1)[0], run_load(url, 1)[0]) for _ in range(n)]
    return [t for _, t in pairs], [u for u, _ in pairs]


def test_dead_or_slow_shadow_leaves_the_primary_unchanged(backends):
    p, d, shadow = backends
    reset(p, d, shadow)
    # the yardstick serves beside the shadowing proxy, request for request: same machine, same moment
    plain, plain_url = start_proxy("--prefill", p, "--decode", d, "--health-check-interval", "0")
    try:
        run_load(plain_url, 5)  # warm-up
        dead = f"http://127.0.0.1:{free_port()}"
        proxy, url = start_proxy("--prefill", p, "--decode", d, "--shadow-url", dead, "--health-check-interval", "0")
        try:
            with_dead, base = run_side_by_side(url, plain_url)
            assert metric(url, "pdproxy_shadow_requests_total", outcome="failed") >= 19
            shadow_failed = (metric(url, "pdproxy_requests_total", deployment="shadow")
                             - metric(url, "pdproxy_requests_total", deployment="shadow", failed_stage="none"))
            assert shadow_failed >= 19  # traced and counted like any request, never dropped from the statistics
            status = wait_until(lambda: (s := httpx.get(url + "/status").json()["shadow"])["in_flight"] == 0 and s,
                                "the copies to the dead shadow to end")
            assert status["target"] == dead and status["failed"] == status["sent"] >= 19
            assert status["failed"] == metric(url, "pdproxy_shadow_requests_total", outcome="failed")
        finally:
            proxy.stop()
        print(f"primary p50 side by side: no shadow {statistics.median(base) * 1e3:.1f} ms, dead shadow "
              f"{statistics.median(with_dead) * 1e3:.1f} ms")
        assert statistics.median(with_dead) < statistics.median(base) * 1.5 + 0.02
    finally:
        plain.stop()

    # A shadow that holds every request it gets: the primary's answers all complete while the shadow
    # still holds its two, so none of them waited for it (each would take the shadow's 60 s).
    httpx.post(shadow + "/_script", json=[{"delay": 60}] * 10)
    proxy, url = start_proxy("--prefill", p, "--decode", d, "--shadow-url", shadow, "--shadow-max-inflight", "2",
                             "--health-check-interval", "0")
    try:
        run_load(url, 20)  # each answer complete ([DONE]) and 200
        wait_until(lambda: metric(url, "pdproxy_shadow_requests_total", outcome="dropped_busy") == 18,
                   "18 of the 20 mirrors to be dropped (2 in flight at most)")
        assert metric(url, "pdproxy_shadow_requests_total", outcome="sent") == 2
        mirrored = wait_until(lambda: journal(shadow, 2), "the shadow to hold the two mirrored requests")
        assert len(mirrored) == 2
        assert not any(e["completed"] or e["aborted"] for e in mirrored), mirrored  # still held: nobody waited
        # an operator sees it: a start-up line, and /status with the two copies in flight
        (line,) = [x for x in proxy.output().splitlines() if "pdproxy: shadow:" in x]
        assert f"to {shadow} (single instance), at most 2 in flight, each within 120 s" in line
        status = httpx.get(url + "/status").json()["shadow"]
        assert status == {"target": shadow, "mode": "single", "prefill": [], "sample_rate": 1.0, "max_inflight": 2,
                          "timeout_seconds": 120.0, "in_flight": 2, "sent": 2, "failed": 0, "dropped_busy": 18,
                          "sampled_out": 0}
    finally:
        proxy.stop()


def test_sample_rate_mirrors_a_fraction(backends):
    p, d, shadow = backends
    reset(shadow)
    proxy, url = start_proxy("--decode", d, "--shadow-url", shadow, "--shadow-sample-rate", "0.3",
                             "--health-check-interval", "0")
    try:
        run_load(url, 40)
        sent = metric(url, "pdproxy_shadow_requests_total", outcome="sent")
        skipped = metric(url, "pdproxy_shadow_requests_total", outcome="sampled_out")
        assert sent + skipped == 40 and 2 <= sent <= 25
        status = httpx.get(url + "/status").json()["shadow"]
        assert (status["sample_rate"], status["sent"], status["sampled_out"]) == (0.3, sent, skipped)
    finally:
        proxy.stop()
