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


def test_span_lengths_at_the_varint_bounds_match_the_sdk():
    """A span's length is one, two (written from the table) or three bytes of varint: spans of every size
    around 128 and 16384 bytes decode to what the SDK sends."""
    texts = [("t" * n) for n in [*range(40, 110), *range(16260, 16330)]]
    ours = [SpanData("s", KIND_CLIENT, TRACE, CHILD, ROOT, 11, 15, {"k": text}) for text in texts]
    theirs = [sdk_span("s", SpanKind.CLIENT, CHILD, ROOT, 11, 15, {"k": text}, Status(StatusCode.UNSET), None, False)
              for text in texts]
    fields = [encode_span(s) for s in ours]
    sizes = {len(f) - (2 if f[1] < 0x80 else 3 if f[2] < 0x80 else 4) for f in fields}  # tag, varint, then the span
    assert {127, 128, 16383, 16384} <= sizes
    resource, scope = frame_prefix(RESOURCE, "pdproxy", "9.9")
    decoded = ExportTraceServiceRequest.FromString(export_framed(resource, scope, fields))
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


def test_field_writers_are_the_generic_encoding():
    """The recorder's per-key writers (an int's or a string's prefix ready, several doubles in one pack)
    write the bytes the generic encoder writes."""
    from pdproxy.telemetry.otlp import DoubleFields, IntField, StrField

    for key in ("pd.chunks", "k" * 200):  # the second: two-byte lengths
        for value in (0, 1, 127, 128, 300, 2**40, 2**63 - 1, 2**63, -1, -(2**40)):
            assert IntField(key).encode(value) == attribute_fields([(key, value)])
        for text in ("", "r", "é中", "r" * 200, "x" * 20000):
            assert StrField(key).encode(text) == attribute_fields([(key, text)])
    keys = ("pd.e2e", "gen_ai.response.time_to_first_chunk", "k" * 200, "pd.tpot", "a", "b", "c")
    for values in ([0.25, 1e-9, -0.0, 1.0, 2.0, 3.0, 4.0], [float("inf"), 3.5e6, 7.0, -1.5, 0.0, 1e300, 5e-324]):
        assert DoubleFields(keys).seven(*values) == attribute_fields(zip(keys, values))
        assert DoubleFields(keys[:3]).three(*values[:3]) == attribute_fields(zip(keys[:3], values[:3]))


def test_span_times_and_ids_at_their_real_sizes():
    """A span's times and ids written from their bytes, and the legs' traceparent from the ids formatted
    once, are what the plain encodings give: unix nanoseconds of today and of the far future, ids of any
    size, a new trace's ids from one draw and a client's trace continued."""
    import random

    from opentelemetry.context import Context

    from pdproxy.telemetry.otlp import fixed64, span_field, trace_field
    from pdproxy.telemetry.tracing import TraceIds, Tracing

    for start, end in ((1_764_900_000_123_456_789, 1_764_900_000_987_654_321), (0, 2**64 - 1), (2**64 - 2, 2**64 - 1)):
        field = span_field(trace_field(bytes(16)), bytes(8), b"", b"\x2a\x01x\x30\x01", fixed64(start), fixed64(end),
                           b"", b"")
        assert field.endswith(b"\x39" + start.to_bytes(8, "little") + b"\x41" + end.to_bytes(8, "little"))
    for trace_id, prefill, decode, root in ((2**128 - 1, 2**64 - 1, 1, 5), (1, 2, 3, 4),
                                            (random.getrandbits(128), random.getrandbits(64), random.getrandbits(64),
                                             random.getrandbits(64))):
        raw = b"".join([trace_id.to_bytes(16, "big"), prefill.to_bytes(8, "big"), decode.to_bytes(8, "big"),
                        root.to_bytes(8, "big"), bytes(16)])
        ids = TraceIds(Context(), raw, True, None, (2**64 - 1).to_bytes(8, "big"))
        assert (ids.trace_id, ids.prefill, ids.decode, ids.root, ids.parent_span_id) == (
            trace_id, prefill, decode, root, 2**64 - 1)
        assert ids.trace_hex == f"{trace_id:032x}"
        assert ids.traceparent(False) == f"00-{trace_id:032x}-{prefill:016x}-01"
        assert ids.traceparent(True) == f"00-{trace_id:032x}-{decode:016x}-01"
    tracing = Tracing({}, [], 16, on_drop=lambda reason, count: None)
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for headers in (None, {"traceparent": client}):
        ids = tracing.new_ids(headers)
        assert len(ids.raw) == 56 and len({ids.raw[i:i + 8] for i in range(16, 56, 8)}) == 5  # five distinct span ids
        shadow = tracing.child_ids(ids)
        assert shadow.trace_id == ids.trace_id and shadow.parent_span_id == ids.root and shadow.raw[16:] != ids.raw[16:]
    assert (ids.trace_hex, ids.parent_span_id) == ("0af7651916cd43dd8448eb211c80319c", 0xB7AD6B7169203331)


