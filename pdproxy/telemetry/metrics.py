"""Prometheus metrics: the second output of the one recorder (the first is the trace).

Observations carry the request's trace id as an exemplar; exemplars are only exposed in the
OpenMetrics format, which Prometheus asks for when exemplar storage is on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from pdproxy import __version__
from pdproxy.telemetry.measure import Measurement
from pdproxy.telemetry.names import GAP_BUCKETS, LATENCY_BUCKETS

BASE_LABELS = ("route", "model", "mode", "deployment", "run")

# (role, instance address, requests in flight, healthy) for every instance
InstanceLoad = Callable[[], Iterable[tuple[str, str, int, bool]]]
# (requests inside the proxy, requests waiting for admission)
ProxyLoad = Callable[[], tuple[int, int]]


class Metrics:
    def __init__(self, run_label: str = "") -> None:
        disable_created_metrics()  # `_created` series double the exposition and no dashboard reads them
        self.run = run_label
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("pdproxy_requests", "Requests, counted once when they end",
                                BASE_LABELS + ("code", "failed_stage"), registry=r)
        self.errors = Counter("pdproxy_request_errors", "Failed requests by the stage that failed",
                              BASE_LABELS + ("stage", "error_type"), registry=r)
        self.ttft = Histogram("pdproxy_ttft_seconds", "Time to first token: received to first token-bearing event",
                              BASE_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdproxy_itl_seconds", "Every token gap of every request (pooled ITL)",
                             BASE_LABELS + ("unit",), buckets=GAP_BUCKETS, registry=r)
        self.itl_max = Histogram("pdproxy_request_itl_max_seconds", "Per-request largest token gap (tail ITL)",
                                 BASE_LABELS, buckets=GAP_BUCKETS, registry=r)
        self.itl_p99 = Histogram("pdproxy_request_itl_p99_seconds", "Per-request p99 of its own token gaps",
                                 BASE_LABELS, buckets=GAP_BUCKETS, registry=r)
        self.tpot = Histogram("pdproxy_tpot_seconds", "Per-request time per output token after the first",
                              BASE_LABELS, buckets=GAP_BUCKETS, registry=r)
        self.e2e = Histogram("pdproxy_e2e_seconds", "Request received to end of response",
                             BASE_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.stage = Histogram("pdproxy_stage_duration_seconds", "Duration of each stage span",
                               BASE_LABELS + ("stage",), buckets=LATENCY_BUCKETS, registry=r)
        self.handoff = Histogram("pdproxy_handoff_gap_seconds", "Proxy's own time from prefill response to decode send",
                                 BASE_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.stalled = Counter("pdproxy_requests_with_stall", "Requests with at least one gap above the stall threshold",
                               BASE_LABELS, registry=r)
        self.tokens = Counter("pdproxy_tokens", "Tokens reported by the instances' usage", BASE_LABELS + ("type",),
                              registry=r)
        self.spans_dropped = Counter("pdproxy_spans_dropped", "Spans lost before reaching the collector", ("reason",),
                                     registry=r)
        self.shadow = Counter("pdproxy_shadow_requests", "Shadow mirroring outcomes", ("outcome",), registry=r)
        Gauge("pdproxy_build_info", "pdproxy version", ("version",), registry=r).labels(__version__).set(1)

    def watch(self, instances: InstanceLoad, proxy: ProxyLoad) -> None:
        """Gauges read at scrape time, so serving never updates them."""
        self.registry.register(_LoadCollector(instances, proxy))

    def record(self, m: Measurement, route: str, model: str, mode: str, deployment: str, trace_id: str | None) -> None:
        labels = (route, model, mode, deployment, self.run)
        ex = {"trace_id": trace_id} if trace_id else None
        self.requests.labels(*labels, str(m.status), m.failed_stage or "none").inc()
        if not m.ok:
            self.errors.labels(*labels, m.failed_stage or "none", m.error_type or "unknown").inc(exemplar=ex)
        for stage, seconds in m.stages.items():
            self.stage.labels(*labels, stage).observe(seconds, ex)
        self.e2e.labels(*labels).observe(m.e2e, ex)
        if m.ttft is not None:
            self.ttft.labels(*labels).observe(m.ttft, ex)
        if m.handoff_gap is not None:
            self.handoff.labels(*labels).observe(m.handoff_gap, ex)
        if m.gaps:
            itl = self.itl.labels(*labels, m.itl_unit)
            for gap in m.gaps:  # the worst gap carries the exemplar: that is the trace worth opening
                itl.observe(gap, ex if gap == m.itl_max else None)
            self.itl_max.labels(*labels).observe(m.itl_max, ex)
            self.itl_p99.labels(*labels).observe(m.itl_p99, ex)
            if m.stalls:
                self.stalled.labels(*labels).inc()
        if m.tpot is not None:
            self.tpot.labels(*labels).observe(m.tpot, ex)
        if m.input_tokens:
            self.tokens.labels(*labels, "input").inc(m.input_tokens)
        if m.output_tokens:
            self.tokens.labels(*labels, "output").inc(m.output_tokens)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        if "application/openmetrics-text" in accept:
            return generate_openmetrics(self.registry), OPENMETRICS_TYPE
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _LoadCollector:
    def __init__(self, instances: InstanceLoad, proxy: ProxyLoad) -> None:
        self.instances = instances
        self.proxy = proxy

    def describe(self) -> list:
        return []

    def collect(self):
        inflight = GaugeMetricFamily("pdproxy_instance_inflight", "Requests in flight per instance and leg",
                                     labels=["role", "instance"])
        healthy = GaugeMetricFamily("pdproxy_instance_healthy", "1 when the instance is in rotation, 0 when ejected",
                                    labels=["role", "instance"])
        for role, address, count, ok in self.instances():
            inflight.add_metric([role, address], count)
            healthy.add_metric([role, address], 1 if ok else 0)
        inside, waiting = self.proxy()
        yield inflight
        yield healthy
        yield GaugeMetricFamily("pdproxy_inflight_requests", "Requests inside the proxy", value=inside)
        yield GaugeMetricFamily("pdproxy_queue_depth", "Requests waiting for admission", value=waiting)
