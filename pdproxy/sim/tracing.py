"""vLLM's per-request span, as vLLM 0.23 exports it with `--otlp-traces-endpoint`.

One `llm_request` span (kind SERVER) per finished request, created when it finishes and back-dated
to its arrival at the API server, a child of the caller's `traceparent` (vLLM:
vllm/v1/engine/output_processor.py `do_tracing`, vllm/tracing/otel.py). Its `gen_ai.latency.*`
attributes keep vLLM's meanings:

* time_in_queue = scheduled − queued (queued: handed to the engine, after the API server). A P/D
  decode is scheduled only once the remote KV has been pulled, so its queue time holds the pull.
* time_in_model_prefill = first token − scheduled; _decode = last − first token;
  _inference = last token − scheduled; time_to_first_token = first token − arrival;
  e2e = finish − arrival.

Like vLLM, the OpenTelemetry SDK builds the span and the resource (`vllm.instrumenting_module_name`,
`vllm.process_id`, the SDK's own keys, `service.name` from OTEL_SERVICE_NAME: unlike vLLM, whose
spans are then `unknown_service:python`, the simulator names itself `vllm-<role>-<port>` without it,
so its spans say which instance made them and the collector finds decodes by "decode"), a batch processor
exports it; the OTLP bytes are encoded by the OpenTelemetry exporter's common encoder and sent over
OTLP/gRPC (vLLM's default) or OTLP/HTTP (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), or
appended to an OTLP-JSON lines file (a sim-only option, for runs without a collector).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence as Seq
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SPAN_NAME = "llm_request"
SCOPE = "vllm"
MODULE_NAME = "vllm.llm_engine"  # vLLM's instrumenting module name for the request spans


class _Exporter(SpanExporter):
    """SDK spans → ExportTraceServiceRequest bytes → pdproxy's public OTLP transports / trace file."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def export(self, spans: Seq[ReadableSpan]) -> SpanExportResult:
        ok = self.sink.send(encode_spans(spans).SerializeToString())
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.sink.close()


def service_name_set() -> bool:
    """Whether the environment names the service (OTEL_SERVICE_NAME, or service.name in OTEL_RESOURCE_ATTRIBUTES)."""
    return bool(os.environ.get("OTEL_SERVICE_NAME", "").strip()) or any(
        item.split("=", 1)[0].strip() == "service.name" for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","))


def check_protocol() -> None:
    """Refuse an OTLP protocol the exporter does not speak before the server starts (as vLLM does)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: use grpc or http/protobuf")


def _sink(endpoint: str | None, trace_file: str | None) -> Any:
    if trace_file:
        from pdproxy.telemetry.tracefile import TraceFileExporter

        return TraceFileExporter(trace_file)
    from pdproxy.telemetry.otlp import otlp_transport

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")  # vLLM's default, like vLLM reads it
    return otlp_transport(endpoint, protocol)


class RequestTracer:
    """Emits one `llm_request` span per finished request."""

    def __init__(self, endpoint: str | None, trace_file: str | None = None, preset: str | None = None,
                 default_service: str | None = None, time_scale: float = 1.0) -> None:
        attrs = {"vllm.instrumenting_module_name": MODULE_NAME, "vllm.process_id": str(os.getpid())}
        if default_service and not service_name_set():
            attrs["service.name"] = default_service
        resource = Resource.create(attrs)
        self.provider = TracerProvider(resource=resource)
        sink = _sink(endpoint, trace_file)
        if sink is None:
            raise ValueError("--otlp-traces-endpoint: no endpoint")
        self.provider.add_span_processor(BatchSpanProcessor(_Exporter(sink)))
        self.tracer = self.provider.get_tracer(SCOPE)
        self.propagator = TraceContextTextMapPropagator()
        # the engine's clock is time.perf_counter(); spans want wall time
        self.offset = time.time() - time.perf_counter()
        self.preset = preset  # not vLLM's: says which timing preset served, so `pdproxy whatif` replays with it
        self.time_scale = time_scale  # ... and how much slower than the preset it ran (--time-scale)

    def finished(self, headers: Mapping[str, str], seq: Any, request_id: str, submitted: float,
                 params: dict[str, Any]) -> None:
        """Record a finished sequence (engine timestamps in monotonic seconds), as vLLM's do_tracing does."""
        if seq.first_token_at is None or seq.scheduled_at is None or seq.finished_at is None:
            return
        last = seq.last_token_at if seq.last_token_at is not None else seq.first_token_at
        attrs: dict[str, Any] = {
            "gen_ai.latency.time_to_first_token": seq.first_token_at - seq.arrival,
            "gen_ai.latency.e2e": seq.finished_at - seq.arrival,
            "gen_ai.latency.time_in_queue": seq.scheduled_at - submitted,
            "gen_ai.usage.prompt_tokens": seq.prompt_tokens,
            "gen_ai.usage.completion_tokens": seq.num_generated,
            "gen_ai.latency.time_in_model_prefill": seq.first_token_at - seq.scheduled_at,
            # vLLM's timestamps are 0 until set: a one-token request has an integer 0 decode time
            "gen_ai.latency.time_in_model_decode": (last - seq.first_token_at) or 0,
            "gen_ai.latency.time_in_model_inference": last - seq.scheduled_at,
            "gen_ai.request.id": request_id,
        }
        if self.preset:
            attrs["pdproxy.sim.preset"] = self.preset
            attrs["pdproxy.sim.time_scale"] = self.time_scale
        for key, attr in (("top_p", "gen_ai.request.top_p"), ("max_tokens", "gen_ai.request.max_tokens"),
                          ("temperature", "gen_ai.request.temperature"), ("n", "gen_ai.request.n")):
            if params.get(key):  # vLLM sets each only when truthy
                attrs[attr] = params[key]
        carrier = {k.lower(): v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
        context = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(SPAN_NAME, context=context, kind=SpanKind.SERVER,
                                      start_time=int((seq.arrival + self.offset) * 1e9))
        span.set_attributes(attrs)
        span.end(end_time=int((seq.finished_at + self.offset) * 1e9))

    def close(self) -> None:
        self.provider.shutdown()