def _span_data(field):
    """A span framed by `span_field`, decoded back to the `SpanData` the generic encoder takes: its
    attributes in their order and with their types (1 and 1.0 apart)."""
    from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans

    [span] = ScopeSpans.FromString(field).spans

    def value(v):
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)

    parent = int.from_bytes(span.parent_span_id, "big") or None
    return SpanData(span.name, span.kind, int.from_bytes(span.trace_id, "big"), int.from_bytes(span.span_id, "big"),
                    parent, span.start_time_unix_nano, span.end_time_unix_nano,
                    {a.key: value(a.value) for a in span.attributes},
                    span.status.message if span.status.code == 2 else None, span.trace_state or None,
                    bool(span.flags & 0x200))


def _recorded_roots(bodies):
    """Each request's root span attributes as a collector decodes them: requests with `bodies` through
    the recorder's whole path (caches included), the same flow each time."""
    import asyncio
    import base64

    from pdproxy.errors import DECODE, PREFILL
    from pdproxy.policies.base import Decision
    from pdproxy.telemetry.metrics import Metrics
    from pdproxy.telemetry.models import ModelNames
    from pdproxy.telemetry.recorder import Recorder
    from pdproxy.telemetry.tracing import Tracing

    head = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":'
    events = [f'data: {head}{{"content":"t{i}"}},"finish_reason":null}}]}}\n\n'.encode() for i in range(4)]
    events.append(f'data: {head}{{"content":"!"}},"finish_reason":"length"}}]}}\n\n'.encode())
    events.append(b'data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":5,'
                  b'"total_tokens":45}}\n\n')
    tracing = Tracing({"pd.mode": "pd"}, [], 8192, on_drop=lambda reason, count: None)
    recorder = Recorder(Metrics(), tracing, stall_threshold=0.1, models=ModelNames(["m"]))
    legs = []  # each request's (prefill, decode) traceparent

    async def run():
        for i, body in enumerate(bodies):
            trace = recorder.begin(route="/v1/chat/completions", operation="chat", chat=True, headers={},
                                   request_id=f"req-{i}", pd_mode=True)
            trace.set_request(body)
            legs.append((trace.leg_headers(PREFILL)["traceparent"], trace.leg_headers(DECODE)["traceparent"]))
            trace.routed(PREFILL, Decision("round_robin", "rotation"))
            trace.routed(DECODE, Decision("round_robin", "rotation"))
            trace.admitted("127.0.0.1:8100", "127.0.0.1:8200")
            trace.prefill_sent("127.0.0.1:8100", 1)
            trace.prefill_done("127.0.0.1:8100", 200, 1, "received")
            trace.decode_sent("127.0.0.1:8200")
            trace.decode_headers(200)
            for k, event in enumerate(events):
                trace.scan.feed(event, trace.t.decode_sent + (k + 1) * 1_000_000)
            trace.first_token()
            trace.delivered()
            trace.finish()
        requests = list(tracing.queue)
        if tracing.timer is not None:
            tracing.timer.cancel()
        return requests

    roots = []
    for spans, (prefill_parent, decode_parent) in zip(asyncio.run(run()), legs):
        for span in spans:  # each span the recorder wrote is the generic encoder's bytes for its content
            assert encode_span(_span_data(span)) == span
        decoded = MessageToDict(ExportTraceServiceRequest.FromString(
            export_framed(tracing.resource_field, tracing.scope_field, spans)))
        named = {s["name"]: s for s in decoded["resourceSpans"][0]["scopeSpans"][0]["spans"]}
        assert set(named) == {"chat m", "pd.queue", "pd.prefill", "pd.kv_transfer", "pd.decode"}
        root = named["chat m"]
        # the stages tile the root, each where the last ended; the legs' traceparent names their spans
        stages = [named[s] for s in ("pd.queue", "pd.prefill", "pd.kv_transfer", "pd.decode")]
        edges = [root["startTimeUnixNano"]] + [s["endTimeUnixNano"] for s in stages[:-1]] + [root["endTimeUnixNano"]]
        assert [(s["startTimeUnixNano"], s["endTimeUnixNano"]) for s in stages] == list(zip(edges, edges[1:]))
        assert len(set(edges)) == 5 and all(s["parentSpanId"] == root["spanId"] for s in stages)
        assert [base64.b64decode(named[s]["spanId"]).hex() for s in ("pd.prefill", "pd.decode")] == [
            prefill_parent.split("-")[2], decode_parent.split("-")[2]]
        assert base64.b64decode(root["traceId"]).hex() == prefill_parent.split("-")[1]
        roots.append({a["key"]: a["value"] for a in named["chat m"]["attributes"]})
    return roots


