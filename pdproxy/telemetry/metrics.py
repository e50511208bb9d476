"""Prometheus metrics: the second output of the one recorder (the first is the trace).

Observations carry the request's trace id as an exemplar; exemplars are only exposed in the
OpenMetrics format, which Prometheus asks for when exemplar storage is on.

Speed: the histograms are `LoopHistogram`s, plain counters written only from the event loop and
read at scrape time (also on the loop), so an observation is one `bisect` and two additions with
no lock, and a request's whole (sorted) list of token gaps goes in with one bisect per bucket. prometheus_client's own
Histogram takes a lock per observation and walks its buckets in Python: with a few hundred gaps
per request that was most of the cost of finishing a request. The series of one label set are
looked up once and cached.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from pdproxy import __version__
from pdproxy.telemetry.measure import Measurement
from pdproxy.telemetry.names import GAP_BUCKETS, LATENCY_BUCKETS
from pdproxy.telemetry.stalls import LIVE_CAUSES, Attributed

BASE_LABELS = ("route", "model", "mode", "deployment", "run")
STALL_LABELS = ("mode", "deployment", "run", "cause")  # cause: one of stalls.LIVE_CAUSES
# status codes with their own `code` label; any other is labelled by its class (`2xx`, `4xx`, `5xx`), so an
# instance (or whatever answers in its place) relaying odd statuses cannot widen the label
STATUS_CODES = frozenset({200, 400, 401, 403, 404, 405, 408, 413, 415, 422, 429, 431, 499, 500, 502, 503, 504})

# (role, instance address, requests in flight, healthy) for every instance
InstanceLoad = Callable[[], Iterable[tuple[str, str, int, bool]]]
# (role, instance address, failed reads of its /metrics) for every instance a load_aware pool reads
EngineReadFailures = Callable[[], Iterable[tuple[str, str, int]]]
# (requests inside the proxy, requests waiting for admission)
ProxyLoad = Callable[[], tuple[int, int]]


class Stamp:
    """An exemplar's trace id and unix time: one per request, shared by its observations; its labels
    are made when a scrape asks for them. A class, not a tuple: compiled, a fixed-shape tuple is unboxed
    when narrowed and boxed again (a new tuple, a new float) each time a bucket keeps it; an instance is
    kept by reference."""

    __slots__ = ("trace_id", "time")

    def __init__(self, trace_id: str, time: float) -> None:
        self.trace_id = trace_id
        self.time = time

    @property
    def labels(self) -> dict[str, str]:
        return {"trace_id": self.trace_id}


def stamp(trace_id: str | None) -> Stamp | None:
    return Stamp(trace_id, _time()) if trace_id else None


_time: Final = time.time  # Final: compiled, no attribute of the module looked up per request


class HistogramSeries:
    """One label set of a `LoopHistogram`: per-bucket counts (not cumulative), sum, one exemplar per bucket.

    An exemplar comes as a `Stamp` (its labels and time, made once per request) and is kept as its
    stamp and value, side by side in two lists (no tuple per observation): the `Exemplar` objects are
    built only when a scrape asks for them."""

    __slots__ = ("bounds", "counts", "sum", "stamps", "values")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.stamps: list[Stamp | None] = [None] * (len(bounds) + 1)  # each bucket's exemplar, if any
        self.values: list[float] = [0.0] * (len(bounds) + 1)  # and its observed value

    def observe(self, value: float, exemplar: Stamp | None = None) -> None:
        i = bisect_left(self.bounds, value)  # le: a value equal to a bound falls in that bound's bucket
        self.counts[i] += 1
        self.sum += value
        if exemplar is not None:
            self.stamps[i] = exemplar
            self.values[i] = value

    def observe_sorted(self, values: Sequence[float], exemplar: Stamp | None = None) -> None:
        """All of `values`, sorted ascending: one bisect per bucket bound, not one per value. The
        exemplar goes on the bucket of the largest value (the one worth opening), which the walk finds."""
        counts, total, below = self.counts, len(values), 0
        top = len(self.bounds)  # the largest value's bucket: +Inf, unless a bound holds them all
        for i, bound in enumerate(self.bounds):
            upto = bisect_right(values, bound, below)  # values <= bound
            counts[i] += upto - below
            below = upto
            if below == total:
                top = i
                break
        else:
            counts[-1] += total - below
        self.sum += sum(values)
        if exemplar is not None and total:
            self.stamps[top] = exemplar
            self.values[top] = values[-1]


class LoopHistogram:
    """A histogram family whose series are only touched from the event loop (see the module docstring)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self.les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self.series: dict[tuple[str, ...], HistogramSeries] = {}
        registry.register(self)

    def labels(self, *values: str) -> HistogramSeries:
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = HistogramSeries(self.bounds)
        return series

    def describe(self) -> list:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self.series.items()):
            if not any(series.counts):
                continue  # a label set is exposed once it has been observed, as with prometheus_client
            total, buckets = 0, list[tuple]()
            for le, count, kept, value in zip(self.les, series.counts, series.stamps, series.values):
                total += count
                if kept is None:
                    buckets.append((le, total))
                else:
                    buckets.append((le, total, Exemplar(kept.labels, value, kept.time)))
            family.add_metric(values, buckets, series.sum)
        yield family


