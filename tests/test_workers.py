"""`--workers N`: N processes serve one port, and /metrics on any of them counts every worker's requests."""

import os
import time
from pathlib import Path

import httpx

from otlp import GrpcReceiver
from procs import start_proxy, start_scripted
from waits import scaled

BODY = {"model": "m", "prompt": "one two three", "max_tokens": 8, "stream": True}


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{") or
               line.startswith(name + " "))


def test_workers_share_the_port_and_merge_their_metrics():
    receiver = GrpcReceiver()
    p_proc, p_url = start_scripted("prefill")
    d_proc, d_url = start_scripted("decode")
    proxy, url = start_proxy("--prefill", p_url, "--decode", d_url, "--workers", "2", "--health-check-interval", "0",
                             env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                  "OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        assert len(children(proxy.popen.pid)) == 1  # the first worker is the parent itself
        for _ in range(40):  # a new connection each time: the kernel spreads them over the workers
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")

        for _ in range(4):  # whichever worker answers the scrape, it reports all of them
            text = httpx.get(url + "/metrics").text
            assert metric_sum(text, "pdproxy_workers") == 2
            assert metric_sum(text, "pdproxy_requests_total") == 40
            assert metric_sum(text, "pdproxy_ttft_seconds_count") == 40
        om = httpx.get(url + "/metrics", headers={"Accept": "application/openmetrics-text"}).text
        assert om.rstrip().endswith("# EOF") and '# {trace_id="' in om
        # each worker's own process series, told apart by `worker`, never summed into one
        starts = {line.split("{", 1)[1].split("}", 1)[0]: float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("process_start_time_seconds{")}
        assert set(starts) == {'worker="0"', 'worker="1"'}, starts
        assert all(abs(t - time.time()) < 600 for t in starts.values())  # a time, not a sum of two
        rss = [line for line in text.splitlines() if line.startswith("process_resident_memory_bytes{")]
        assert len(rss) == 2 and all(float(line.split()[-1]) > 1e6 for line in rss)

        deadline = time.monotonic() + scaled(10)
        instances: set[str] = set()
        while time.monotonic() < deadline and len(instances) < 2:
            instances = {a["value"]["stringValue"] for req in receiver.requests for rs in req["resourceSpans"]
                         for a in rs["resource"]["attributes"] if a["key"] == "service.instance.id"}
            time.sleep(0.1)
        assert len(instances) == 2  # both workers served requests and trace them as themselves
    finally:
        worker_pids = children(proxy.popen.pid) if proxy.popen.poll() is None else []
        code = proxy.stop()
        for proc in (p_proc, d_proc):
            proc.stop()
        receiver.stop()
    assert code == 0
    for pid in worker_pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_workers_auto_starts_one_per_usable_cpu():
    d_proc, d_url = start_scripted("decode")
    proxy, url = start_proxy("--decode", d_url, "--workers", "auto", "--health-check-interval", "0")
    try:
        expected = len(os.sched_getaffinity(proxy.popen.pid))
        assert len(children(proxy.popen.pid)) == expected - 1  # the first worker is the parent itself
        if expected > 1:  # one worker has no siblings to merge
            assert metric_sum(httpx.get(url + "/metrics").text, "pdproxy_workers") == expected
    finally:
        code = proxy.stop()
        d_proc.stop()
    assert code == 0
