"""Telemetry: one recorder per process writing traces (OTLP, trace file) and Prometheus metrics."""

from __future__ import annotations

import os

from pdproxy.config import Settings
from pdproxy.telemetry.metrics import Metrics
from pdproxy.telemetry.recorder import Recorder, RequestTrace
from pdproxy.telemetry.tracefile import TraceFileExporter
from pdproxy.telemetry.tracing import Tracing, otlp_transport

__all__ = ["Metrics", "Recorder", "RequestTrace", "Tracing", "setup"]


def setup(settings: Settings) -> tuple[Recorder, Tracing | None]:
    metrics = Metrics(settings.run_label)
    tracing = None
    if settings.tracing and os.environ.get("OTEL_SDK_DISABLED", "").lower() != "true":
        sinks = []
        otlp = otlp_transport(settings.otlp_endpoint, settings.otlp_protocol)
        if otlp is not None:
            sinks.append(otlp)
        if settings.trace_file:
            sinks.append(TraceFileExporter(settings.trace_file))
        if sinks:
            # both reasons exist from the start: a healthy export shows 0 dropped, not "no data"
            for reason in ("queue_full", "export_failed"):
                metrics.spans_dropped.labels(reason)
            tracing = Tracing(resource_attributes(settings), sinks, settings.span_queue_size,
                              on_drop=lambda reason, count: metrics.spans_dropped.labels(reason).inc(count))
    recorder = Recorder(metrics, tracing, stall_threshold=settings.stall_threshold, run_label=settings.run_label,
                        capture_content=settings.capture_content)
    return recorder, tracing


def resource_attributes(settings: Settings) -> dict:
    """The evaluation plan's fixed conditions, on every span of this process."""
    attrs: dict = {"pd.prefill.count": len(settings.prefill_urls), "pd.decode.count": len(settings.decode_urls),
             "pd.mode": settings.mode}
    if settings.run_label:
        attrs["pd.run"] = settings.run_label
    if settings.model:
        attrs["vllm.model"] = settings.model
    attrs.update(settings.resource_attrs)
    return attrs