class CounterSeries:
    """One label set of a `LoopCounter`: a plain number, and the latest exemplar as (labels, amount, time)."""

    __slots__ = ("value", "exemplar")

    def __init__(self) -> None:
        self.value = 0.0
        self.exemplar: tuple[dict[str, str], float, float] | None = None

    def inc(self, amount: float = 1.0, exemplar: dict[str, str] | None = None) -> None:
        self.value += amount
        if exemplar:
            self.exemplar = (exemplar, amount, time.time())


class LoopCounter:
    """A counter family whose series are only touched from the event loop: `inc` is one addition, where
    prometheus_client's Counter takes a lock (a request made five of those). Same exposition: a series
    appears once its labels are asked for, `_total` suffixed, exemplars built at scrape time."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.series: dict[tuple[str, ...], CounterSeries] = {}
        registry.register(self)

    def labels(self, *values: str) -> CounterSeries:
        series = self.series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            series = self.series[values] = CounterSeries()
        return series

    def describe(self) -> list:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self):
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self.series.items()):
            kept = series.exemplar
            family.add_metric(values, series.value, exemplar=Exemplar(*kept) if kept else None)
        yield family


class _Series:
    """The series of one base label set, looked up once."""

    def __init__(self, metrics: Metrics, labels: tuple[str, ...]) -> None:
        self.requests: dict[tuple[str, str], CounterSeries] = {}
        self.errors: dict[tuple[str, str], CounterSeries] = {}
        self.ttft = metrics.ttft.labels(*labels)
        self.itl_max = metrics.itl_max.labels(*labels)
        self.itl_p99 = metrics.itl_p99.labels(*labels)
        self.tpot = metrics.tpot.labels(*labels)
        self.e2e = metrics.e2e.labels(*labels)
        self.handoff = metrics.handoff.labels(*labels)
        self.stages = {stage: metrics.stage.labels(*labels, stage) for stage in ("queue", "prefill", "kv_transfer",
                                                                                  "decode")}
        self.itl = {"token": metrics.itl.labels(*labels), "chunk": metrics.chunk_gap.labels(*labels)}
        self._metrics, self._labels = metrics, labels
        self._stalled: CounterSeries | None = None
        self._input_tokens: CounterSeries | None = None
        self._output_tokens: CounterSeries | None = None

    # counters appear in the exposition when first touched, so these are created on first use
    @property
    def stalled(self) -> CounterSeries:
        if self._stalled is None:
            self._stalled = self._metrics.stalled.labels(*self._labels)
        return self._stalled

    @property
    def input_tokens(self) -> CounterSeries:
        if self._input_tokens is None:
            self._input_tokens = self._metrics.tokens.labels(*self._labels, "input")
        return self._input_tokens

    @property
    def output_tokens(self) -> CounterSeries:
        if self._output_tokens is None:
            self._output_tokens = self._metrics.tokens.labels(*self._labels, "output")
        return self._output_tokens


class Metrics:
    def __init__(self, run_label: str = "") -> None:
        disable_created_metrics()  # `_created` series double the exposition and no dashboard reads them
        self.run = run_label
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # the counters a request touches are the loop's own (LoopCounter); the others are prometheus_client's
        self.requests = LoopCounter("pdproxy_requests", "Requests, counted once when they end",
                                    BASE_LABELS + ("code", "failed_stage"), r)
        self.errors = LoopCounter("pdproxy_request_errors", "Failed requests by the stage that failed",
                                  BASE_LABELS + ("stage", "error_type"), r)
        self.ttft = LoopHistogram("pdproxy_ttft_seconds", "Time to first token: received to first token-bearing event",
                                  BASE_LABELS, LATENCY_BUCKETS, r)
        # two metrics, not one with a unit label: a plain histogram_quantile must not blend token and chunk gaps
        self.itl = LoopHistogram("pdproxy_itl_seconds", "Every token gap of every request whose stream gave "
                                 "per-chunk token counts (pooled ITL, per token)", BASE_LABELS, GAP_BUCKETS, r)
        self.chunk_gap = LoopHistogram("pdproxy_chunk_gap_seconds", "Every chunk gap of every request whose stream "
                                       "gave no per-chunk token counts (pooled, per chunk)", BASE_LABELS, GAP_BUCKETS,
                                       r)
        self.itl_max = LoopHistogram("pdproxy_request_itl_max_seconds", "Per-request largest token gap (tail ITL)",
                                     BASE_LABELS, GAP_BUCKETS, r)
        self.itl_p99 = LoopHistogram("pdproxy_request_itl_p99_seconds", "Per-request p99 of its own token gaps",
                                     BASE_LABELS, GAP_BUCKETS, r)
        self.tpot = LoopHistogram("pdproxy_tpot_seconds", "Per-request time per output token after the first",
                                  BASE_LABELS, GAP_BUCKETS, r)
        self.e2e = LoopHistogram("pdproxy_e2e_seconds", "Request received to end of response",
                                 BASE_LABELS, LATENCY_BUCKETS, r)
        self.stage = LoopHistogram("pdproxy_stage_duration_seconds", "Duration of each stage span",
                                   BASE_LABELS + ("stage",), LATENCY_BUCKETS, r)
        self.handoff = LoopHistogram("pdproxy_handoff_gap_seconds",
                                     "Proxy's own time from prefill response to decode send", BASE_LABELS,
                                     LATENCY_BUCKETS, r)
        self.stalled = LoopCounter("pdproxy_requests_with_stall",
                                   "Requests with at least one gap above the stall threshold", BASE_LABELS, r)
        self.stall_seconds = Counter("pdproxy_stall_seconds", "Stall time (gaps above the stall threshold) by cause, "
                                     "attributed live: see docs/reference/telemetry.md", STALL_LABELS, registry=r)
        self.stalls = Counter("pdproxy_stalls", "Stalls (gaps above the stall threshold) by cause, attributed live",
                              STALL_LABELS, registry=r)
        self.instance_stall_seconds = Counter("pdproxy_instance_stall_seconds",
                                              "Stall time by cause per instance that streamed (the decode in P/D)",
                                              ("server_address", "cause"), registry=r)
        self.instance_stalls = Counter("pdproxy_instance_stalls", "Stalls by cause per instance that streamed",
                                       ("server_address", "cause"), registry=r)
        self._stall_series: dict[tuple[str, ...], tuple[Any, ...]] = {}
        self.tokens = LoopCounter("pdproxy_tokens", "Tokens reported by the instances' usage", BASE_LABELS + ("type",),
                                  r)
        self.spans_dropped = Counter("pdproxy_spans_dropped", "Spans lost before reaching the collector", ("reason",),
                                     registry=r)
        self.route_decisions = LoopCounter("pdproxy_route_decisions", "Routing decisions by leg, policy and reason "
                                           "(reasons: docs/reference/telemetry.md)", ("role", "policy", "reason"), r)
        self._route_series: dict[tuple[str, str, str], CounterSeries] = {}
        self.route_fallbacks = Counter("pdproxy_route_fallbacks", "Event-based routing decisions that fell back to the "
                                       "approximate index, by leg, the instance whose state caused it (or the one "
                                       "chosen, when the request did) and why (docs/reference/telemetry.md)",
                                       ("role", "server_address", "reason"), registry=r)
        self.tokenize_failures = Counter("pdproxy_tokenize_failures", "Calls to an instance's /tokenize for routing "
                                         "that gave no usable token ids, by instance and why (timeout, http_status, "
                                         "bad_answer, connection)", ("server_address", "reason"), registry=r)
        self.disaggregations = Counter("pdproxy_disaggregation_decisions", "Selective disaggregation: requests "
                                       "sent through a prefill (disaggregated) or straight to their decode "
                                       "(decode_only), and why", ("decision", "reason"), registry=r)
        self.shadow = Counter("pdproxy_shadow_requests", "Shadow mirroring outcomes", ("outcome",), registry=r)
        self.migrations = Counter("pdproxy_migrations", "Decode attempts that replaced a failed one, by when the "
                                  "failure came (before_first_token, mid_stream) and its error type",
                                  ("stage", "reason"), registry=r)
        self.abandoned_handoffs = Counter("pdproxy_abandoned_handoffs", "KV hand-offs given up after a decode failed, "
                                          "by the prefill instance whose blocks stay held until its "
                                          "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", ("server_address",), registry=r)
        self.tracestate_cut = Counter("pdproxy_tracestate_cut", "Client tracestate headers not carried on whole: "
                                      "too_long (cut to 512 characters), invalid (discarded)", ("reason",), registry=r)
        self.untraced_refusals = Counter("pdproxy_untraced_refusals",
                                         "Requests refused before admission whose trace was not recorded "
                                         "(--trace-rejected-rate reached); completions are also in "
                                         "pdproxy_requests_total, /tokenize and /detokenize calls only here",
                                         registry=r)
        self.invalid_traceparent = Counter("pdproxy_invalid_traceparent", "Requests whose malformed traceparent "
                                           "was ignored (each started a new trace)", registry=r)
        self.attempts = InstanceAttempts()
        r.register(self.attempts)
        Gauge("pdproxy_build_info", "pdproxy version", ("version",), registry=r).labels(__version__).set(1)
        self.process = WorkerProcessCollector()
        r.register(self.process)
        self._series: dict[tuple[str, ...], _Series] = {}

    def route_decision(self, role: str, policy: str, reason: str) -> None:
        key = (role, policy, reason)  # each policy has a fixed set of reasons: a bounded label set
        series = self._route_series.get(key)
        if series is None:
            series = self._route_series[key] = self.route_decisions.labels(*key)
        series.inc()

    def disaggregation(self, decision: str, reason: str) -> None:
        self.disaggregations.labels(decision, reason).inc()  # both from fixed sets (routing.selective)

    def route_fallback(self, role: str, address: str, reason: str) -> None:
        self.route_fallbacks.labels(role, address, reason).inc()  # configured instances, routing.FALLBACK_REASONS

    def tokenize_failure(self, address: str, reason: str) -> None:
        self.tokenize_failures.labels(address, reason).inc()  # configured instances, routing.tokens.FAILURE_REASONS

    def watch_engine_reads(self, failures: EngineReadFailures) -> None:
        """load_aware's failed reads of the instances' /metrics, counted at scrape time."""
        self.registry.register(_EngineReadCollector(failures))

    def watch(self, instances: InstanceLoad, proxy: ProxyLoad) -> None:
        """Gauges read at scrape time, so serving never updates them; the instances listed now are the
        ones the per-instance attempt counters may name."""
        self.registry.register(_LoadCollector(instances, proxy))
        self.attempts.configure((role, address) for role, address, _, _ in instances())

    def record(self, m: Measurement, route: str, model: str, mode: str, deployment: str, trace_id: str | None) -> None:
        labels = (route, model, mode, deployment, self.run)
        s = self._series.get(labels)
        if s is None:
            s = self._series[labels] = _Series(self, labels)
        ex = stamp(trace_id)
        key = (status_label(m.status), m.failed_stage or "none")
        counter = s.requests.get(key)
        if counter is None:
            counter = s.requests[key] = self.requests.labels(*labels, *key)
        counter.inc()
        if not m.ok:
            key = (m.failed_stage or "none", m.error_type or "unknown")
            counter = s.errors.get(key)
            if counter is None:
                counter = s.errors[key] = self.errors.labels(*labels, *key)
            counter.inc(exemplar=ex.labels if ex is not None else None)
        for stage, seconds in m.stages.items():
            s.stages[stage].observe(seconds, ex)
        s.e2e.observe(m.e2e, ex)
        if m.ttft is not None:
            s.ttft.observe(m.ttft, ex)
        if m.handoff_gap is not None:
            s.handoff.observe(m.handoff_gap, ex)
        if m.gaps and m.itl_max is not None and m.itl_p99 is not None:  # measure() sets all three together
            # the worst gap carries the exemplar: that is the trace worth opening
            s.itl[m.itl_unit].observe_sorted(m.gaps, ex)  # measure() keeps the gaps sorted: the largest is itl_max
            s.itl_max.observe(m.itl_max, ex)
            s.itl_p99.observe(m.itl_p99, ex)
            if m.stalls:
                s.stalled.inc()
        if m.tpot is not None:
            s.tpot.observe(m.tpot, ex)
        if m.input_tokens:
            s.input_tokens.inc(m.input_tokens)
        if m.output_tokens:
            s.output_tokens.inc(m.output_tokens)

    def migrated(self, migrations: list[tuple[str, str]], abandoned: list[str]) -> None:
        """One request's migrations (stage and reason are bounded: fixed stages, the proxy's error types)
        and the prefill instances it left holding KV blocks."""
        for stage, reason in migrations:
            self.migrations.labels(stage, reason).inc()
        for instance in abandoned:
            self.abandoned_handoffs.labels(instance).inc()

    def record_stalls(self, stalls: list[Attributed], mode: str, deployment: str, instance: str | None,
                      trace_id: str | None) -> None:
        """A request's attributed stalls, by cause (one increment per cause and request); the stall-seconds
        exemplar is the stalled request's trace (the victim's)."""
        by_cause: dict[str, list[float]] = {}
        for s in stalls:
            cause = s.cause if s.cause in LIVE_CAUSES else "none"
            seconds_count = by_cause.setdefault(cause, [0.0, 0])
            seconds_count[0] += s.duration
            seconds_count[1] += 1
        ex = {"trace_id": trace_id} if trace_id else None
        where = instance or "unknown"
        for cause, (seconds, count) in by_cause.items():
            key = (mode, deployment, where, cause)
            series = self._stall_series.get(key)
            if series is None:
                series = self._stall_series[key] = (
                    self.stall_seconds.labels(mode, deployment, self.run, cause),
                    self.stalls.labels(mode, deployment, self.run, cause),
                    self.instance_stall_seconds.labels(where, cause), self.instance_stalls.labels(where, cause))
            series[0].inc(seconds, exemplar=ex)
            series[1].inc(count)
            series[2].inc(seconds)
            series[3].inc(count)

    def forget_instance(self, address: str) -> None:
        """An instance left the pools (pdproxy/membership) a while ago: its series go, so instances coming and
        going do not grow the label sets."""
        for counter in (self.instance_stall_seconds, self.instance_stalls, self.route_fallbacks,
                        self.tokenize_failures, self.abandoned_handoffs):
            found = {tuple(sample.labels.values()) for metric in counter.collect()  # in the label names' order
                     for sample in metric.samples if sample.labels.get("server_address") == address}
            for labels in found:
                counter.remove(*labels)
        for key in [k for k in self._stall_series if k[2] == address]:
            del self._stall_series[key]
        self.attempts.forget(address)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        if "application/openmetrics-text" in accept:
            return generate_openmetrics(self.registry), OPENMETRICS_TYPE
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def status_label(status: int) -> str:
    if status in STATUS_CODES:
        return str(status)
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


# merging the expositions of several worker processes (pdproxy/workers.py)
_MIN_GAUGES = {"pdproxy_instance_healthy",  # healthy only where every worker has the instance in rotation
               "pdproxy_kv_events_flowing"}  # in sync only where every worker is (pdproxy/kvevents)
_MAX_GAUGES = {"pdproxy_build_info", "pdproxy_kv_event_index_blocks"}  # every worker indexes the same blocks


def merge_expositions(texts: list[str], accept: str) -> tuple[bytes, str]:
    """One exposition from several workers' OpenMetrics texts: samples with the same name and labels are
    summed (minimum or maximum for the gauges above); the newest exemplar of a sample is kept."""
    families: dict[str, tuple[Metric, dict]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged, samples = families.setdefault(
                family.name, (Metric(family.name, family.documentation, family.type, family.unit), {}))
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = samples.get(key)
                if old is None:
                    samples[key] = sample
                    continue
                if family.name in _MIN_GAUGES:
                    value = min(old.value, sample.value)
                elif family.name in _MAX_GAUGES:
                    value = max(old.value, sample.value)
                else:
                    value = old.value + sample.value
                exemplar = old.exemplar
                if sample.exemplar is not None and (exemplar is None or (sample.exemplar.timestamp or 0)
                                                    > (exemplar.timestamp or 0)):
                    exemplar = sample.exemplar
                samples[key] = sample._replace(value=value, exemplar=exemplar)
    workers = Metric("pdproxy_workers", "Worker processes whose metrics this exposition merges", "gauge")
    workers.add_sample("pdproxy_workers", {}, len(texts))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*(_with(m, s) for m, s in families.values()), workers]))
    if "application/openmetrics-text" in accept:
        return generate_openmetrics(registry), OPENMETRICS_TYPE
    return generate_latest(registry), CONTENT_TYPE_LATEST


def _with(family: Metric, samples: dict) -> Metric:
    family.samples = list(samples.values())
    return family


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


class WorkerProcessCollector:
    """prometheus_client's process_* metrics (memory, CPU, open files, start time) of this process. With
    `--workers` every worker's carry `worker="<index>"`, so the merged exposition keeps one series per
    process (summing start times or resident sizes across workers would mean nothing)."""

    def __init__(self) -> None:
        self.process = ProcessCollector(registry=None)
        self.worker: str | None = None

    def describe(self) -> list:
        return []

    def collect(self):
        for family in self.process.collect():
            if self.worker is not None:
                family.samples = [s._replace(labels={**s.labels, "worker": self.worker}) for s in family.samples]
            yield family


class _LoadCollector:
    def __init__(self, instances: InstanceLoad, proxy: ProxyLoad) -> None:
        self.instances = instances
        self.proxy = proxy

    def describe(self) -> list:
        return []

    def collect(self):
        inflight = GaugeMetricFamily("pdproxy_instance_inflight", "Requests in flight per instance and leg",
                                     labels=["role", "server_address"])
        healthy = GaugeMetricFamily("pdproxy_instance_healthy", "1 when the instance is in rotation, 0 when ejected",
                                    labels=["role", "server_address"])
        for role, address, count, ok in self.instances():
            inflight.add_metric([role, address], count)
            healthy.add_metric([role, address], 1 if ok else 0)
        inside, waiting = self.proxy()
        yield inflight
        yield healthy
        yield GaugeMetricFamily("pdproxy_inflight_requests", "Requests inside the proxy", value=inside)
        yield GaugeMetricFamily("pdproxy_queue_depth", "Requests waiting for admission", value=waiting)


class InstanceAttempts:
    """Attempts per instance, counted where they were sent: a decode that dies while migration saves its
    requests finishes none of them, and shows only here. Plain counters written from the event loop,
    exposed at scrape time; every configured instance has its series from the start (at 0), and an
    address that is not one of them (none is, today) is counted as `other`, so the label values are
    bounded by the configuration. `reason` is the proxy's error type (a fixed set), `stage` one of the
    two migration stages (a prefill retried elsewhere moves `before_first_token`). Attempts, moves and
    abandoned hand-offs start at 0 for every configured instance; failures appear with their reason."""

    OTHER = "other"
    ROLES = ("prefill", "decode")
    STAGES = ("before_first_token", "mid_stream")

    def __init__(self) -> None:
        self.known: set[tuple[str, str]] = set()
        self.sent: dict[tuple[str, str], int] = {}
        self.failed: dict[tuple[str, str, str], int] = {}
        self.moved: dict[tuple[str, str, str], int] = {}
        self.abandoned: dict[tuple[str, str], int] = {}

    def configure(self, instances: Iterable[tuple[str, str]]) -> None:
        for key in instances:
            if key[0] in self.ROLES:
                self.known.add(key)
                self.sent.setdefault(key, 0)
                for stage in self.STAGES:
                    self.moved.setdefault((*key, stage), 0)
                if key[0] == "decode":  # only a decode's failure gives a hand-off up
                    self.abandoned.setdefault(key, 0)

    def forget(self, address: str) -> None:
        """Every series of `address` (both roles) goes; its attempts count as `other` from now on."""
        self.known = {k for k in self.known if k[1] != address}
        self.sent = {k: v for k, v in self.sent.items() if k[1] != address}
        self.abandoned = {k: v for k, v in self.abandoned.items() if k[1] != address}
        self.failed = {k: v for k, v in self.failed.items() if k[1] != address}
        self.moved = {k: v for k, v in self.moved.items() if k[1] != address}

    def _key(self, role: str, address: str) -> tuple[str, str]:
        return (role, address) if (role, address) in self.known else (role, self.OTHER)

    def attempt(self, role: str, address: str) -> None:
        key = self._key(role, address)
        self.sent[key] = self.sent.get(key, 0) + 1

    def attempt_failed(self, role: str, address: str, reason: str, abandoned: bool) -> None:
        key = self._key(role, address)
        self.failed[(*key, reason)] = self.failed.get((*key, reason), 0) + 1
        if abandoned:
            self.handoff_abandoned(role, address)

    def handoff_abandoned(self, role: str, address: str) -> None:
        key = self._key(role, address)
        self.abandoned[key] = self.abandoned.get(key, 0) + 1

    def moved_away(self, role: str, address: str, stage: str) -> None:
        key = (*self._key(role, address), stage)
        self.moved[key] = self.moved.get(key, 0) + 1

    def describe(self) -> list:
        return []

    def collect(self):
        labels = ["role", "server_address"]
        families = (
            (CounterMetricFamily("pdproxy_instance_attempts", "Attempts sent to each instance (a retried or "
                                 "migrated request counts once per attempt)", labels=labels), self.sent),
            (CounterMetricFamily("pdproxy_instance_attempt_failures", "Failed attempts per instance by the "
                                 "proxy's error type", labels=[*labels, "reason"]), self.failed),
            (CounterMetricFamily("pdproxy_instance_moved_away", "Requests moved to another instance after an "
                                 "attempt on this one failed, by migration stage", labels=[*labels, "stage"]),
             self.moved),
            (CounterMetricFamily("pdproxy_instance_abandoned_handoffs", "Failed attempts on a decode that gave "
                                 "up the request's KV hand-off", labels=labels), self.abandoned),
        )
        for family, counts in families:
            for key, value in list(counts.items()):
                family.add_metric(list(key), value)
            yield family


class _EngineReadCollector:
    def __init__(self, failures: EngineReadFailures) -> None:
        self.failures = failures

    def describe(self) -> list:
        return []

    def collect(self):
        family = CounterMetricFamily("pdproxy_engine_metrics_read_failures", "Failed reads of an instance's "
                                     "/metrics by load_aware routing (it then routes by in-flight counts)",
                                     labels=["role", "server_address"])
        for role, address, count in self.failures():
            family.add_metric([role, address], count)
        yield family
