"""OpenTelemetry set-up and the spans of one finished request.

Spans are written when the request ends, with explicit timestamps from the request's timeline:
nothing touches the SDK while tokens stream. The ids are chosen when the request arrives,
because the prefill and decode legs must carry their span's id in `traceparent` before those
spans exist; `PresetIds` hands those ids to the SDK when the spans are finally created.

Export is batched in a background thread with a bounded queue. Spans that do not fit, or that
the collector refuses, are dropped and counted: a slow or dead collector never slows serving.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdproxy import __version__

log = logging.getLogger("pdproxy.tracing")
_propagator = TraceContextTextMapPropagator()

DropCounter = Callable[[str, int], None]


@dataclass
class TraceIds:
    """Ids of one request's trace, fixed on arrival."""

    parent: Context
    trace_id: int
    root: int
    prefill: int
    decode: int
    sampled: bool
    tracestate: str | None

    def traceparent(self, span_id: int) -> str:
        return f"00-{self.trace_id:032x}-{span_id:016x}-{'01' if self.sampled else '00'}"


class PresetIds(IdGenerator):
    """Random ids, except the one the recorder sets just before it creates a span."""

    def __init__(self) -> None:
        self.next_trace_id: int | None = None
        self.next_span_id: int | None = None

    def generate_trace_id(self) -> int:
        value, self.next_trace_id = self.next_trace_id, None
        return value or random.getrandbits(128)

    def generate_span_id(self) -> int:
        value, self.next_span_id = self.next_span_id, None
        return value or random.getrandbits(64)


class Tracing:
    def __init__(self, resource_attrs: dict[str, str], exporters: list[SpanExporter], queue_size: int,
                 on_drop: DropCounter) -> None:
        self.ids = PresetIds()
        self.provider = TracerProvider(resource=_resource(resource_attrs), id_generator=self.ids)
        for exporter in exporters:
            self.provider.add_span_processor(BoundedProcessor(exporter, queue_size, on_drop))
        self.tracer = self.provider.get_tracer("pdproxy", __version__)
        self.sampler = self.provider.sampler

    def new_ids(self, headers: dict[str, str] | object) -> TraceIds:
        """Continue the client's W3C trace context if it sent one, else start a trace."""
        parent = _propagator.extract(headers)
        parent_span = trace_api.get_current_span(parent).get_span_context()
        trace_id = parent_span.trace_id if parent_span.is_valid else random.getrandbits(128)
        decision = self.sampler.should_sample(parent, trace_id, "request", SpanKind.SERVER)
        state = parent_span.trace_state.to_header() if parent_span.is_valid and parent_span.trace_state else None
        return TraceIds(parent, trace_id, random.getrandbits(64), random.getrandbits(64), random.getrandbits(64),
                        decision.decision.is_sampled(), state or None)

    def child_ids(self, primary: TraceIds) -> TraceIds:
        """Ids for a second request (the shadow) whose root is a child of `primary`'s root."""
        flags = trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED if primary.sampled else trace_api.TraceFlags.DEFAULT)
        parent_span = trace_api.NonRecordingSpan(trace_api.SpanContext(primary.trace_id, primary.root, False, flags))
        return TraceIds(trace_api.set_span_in_context(parent_span), primary.trace_id, random.getrandbits(64),
                        random.getrandbits(64), random.getrandbits(64), primary.sampled, primary.tracestate)

    def span(self, name: str, kind: SpanKind, parent: Context, *, trace_id: int | None, span_id: int | None,
             start_ns: int, attributes: dict) -> trace_api.Span:
        self.ids.next_trace_id, self.ids.next_span_id = trace_id, span_id
        return self.tracer.start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start_ns)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Flush what can be flushed within `timeout`; a dead collector must not hold up exit."""
        worker = threading.Thread(target=self.provider.shutdown, daemon=True)
        worker.start()
        worker.join(timeout)


def set_error(span: trace_api.Span, error_type: str, message: str) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message))


class BoundedProcessor(SpanProcessor):
    """A batch processor that refuses spans beyond its queue and counts every span it loses."""

    def __init__(self, exporter: SpanExporter, queue_size: int, on_drop: DropCounter) -> None:
        self.queue_size = queue_size
        self.on_drop = on_drop
        self.pending = 0  # handed to the batch processor, not yet given to the exporter
        self.lock = threading.Lock()  # `pending` moves on the serving thread and the export thread
        delay = float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", 1000))
        self.inner = BatchSpanProcessor(_CountingExporter(exporter, self), max_queue_size=queue_size,
                                        schedule_delay_millis=delay, max_export_batch_size=min(512, queue_size))

    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        with self.lock:
            full = self.pending >= self.queue_size
            if not full:
                self.pending += 1
        if full:
            self.on_drop("queue_full", 1)
        else:
            self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _CountingExporter(SpanExporter):
    def __init__(self, exporter: SpanExporter, owner: BoundedProcessor) -> None:
        self.exporter = exporter
        self.owner = owner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.owner.lock:
            self.owner.pending -= len(spans)
        try:
            result = self.exporter.export(spans)
        except Exception as exc:  # an exporter bug must not kill the export thread
            log.warning("span export raised %s", exc)
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self.owner.on_drop("export_failed", len(spans))
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


def otlp_exporter(endpoint: str | None, protocol: str | None) -> SpanExporter | None:
    """An OTLP exporter when an endpoint is configured by flag or by the standard OTEL_* variables."""
    env = os.environ
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    if not (endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    protocol = (protocol or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint) if endpoint else GrpcExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        if endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=endpoint) if endpoint else HttpExporter()
    raise ValueError(f"unsupported OTLP protocol {protocol!r} (use grpc or http/protobuf)")


def _resource(attrs: dict[str, str]) -> Resource:
    base = {"service.version": __version__, "service.instance.id": f"{socket.gethostname()}-{os.getpid()}"}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        base["service.name"] = "pdproxy"
    return Resource.create({**base, **attrs})
