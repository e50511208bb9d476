"""Telemetry: one recorder per process writing traces (OTLP, trace file) and Prometheus metrics."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdproxy.config import Settings, redact_url
from pdproxy.telemetry.metrics import Metrics
from pdproxy.telemetry.models import ModelNames
from pdproxy.telemetry.recorder import Recorder, RequestTrace
from pdproxy.telemetry.stalls import StallRecords
from pdproxy.telemetry.export import Exporter, ThreadedSink, otlp_exporter
from pdproxy.telemetry.otlp import otlp_target
from pdproxy.telemetry.tracefile import TraceFileExporter, check_writable
from pdproxy.telemetry.tracing import Tracing

__all__ = ["Metrics", "ModelNames", "Recorder", "RequestTrace", "TraceDestination", "Tracing", "check_trace_file",
           "setup", "status", "trace_destination"]

TURN_ON = "to record traces, give --otlp-endpoint URL (or set OTEL_EXPORTER_OTLP_ENDPOINT) and/or --trace-file FILE"


@dataclass(frozen=True)
class TraceDestination:
    """Where this process's spans go; the start-up log and `/status` say it, so tracing is never silently off."""

    otlp_protocol: str | None = None
    otlp_endpoint: str | None = None
    trace_file: str | None = None
    sampler: str | None = None  # OTEL_TRACES_SAMPLER, when set
    off_reason: str | None = None  # why no span is recorded; None when tracing is on

    @property
    def enabled(self) -> bool:
        return self.off_reason is None

    def summary(self) -> str:
        if not self.enabled:
            hint = "drop --no-tracing" if self.off_reason == "--no-tracing" else TURN_ON
            return f"traces: off ({self.off_reason}); {hint}"
        where = []
        if self.otlp_endpoint:
            where.append(f"OTLP {self.otlp_protocol} to {self.otlp_endpoint}")
        if self.trace_file:
            where.append(f"file {self.trace_file}")
        return "traces: " + " and ".join(where) + (f" (sampler {self.sampler})" if self.sampler else "")

    def as_dict(self) -> dict:
        d = {"enabled": self.enabled, "otlp_protocol": self.otlp_protocol, "otlp_endpoint": self.otlp_endpoint,
             "trace_file": self.trace_file, "sampler": self.sampler, "summary": self.summary()}
        if not self.enabled:
            d["off_reason"] = self.off_reason
        return d


def trace_destination(settings: Settings) -> TraceDestination:
    """Where spans go, from the flags and the standard OTEL_* variables (raises ValueError on an unknown protocol)."""
    env = os.environ
    if not settings.tracing:
        return TraceDestination(off_reason="--no-tracing")
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TraceDestination(off_reason="OTEL_SDK_DISABLED=true")
    target = otlp_target(settings.otlp_endpoint, settings.otlp_protocol)
    if target is None and not settings.trace_file:
        exporter_off = env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none"
        return TraceDestination(off_reason=("OTEL_TRACES_EXPORTER=none" if exporter_off else "no OTLP endpoint")
                                + " and no trace file")
    protocol, endpoint = target if target else (None, None)
    sampler = env.get("OTEL_TRACES_SAMPLER")
    if sampler and env.get("OTEL_TRACES_SAMPLER_ARG"):
        sampler += f" {env['OTEL_TRACES_SAMPLER_ARG']}"
    shown = redact_url(endpoint) if endpoint else None  # the log and /status never show its credentials
    return TraceDestination(protocol, shown, settings.trace_file, sampler or None)


def check_trace_file(settings: Settings) -> str | None:
    """Start-up's look at --trace-file: ValueError when it cannot be written at all; a warning (or None)
    when its disk has less room than it may take."""
    if not settings.tracing or not settings.trace_file:
        return None
    return check_writable(settings.trace_file, settings.trace_file_max_bytes, settings.trace_file_backups)


def setup(settings: Settings) -> tuple[Recorder, Tracing | None]:
    """The recorder and the span export; called on the serving loop, where the OTLP endpoint's
    start-up probe runs in the background."""
    metrics = Metrics(settings.run_label)
    tracing = None
    destination = trace_destination(settings)
    if destination.enabled:
        exporters: list[Exporter] = []
        # None: no endpoint (the file only)
        otlp = otlp_exporter(settings.otlp_endpoint, settings.otlp_protocol, destination.otlp_endpoint or "")
        if otlp is not None:
            exporters.append(otlp)
        if settings.trace_file:
            exporters.append(Exporter(ThreadedSink(TraceFileExporter(settings.trace_file, settings.trace_file_max_bytes,
                                                                     settings.trace_file_backups)),
                                      "file", settings.trace_file))
        # both reasons exist from the start: a healthy export shows 0 dropped, not "no data"
        for reason in ("queue_full", "export_failed"):
            metrics.spans_dropped.labels(reason)
        tracing = Tracing(resource_attributes(settings), exporters, settings.span_queue_size,
                          on_drop=lambda reason, count: metrics.spans_dropped.labels(reason).inc(count))
        tracing.start()
    models = ModelNames([*settings.served_model_name, *([settings.model] if settings.model else [])])
    recorder = Recorder(metrics, tracing, stall_threshold=settings.stall_threshold, run_label=settings.run_label,
                        capture_content=settings.capture_content, models=models,
                        rejected_trace_rate=settings.trace_rejected_rate,
                        stalls=StallRecords() if settings.stall_attribution else None)
    return recorder, tracing


def status(recorder: Recorder) -> dict | None:
    """`telemetry` in /status: each span destination's state (last success, last error, spans sent and
    dropped) and the export queue, of the process that answers; None with tracing off."""
    return recorder.tracing.status() if recorder.tracing is not None else None


def resource_attributes(settings: Settings) -> dict:
    """The evaluation plan's fixed conditions, on every span of this process."""
    attrs: dict = {"pd.prefill.count": len(settings.prefill_urls), "pd.decode.count": len(settings.decode_urls),
             "pd.mode": settings.mode}
    if settings.run_label:
        attrs["pd.run"] = settings.run_label
    if settings.model:
        attrs["vllm.model"] = settings.model
    if settings.gpu_count:
        attrs["gpu.count"] = settings.gpu_count
    attrs.update(settings.resource_attrs)
    return attrs