def test_root_span_attributes_survive_the_cached_blocks():
    """The root span's repeating attributes come from a block cached by their values: a request whose
    values equal another's but for their type (temperature 1 and 1.0) gets its own encoding, and every
    attribute the root has is there, the cached time as the first."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    roots = _recorded_roots([{**body, "temperature": 1}, {**body, "temperature": 1.0}, {**body, "temperature": 1},
                             {**body, "temperature": 0.5, "top_p": 1, "seed": 7}])
    assert [r["gen_ai.request.temperature"] for r in roots] == [
        {"intValue": "1"}, {"doubleValue": 1.0}, {"intValue": "1"}, {"doubleValue": 0.5}]
    assert roots[3]["gen_ai.request.top_p"] == {"intValue": "1"} and roots[3]["gen_ai.request.seed"] == {"intValue": "7"}
    assert "gen_ai.request.seed" not in roots[0] and "gen_ai.request.top_p" not in roots[0]
    every = {"gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model", "pd.mode", "pd.deployment",
             "http.response.status_code", "pd.prefill.instance", "pd.decode.instance", "pd.kv_transfer_params",
             "gen_ai.request.stream", "gen_ai.request.max_tokens", "gen_ai.request.temperature", "pd.request_id",
             "pd.e2e", "pd.chunks", "gen_ai.response.time_to_first_chunk", "gen_ai.response.id",
             "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "pd.tpot", "gen_ai.response.finish_reasons",
             "pd.itl.unit", "pd.itl.count", "pd.itl.mean", "pd.itl.p50", "pd.itl.p99", "pd.itl.max", "pd.stalls",
             "pd.migrations"}  # the 29 the root had before its blocks were cached by value
    for i, root in enumerate(roots[:3]):
        assert set(root) == every
        assert root["pd.request_id"] == {"stringValue": f"req-{i}"}
        assert root["gen_ai.response.finish_reasons"] == {"arrayValue": {"values": [{"stringValue": "length"}]}}
        assert root["gen_ai.usage.output_tokens"] == {"intValue": "5"} and root["pd.chunks"] == {"intValue": "5"}
        assert root["gen_ai.request.stream"] == {"boolValue": True}
        assert root["pd.itl.count"] == {"intValue": "4"} and root["pd.itl.max"] == {"doubleValue": 0.001}
