"""The hand-written OTLP span encoding must decode to what the OpenTelemetry SDK's own encoder sends."""

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from pdproxy.telemetry.otlp import (KIND_CLIENT, KIND_SERVER, SpanData, attribute_fields, encode_span, export_framed,
                                    four_doubles, frame_prefix, words_attribute)

TRACE, ROOT, CHILD, CLIENT_SPAN = 0x0AF7651916CD43DD8448EB211C80319C, 0x1111, 0x2222, 0xB7AD6B7169203331
ATTRS = {"gen_ai.operation.name": "chat", "gen_ai.request.stream": True, "gen_ai.usage.output_tokens": 300,
         "pd.itl.p99": 0.0123, "gen_ai.response.finish_reasons": ["length", "stop"], "server.port": 8100,
         "negative": -7, "unicode": "é中", "pd.request_id": "r" * 200, "pd.chunks": 0, "big": 2**40}
RESOURCE = {"service.name": "pdproxy", "pd.run": "r1", "pd.prefill.count": 2}


def sdk_span(name, kind, span_id, parent, start, end, attributes, status, state, remote):
    ctx = SpanContext(TRACE, span_id, False, TraceFlags(1), TraceState.from_header([state]) if state else None)
    parent_ctx = SpanContext(TRACE, parent, remote, TraceFlags(1)) if parent else None
    return ReadableSpan(name=name, context=ctx, parent=parent_ctx, resource=Resource(RESOURCE), attributes=attributes,
                        kind=kind, status=status, start_time=start, end_time=end,
                        instrumentation_scope=InstrumentationScope("pdproxy", "9.9"))


def test_encoding_matches_the_sdk():
    ours = [SpanData("chat m", KIND_SERVER, TRACE, ROOT, CLIENT_SPAN, 10, 20, dict(ATTRS), None, "vendor=1", True),
            SpanData("pd.prefill", KIND_CLIENT, TRACE, CHILD, ROOT, 11, 15, {"vllm.request_phase": "prefill"},
                     "prefill answered 500", "vendor=1")]
    theirs = [sdk_span("chat m", SpanKind.SERVER, ROOT, CLIENT_SPAN, 10, 20, ATTRS, Status(StatusCode.UNSET),
                       "vendor=1", True),
              sdk_span("pd.prefill", SpanKind.CLIENT, CHILD, ROOT, 11, 15, {"vllm.request_phase": "prefill"},
                       Status(StatusCode.ERROR, "prefill answered 500"), "vendor=1", False)]
    resource, scope = frame_prefix(RESOURCE, "pdproxy", "9.9")
    decoded = ExportTraceServiceRequest.FromString(export_framed(resource, scope, [encode_span(s) for s in ours]))
    assert MessageToDict(decoded) == MessageToDict(encode_spans(theirs))


def test_span_events_match_the_sdk():
    from opentelemetry.sdk.trace import Event

    events = [(12, "pd.stall", {"pd.stall.duration": 0.15, "pd.stall.tokens": 2}), (14, "pd.stall", {})]
    ours = SpanData("pd.decode", KIND_CLIENT, TRACE, CHILD, ROOT, 11, 15, {"vllm.request_phase": "decode"},
                    events=events)
    ctx = SpanContext(TRACE, CHILD, False, TraceFlags(1))
    theirs = ReadableSpan(name="pd.decode", context=ctx, parent=SpanContext(TRACE, ROOT, False, TraceFlags(1)),
                          resource=Resource(RESOURCE), attributes={"vllm.request_phase": "decode"},
                          events=[Event(name, dict(attrs), timestamp=t) for t, name, attrs in events],
                          kind=SpanKind.CLIENT, status=Status(StatusCode.UNSET), start_time=11, end_time=15,
                          instrumentation_scope=InstrumentationScope("pdproxy", "9.9"))
    resource, scope = frame_prefix(RESOURCE, "pdproxy", "9.9")
    decoded = ExportTraceServiceRequest.FromString(export_framed(resource, scope, [encode_span(ours)]))
    assert MessageToDict(decoded) == MessageToDict(encode_spans([theirs]))


def test_packed_attributes_are_the_generic_encoding():
    """The recorder's shortcuts (four doubles in one pack, a one-word array cached) write the bytes the
    generic encoder writes, which the test above decodes against the SDK's."""
    keys = ("pd.itl.mean", "pd.itl.p50", "pd.itl.p99", "k" * 200)  # the last: a two-byte length prefix
    for values in ((0.0125, 1e-9, 3.5e6, -0.0), (1.0, 2.0, 3.0, float("inf"))):
        assert four_doubles(keys, *values) == attribute_fields(zip(keys, values))
    for words in (["stop"], ["length"], ["stop"], ["length", "stop"], ["x" * 40], ["é中"]):
        for _ in range(2):  # the second time from the cache, when it caches
            expected = attribute_fields([("gen_ai.response.finish_reasons", words)])
            assert words_attribute("gen_ai.response.finish_reasons", words) == expected
