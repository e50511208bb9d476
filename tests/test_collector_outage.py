"""The real collector stops under load and comes back: serving never notices, lost spans are counted,
and export resumes by itself.

tests/test_reliability_telemetry.py covers silent, refusing, slow and absent receivers written in
Python; this is the same promise with pdproxy's collector distribution (collector/otelcol.yaml on
loopback ports) and the proxy's default transport, OTLP/gRPC, whose channel has to reconnect.
"""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from gotools import Collector, collector_binary, load_config
from ledgers import ScriptedGroup, counter, spans_in
from procs import HOST, free_port, start_proxy
from test_reliability_telemetry import BODY, SPANS_PER_REQUEST, untraced_latencies

PHASES = {"up": 4.0, "stopped": 5.0, "restarted": 10.0}  # seconds of load in each
MAX_REQUESTS = 3000  # bound on the whole load loop

pytestmark = pytest.mark.timeout(240)


class Load:
    """Sequential requests from a background thread, each latency tagged with the phase it ran in."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.phase = "up"
        self.latencies: dict[str, list[float]] = {p: [] for p in PHASES}
        self.failures = 0
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            for _ in range(MAX_REQUESTS):
                if self.stopping:
                    return
                phase, started = self.phase, time.monotonic()
                ok = client.post(self.url + "/v1/completions", json=BODY).status_code == 200
                self.latencies[phase].append(time.monotonic() - started)
                self.failures += not ok

    @property
    def made(self) -> int:
        return sum(len(v) for v in self.latencies.values())


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
    proxy = None
    try:
        baseline = untraced_latencies(p, d)

        collector.start()
        proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--health-check-interval", "0",
                                 "--otlp-endpoint", collector.otlp_grpc, "--otlp-protocol", "grpc",
                                 env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
        load = Load(url)
        load.thread.start()
        time.sleep(PHASES["up"])
        load.phase = "stopped"
        collector.stop()  # SIGTERM, as a rolling restart or an orchestrator does
        time.sleep(PHASES["stopped"])
        collector.config["exporters"]["file/received"]["path"] = str(tmp_path / "run-2.jsonl")
        collector.write_config()
        load.phase = "restarted"
        restarted_at = time.monotonic()
        collector.start()
        resumed_after = None
        while time.monotonic() < restarted_at + PHASES["restarted"]:
            if resumed_after is None and accepted_spans(collector) > 0:
                resumed_after = time.monotonic() - restarted_at
            time.sleep(0.1)
        load.stopping = True
        load.thread.join(15)
        assert not load.thread.is_alive()

        # Every span either reached one of the two runs of the collector or is counted as dropped.
        made = load.made * SPANS_PER_REQUEST
        first = len(spans_in(tmp_path / "run-1.jsonl"))  # complete: that run has shut down
        deadline = time.monotonic() + 15
        while True:
            dropped = counter(httpx.get(url + "/metrics").text, "pdproxy_spans_dropped_total")
            accepted = accepted_spans(collector)
            if dropped + first + accepted >= made or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        collector.stop()  # flushes the file exporter
        second = len(spans_in(tmp_path / "run-2.jsonl"))
        resumed = f"{resumed_after:.1f} s" if resumed_after is not None else "never"

        lat = {k: sorted(v) for k, v in load.latencies.items()}
        base = statistics.median(baseline)
        with capsys.disabled():  # the outage figures are part of CI's output
            medians = ", ".join(f"{phase} {statistics.median(v) * 1000:.2f} ms" for phase, v in lat.items())
            slowest = ", ".join(f"{phase} {v[-1] * 1000:.1f} ms" for phase, v in lat.items())
            counts = ", ".join(f"{phase} {len(v)}" for phase, v in lat.items())
            print(f"\nmedian latency: no tracing {base * 1000:.2f} ms; collector {medians}; slowest request: {slowest}")
            print(f"requests: {counts}; spans made {made}: received by the first run {first}, by the second run "
                  f"{second}, counted as dropped {dropped:.0f}; export resumed {resumed} after the restart")
        assert load.failures == 0
        for phase, values in lat.items():
            assert len(values) >= 20, phase
            assert statistics.median(values) < base * 2 + 0.010, phase  # tracing costs little, the outage nothing
            assert values[-1] < 1.0, phase  # no request ever waits for the exporter
        assert first + second + dropped == made, "every span arrived or is counted as dropped"
        assert dropped >= len(lat["stopped"]) * SPANS_PER_REQUEST * 0.5, "the outage's spans are counted as dropped"
        # on its own, within the proxy's gRPC reconnect backoff (capped at 2 s, plus jitter) after the
        # collector is healthy again (about a second after start)
        assert resumed_after is not None and resumed_after < 5.0, "export resumes on its own"
        assert second >= len(lat["restarted"]) * SPANS_PER_REQUEST * 0.2
    finally:
        if proxy:
            proxy.stop()
        collector.stop()
        p.stop()
        d.stop()
