"""The real collector stops under load and comes back: serving never notices, lost spans are counted,
and export resumes by itself.

tests/test_reliability_telemetry.py covers silent, refusing, slow and absent receivers written in
Python; this is the same promise with pdproxy's collector distribution (collector/otelcol.yaml on
loopback ports) and the proxy's default transport, OTLP/gRPC, whose channel has to reconnect.
"""

from __future__ import annotations

import statistics
import time

import httpx
import pytest

from gotools import Collector, collector_binary, load_config
from ledgers import ScriptedGroup, counter, spans_in
from procs import HOST, free_port, start_proxy
from test_reliability_telemetry import SPANS_PER_REQUEST, side_by_side
from waits import Load, scaled, wait_until

PHASES = {"up": 4.0, "stopped": 5.0, "restarted": 4.0}  # seconds of load in each (restarted: after export resumed)
# A bound per phase, never shared: a fast machine idles at it and cannot eat a later phase's requests. High
# enough that no phase reaches it (the longest, 9 s, would need < 0.5 ms per pair of proxied requests): a
# phase that idles early makes no spans to show export resuming.
PER_PHASE_CAP = 20_000
MIN_PER_PHASE = 20

pytestmark = pytest.mark.timeout(scaled(240))


def accepted_spans(collector: Collector) -> float:
    """Spans the collector's OTLP receiver accepted since it started (its own telemetry)."""
    return counter(collector.metrics(), "otelcol_receiver_accepted_spans")


def test_collector_restart_under_load(tmp_path, capsys):
    binary = collector_binary()
    p, d = ScriptedGroup("prefill", 1), ScriptedGroup("decode", 1)
    # The users' configuration on loopback ports, plus a file exporter on the unsampled pipeline
    # that writes down every span each run of the collector received (a new file per run).
    config = load_config("otelcol.yaml")
    config["exporters"]["file/received"] = {"path": str(tmp_path / "run-1.jsonl")}
    config["service"]["pipelines"]["traces/metrics"]["exporters"].append("file/received")
    collector = Collector(config, binary=binary, env={"TEMPO_OTLP_ENDPOINT": f"{HOST}:{free_port()}"})  # no Tempo here
    procs = []
    try:
        # the yardstick runs beside the traced proxy, request for request: same machine, same moment
        untraced, untraced_url = start_proxy("--prefill", p.url, "--decode", d.url, "--health-check-interval", "0",
                                             "--no-tracing")
        procs.append(untraced)
        collector.start()
        proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--health-check-interval", "0",
                                 "--otlp-endpoint", collector.otlp_grpc, "--otlp-protocol", "grpc",
                                 env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
        procs.append(proxy)
        client = httpx.Client(timeout=10)
        with Load(lambda phase: side_by_side(client, url, untraced_url), list(PHASES), cap=PER_PHASE_CAP) as load:
            load.run_phase("up", PHASES["up"], MIN_PER_PHASE)
            load.enter("stopped")
            collector.stop()  # SIGTERM, as a rolling restart or an orchestrator does
            time.sleep(PHASES["stopped"])
            load.end_phase("stopped", MIN_PER_PHASE)
            collector.config["exporters"]["file/received"]["path"] = str(tmp_path / "run-2.jsonl")
            collector.write_config()
            collector.start()  # returns once its health check says every pipeline runs
            healthy_at = time.monotonic()
            load.enter("restarted")  # from here on every span has a collector to go to
            # on its own, within the proxy's gRPC reconnect backoff (capped at 2 s, plus jitter)
            wait_until(lambda: accepted_spans(collector) > 0, "export to resume after the restart", timeout=5.0,
                       interval=0.1)
            resumed_after = time.monotonic() - healthy_at
            load.run_phase("restarted", PHASES["restarted"], MIN_PER_PHASE)
        client.close()
        assert not load.errors, load.errors[:3]

        # Every span either reached one of the two runs of the collector or is counted as dropped.
        made = load.made * SPANS_PER_REQUEST
        first = len(spans_in(tmp_path / "run-1.jsonl"))  # complete: that run has shut down

        def dropped() -> float:
            return counter(httpx.get(url + "/metrics").text, "pdproxy_spans_dropped_total")

        try:
            wait_until(lambda: dropped() + first + accepted_spans(collector) >= made,
                       "every span to arrive or be counted as dropped", timeout=15, interval=0.25)
        finally:
            lost = dropped()
            collector.stop()  # flushes the file exporter
        second = len(spans_in(tmp_path / "run-2.jsonl"))

        with capsys.disabled():  # the outage figures are part of CI's output
            medians = ", ".join(f"{phase} {statistics.median(t for _, t, _ in v) * 1000:.2f} ms (untraced "
                                f"{statistics.median(u for _, _, u in v) * 1000:.2f})"
                                for phase, v in load.results.items())
            slowest = ", ".join(f"{phase} {max(t for _, t, _ in v) * 1000:.1f} ms" for phase, v in load.results.items())
            counts = ", ".join(f"{phase} {len(v)}" for phase, v in load.results.items())
            print(f"\nmedian latency, side by side: {medians}; slowest request: {slowest}")
            print(f"requests: {counts}; spans made {made}: received by the first run {first}, by the second run "
                  f"{second}, counted as dropped {lost:.0f}; export resumed {resumed_after:.1f} s after the "
                  f"collector was healthy again")
        for phase, results in load.results.items():
            assert all(ok for ok, _, _ in results), f"failed requests in phase {phase}"
            traced = [t for _, t, _ in results]
            yardstick = [u for _, _, u in results]
            # tracing costs little, the outage nothing: compared with the untraced proxy at the same moments
            assert statistics.median(traced) < statistics.median(yardstick) * 2 + 0.010, phase
            assert max(traced) < max(yardstick) + scaled(1.0), phase  # no request ever waits for the exporter
        assert first + second + lost == made, "every span arrived or is counted as dropped"
        stopped = len(load.results["stopped"])
        assert lost >= stopped * SPANS_PER_REQUEST * 0.5, "the outage's spans are counted as dropped"
        assert second >= len(load.results["restarted"]) * SPANS_PER_REQUEST * 0.2
    finally:
        for proc in reversed(procs):
            proc.stop()
        collector.stop()
        p.stop()
        d.stop()
