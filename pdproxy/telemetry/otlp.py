"""OTLP trace export without the SDK's per-span machinery: spans encoded straight to protobuf bytes.

Why: with the SDK, a request's five spans cost about as much CPU as proxying the request itself
(span objects, attribute validation, then `encode_spans` building protobuf messages field by field
in Python, hashing the Resource once per span). Here a finished request's spans are encoded to
OTLP wire bytes by hand on the event loop, straight from the request's fields (what its five spans
share encoded once, the attributes that repeat across requests cached ready encoded: ~10 us
compiled, benchmarks/trace_cost.py; no lock, no GIL hand-off in the middle of a stream), framed as
fields of their batch and joined into one buffer per request, so that a batch is one more join
(pdproxy/telemetry/export.py sends it). The wire format is the public OTLP protobuf schema
(opentelemetry-proto `trace/v1/trace.proto`); the tests decode it with the generated classes.

Transports: OTLP/HTTP (protobuf, `http.client`, keep-alive) and OTLP/gRPC (the raw bytes sent
with `grpc`'s generic unary call), configured from the flags or the standard OTEL_EXPORTER_OTLP_*
variables (endpoint, headers, timeout, compression=gzip, certificate for https).
"""

from __future__ import annotations

import gzip
import http.client
import os
import select
import socket
import ssl
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol
from urllib.parse import unquote, urlsplit

# OTLP enums
KIND_INTERNAL: Final = 1
KIND_SERVER: Final = 2
KIND_CLIENT: Final = 3
STATUS_ERROR: Final = 2
_FLAG_HAS_IS_REMOTE: Final = 0x100
_FLAG_IS_REMOTE: Final = 0x200


@dataclass(slots=True)
class SpanData:
    """One finished span, as the recorder knows it."""

    name: str
    kind: int
    trace_id: int
    span_id: int
    parent_id: int | None
    start_ns: int  # unix nanoseconds
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # status ERROR with this message
    trace_state: str | None = None
    parent_remote: bool = False
    events: list[tuple[int, str, dict[str, Any]]] | None = None  # (unix ns, name, attributes)
    links: list[tuple[int, int, dict[str, Any]]] | None = None  # (trace id, span id, attributes)


# -- protobuf wire format --------------------------------------------------------------------

_BYTES: Final = [bytes([n]) for n in range(256)]  # below 128: the varints of one byte


def _varint(n: int) -> bytes:
    if n < 128:
        return _BYTES[n]
    if n < 16384:  # a span's length, most lengths: two bytes without a bytearray (a method call per byte compiled)
        return _BYTES[(n & 0x7F) | 0x80] + _BYTES[n >> 7]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (tag already encoded)."""
    return tag + _varint(len(payload)) + payload


def _any(value: Any) -> bytes:
    """An AnyValue message body."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if isinstance(value, (list, tuple)):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any(v)) for v in value))
    return _field(b"\x0a", str(value).encode())


_KEYS: Final[dict[str, bytes]] = {}
_PAIRS: Final[dict[tuple[str, type, Any], bytes]] = {}  # whole attribute fields of repeating (key, value) pairs
_PAIRS_MAX: Final = 4096


def _key(key: str) -> bytes:
    """KeyValue.key; keys are a small fixed set, so their encoding is cached."""
    k = _KEYS.get(key)
    if k is None:
        k = _KEYS[key] = _field(b"\x0a", key.encode())
    return k


def key_value(key: str, value: Any) -> bytes:
    """A KeyValue message body."""
    return _key(key) + _field(b"\x12", _any(value))


def attribute(tag: bytes, key: str, value: Any, repeats: bool) -> bytes:
    """An attribute field; `repeats` marks low-cardinality values (operation, model, instance, phase,
    status...), whose encoding is cached (bounded: past the limit they are encoded each time)."""
    if not repeats or isinstance(value, (list, float)):
        return _field(tag, key_value(key, value))
    pair = (key, type(value), value)  # the type too: True == 1, but they encode differently
    field_ = _PAIRS.get(pair)
    if field_ is None:
        field_ = _field(tag, key_value(key, value))
        if len(_PAIRS) < _PAIRS_MAX:
            _PAIRS[pair] = field_
    return field_


def words_attribute(key: str, values: list[str]) -> bytes:
    """A string array attribute's field; the usual one short word (a response's finish reason) cached
    as a repeating value (an array's encoding is some ten calls and bytes objects)."""
    if len(values) == 1 and len(values[0]) <= 32:
        return attribute(b"\x4a", key, (values[0],), True)
    return attribute(b"\x4a", key, values, False)


# attributes whose values come from a small set, worth caching (see `attribute`)
REPEATING: Final = frozenset({
    "gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model", "gen_ai.request.stream",
    "gen_ai.request.max_tokens", "gen_ai.request.temperature", "gen_ai.request.top_p", "pd.mode", "pd.deployment",
    "pd.run", "pd.prefill.instance", "pd.decode.instance", "pd.kv_transfer_params", "pd.itl.unit",
    "http.response.status_code", "vllm.request_phase", "server.address", "server.port", "pd.prefill.attempts",
    "pd.decode.attempts", "pd.kv_transfer.definition", "pd.failed_stage", "error.type",
})


_FLOAT_PREFIX: Final[dict[str, bytes]] = {}
_pack_double: Final = struct.Struct("<d").pack


def _float_prefix(key: str) -> bytes:
    """Everything of a double attribute's field but the 8 bytes of the value."""
    k = _key(key)
    return b"\x4a" + _varint(len(k) + 11) + k + b"\x12\x09\x21"


_INT_PREFIXES: Final[dict[str, list[bytes]]] = {}
_INT_LIMIT: Final = 1 << 63  # from 0 up to this, an int's varint is the AnyValue's as it is (no two's complement)


def _int_prefixes(key: str) -> list[bytes]:
    """Everything of an int attribute's field but its varint, by the varint's length."""
    k = _key(key)
    return [b"\x4a" + _varint(len(k) + 3 + size) + k + b"\x12" + _BYTES[1 + size] + b"\x18" for size in range(11)]


def str_attribute(key: str, value: str) -> bytes:
    """A string attribute's field, uncached (ids): `_field(tag, key_value(key, value))` without the calls."""
    raw = value.encode()
    body = b"\x0a" + _varint(len(raw)) + raw
    kv = _key(key) + b"\x12" + _varint(len(body)) + body
    return b"\x4a" + _varint(len(kv)) + kv


def float_attribute(key: str, value: float) -> bytes:
    """A double attribute's field (the measurements: most of a root span's attributes)."""
    prefix = _FLOAT_PREFIX.get(key)
    if prefix is None:
        prefix = _FLOAT_PREFIX[key] = _float_prefix(key)
    return prefix + _pack_double(value)


_FOUR_DOUBLES: Final[dict[tuple[str, str, str, str], tuple[struct.Struct, bytes, bytes, bytes, bytes]]] = {}


def four_doubles(keys: tuple[str, str, str, str], a: float, b: float, c: float, d: float) -> bytes:
    """Four double attributes' fields that always go together (a span's ITL summary, the KV hand-off's
    times), packed by one call into one bytes object: the same bytes as four `float_attribute`s."""
    packer = _FOUR_DOUBLES.get(keys)
    if packer is None:
        prefixes = [_float_prefix(key) for key in keys]
        layout = struct.Struct("<" + "".join(f"{len(prefix)}sd" for prefix in prefixes))
        packer = _FOUR_DOUBLES[keys] = (layout, prefixes[0], prefixes[1], prefixes[2], prefixes[3])
    layout, p0, p1, p2, p3 = packer
    return layout.pack(p0, a, p1, b, p2, c, p3, d)


def int_attribute(key: str, value: int) -> bytes:
    """An int attribute's field (counts, tokens, ports, statuses)."""
    if not 0 <= value < _INT_LIMIT:
        return attribute(b"\x4a", key, value, False)
    prefixes = _INT_PREFIXES.get(key)
    if prefixes is None:
        prefixes = _INT_PREFIXES[key] = _int_prefixes(key)
    number = _varint(value)
    return prefixes[len(number)] + number


class IntField:
    """An int attribute's field for one key known in advance: its prefixes ready, no lookup by key, and
    the whole field of each value below 128 (counts, a short stream's tokens) ready too."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.prefixes = _int_prefixes(key)
        self.small = [self.prefixes[1] + _BYTES[value] for value in range(128)]

    def encode(self, value: int) -> bytes:
        if 0 <= value < 128:
            return self.small[value]
        if not 0 <= value < _INT_LIMIT:
            return attribute(b"\x4a", self.key, value, False)
        number = _varint(value)
        return self.prefixes[len(number)] + number


class StrField:
    """A string attribute's field for one key known in advance, uncached (ids): one `%` build."""

    def __init__(self, key: str) -> None:
        self.key = _key(key)

    def encode(self, value: str) -> bytes:
        raw = value.encode()
        kv = len(self.key) + 4 + len(raw)
        if kv < 128:  # every length one byte: the usual id
            return b"\x4a%b%b\x12%b\x0a%b%b" % (_BYTES[kv], self.key, _BYTES[len(raw) + 2], _BYTES[len(raw)], raw)
        size = _varint(len(raw))
        body = 1 + len(size) + len(raw)  # the AnyValue
        kv = len(self.key) + 1 + len(_varint(body)) + body
        return b"\x4a%b%b\x12%b\x0a%b%b" % (_varint(kv), self.key, _varint(body), size, raw)


class DoubleFields:
    """Double attributes' fields for a fixed list of keys, in that order, packed by one `struct` call:
    the same bytes as a `float_attribute` each, for one call instead of one per value, the values passed
    straight to the pack (no list of arguments built)."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.prefixes = [_float_prefix(key) for key in keys]
        self.pack: Callable[..., bytes] = struct.Struct("<" + "".join(f"{len(prefix)}sd" for prefix in self.prefixes)).pack

    def three(self, a: float, b: float, c: float) -> bytes:
        p = self.prefixes
        return self.pack(p[0], a, p[1], b, p[2], c)

    def seven(self, a: float, b: float, c: float, d: float, e: float, f: float, g: float) -> bytes:
        p = self.prefixes
        return self.pack(p[0], a, p[1], b, p[2], c, p[3], d, p[4], e, p[5], f, p[6], g)


def attribute_fields(items: Iterable[tuple[str, Any]]) -> bytes:
    """Attribute fields, in order (values that repeat across requests cached: see `attribute`)."""
    out: list[bytes] = []
    for k, v in items:
        kind = type(v)
        if kind is float:
            out.append(float_attribute(k, v))
        elif kind is int:
            out.append(int_attribute(k, v))
        elif kind is str and k not in REPEATING:
            out.append(str_attribute(k, v))
        else:
            out.append(attribute(b"\x4a", k, v, k in REPEATING))
    return b"".join(out)


def encode_span(s: SpanData) -> bytes:
    """One `Span` message, framed as a field of ScopeSpans (see `span_field`)."""
    parent = s.parent_id.to_bytes(8, "big") if s.parent_id else None
    links = [(trace.to_bytes(16, "big"), span.to_bytes(8, "big"), attrs) for trace, span, attrs in s.links or ()]
    return span_field(trace_field(s.trace_id.to_bytes(16, "big")), s.span_id.to_bytes(8, "big"),
                      context_fields(s.trace_state, parent), span_head(s.name, s.kind), fixed64(s.start_ns),
                      fixed64(s.end_ns), attribute_fields(s.attributes.items()),
                      events_field(s.events) + links_field(links) + status_tail(s.error, s.parent_remote))


# A span's bytes in parts, so that the recorder builds a request's spans straight from its fields and
# encodes what its spans share (trace id, context, the stage spans' names and kinds) once.

_HEADS: Final[dict[tuple[str, int], bytes]] = {}
# an explicit (unset) status and the flags, as the SDK sends them; by whether the parent is remote
_OK_TAILS: Final = {remote: b"\x7a\x00\x85\x01" + struct.pack("<I", _FLAG_HAS_IS_REMOTE | (remote and _FLAG_IS_REMOTE))
                    for remote in (False, True)}


def trace_field(trace_id: bytes) -> bytes:
    """Span.trace_id (its 16 bytes, big-endian), and the tag of the span_id that follows it."""
    return b"\x0a\x10%b\x12\x08" % trace_id


def context_fields(trace_state: str | None, parent_id: bytes | None) -> bytes:
    """Span.trace_state and Span.parent_span_id (its 8 bytes), each when present."""
    if not trace_state:
        return b"\x22\x08%b" % parent_id if parent_id else b""
    out = _field(b"\x1a", trace_state.encode())
    return out + b"\x22\x08" + parent_id if parent_id else out


def fixed64(unix_ns: int) -> bytes:
    """A span's start or end time as its fixed64 field's value (little-endian): a request's spans share
    their boundaries, so each time is written once and its bytes used by every span it bounds."""
    return unix_ns.to_bytes(8, "little")


def span_head(name: str, kind: int) -> bytes:
    """Span.name and Span.kind; span names are bounded (stages, operation and model label): cached."""
    head = _HEADS.get((name, kind))
    if head is None:
        head = _field(b"\x2a", name.encode()) + b"\x30" + _BYTES[kind]
        if len(_HEADS) < _PAIRS_MAX:
            _HEADS[(name, kind)] = head
    return head


def events_field(events: list[tuple[int, str, dict[str, Any]]] | None) -> bytes:
    """Span.events (field 11), one field per (unix ns, name, attributes)."""
    out = b""
    for time_ns, name, attrs in events or ():
        body = b"\x09" + struct.pack("<Q", time_ns) + _field(b"\x12", name.encode())
        body += b"".join(_field(b"\x1a", key_value(k, v)) for k, v in attrs.items())
        out += _field(b"\x5a", body)
    return out


def links_field(links: Sequence[tuple[bytes, bytes, dict[str, Any]]] | None) -> bytes:
    """Span.links (field 13), one field per (trace id, span id, attributes), the ids as their bytes."""
    out = b""
    for trace_id, span_id, attrs in links or ():
        body = b"\x0a\x10" + trace_id + b"\x12\x08" + span_id
        body += b"".join(_field(b"\x22", key_value(k, v)) for k, v in attrs.items())
        out += _field(b"\x6a", body)
    return out


def status_tail(error: str | None, parent_remote: bool) -> bytes:
    """Span.status (ERROR with `error` as its message, else unset) and Span.flags."""
    if error is None:
        return _OK_TAILS[parent_remote]
    status = _field(b"\x7a", _field(b"\x12", error.encode()) + b"\x18" + _BYTES[STATUS_ERROR])
    return status + _OK_TAILS[parent_remote][2:]


def span_field(trace: bytes, span_id: bytes, context: bytes, head: bytes, start: bytes, end: bytes, attributes: bytes,
               tail: bytes) -> bytes:
    """One `Span` message from its parts, framed as a field of ScopeSpans: a batch of requests' spans is
    one join (`export_framed`). `trace` from `trace_field`, `span_id` its 8 bytes, `context` from
    `context_fields`, `head` from `span_head`, `start` and `end` from `fixed64`, `attributes` encoded
    attribute fields, `tail` its events, links and `status_tail`. One `%` of bytes operands: mypyc
    builds it as one allocation and copies (no list, no join's buffer protocol per part)."""
    size = len(trace) + 8 + len(context) + len(head) + 18 + len(attributes) + len(tail)
    # its length, as the usual two bytes of varint straight from the table (no call, no concatenation);
    # start_time_unix_nano (field 7) and end_time_unix_nano (8) are fixed64
    if 128 <= size < 16384:
        return b"\x12%b%b%b%b%b%b\x39%b\x41%b%b%b" % (_BYTES[(size & 0x7F) | 0x80], _BYTES[size >> 7], trace, span_id,
                                                      context, head, start, end, attributes, tail)
    return b"\x12%b%b%b%b%b\x39%b\x41%b%b%b" % (_varint(size), trace, span_id, context, head, start, end, attributes,
                                                tail)


def frame_prefix(resource: dict[str, Any], scope_name: str, scope_version: str) -> tuple[bytes, bytes]:
    """Constant parts of every request: (ResourceSpans' resource field, ScopeSpans' scope field)."""
    res = b"".join(_field(b"\x0a", key_value(k, v)) for k, v in resource.items())
    scope = _field(b"\x0a", scope_name.encode()) + _field(b"\x12", scope_version.encode())
    return _field(b"\x0a", res), _field(b"\x0a", scope)


def export_framed(resource_field: bytes, scope_field: bytes, spans: list[bytes]) -> bytes:
    """An `ExportTraceServiceRequest` holding `spans` (each one or more spans framed by `span_field`)
    under one resource and scope: the batch copied once."""
    scope_size = len(scope_field)
    for span in spans:  # a loop, not sum() of a list: compiled, no int boxed per span
        scope_size += len(span)
    scope_length = _varint(scope_size)
    size = len(resource_field) + 1 + len(scope_length) + scope_size
    head = b"\x0a%b%b\x12%b%b" % (_varint(size), resource_field, scope_length, scope_field)
    return b"".join([head, *spans])


# -- transports --------------------------------------------------------------------------------


class Transport(Protocol):
    """A blocking sink of encoded batches; after a False `send`, `error` says why (the log, /status)."""

    error: str | None

    def send(self, payload: bytes) -> bool: ...
    def close(self) -> None: ...


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value.strip()
    return None


def _headers(kind: str) -> dict[str, str]:
    raw = _env(f"OTEL_EXPORTER_OTLP_{kind}_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS") or ""
    headers = {}
    for item in raw.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            headers[unquote(key.strip()).lower()] = unquote(value.strip())
    return headers


def _timeout() -> float:
    raw = _env("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
    return float(raw) if raw else 10.0  # seconds, as the Python SDK reads it


class HttpTarget:
    """Where and how OTLP/HTTP batches go, from the endpoint and the OTEL_EXPORTER_OTLP_* variables."""

    def __init__(self, endpoint: str | None) -> None:
        self.url = urlsplit(http_traces_url(endpoint))
        self.path = self.url.path or "/v1/traces"
        self.timeout = _timeout()
        self.gzip = (_env("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION") or "") == "gzip"
        self.headers = {"Content-Type": "application/x-protobuf", **_headers("TRACES")}
        if self.gzip:
            self.headers["Content-Encoding"] = "gzip"

    def tls(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=_env("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
                                                      "OTEL_EXPORTER_OTLP_CERTIFICATE"))


class HttpTransport:
    """OTLP/HTTP protobuf over one keep-alive connection, blocking (the simulator's SDK exporter; the
    proxy posts on its event loop: pdproxy/telemetry/export.py)."""

    def __init__(self, endpoint: str | None) -> None:
        self.target = HttpTarget(endpoint)
        self.conn: http.client.HTTPConnection | None = None
        self.error: str | None = None

    def _connect(self) -> http.client.HTTPConnection:
        target = self.target
        host, port = target.url.hostname or "localhost", target.url.port
        if target.url.scheme == "https":
            return http.client.HTTPSConnection(host, port or 443, timeout=target.timeout, context=target.tls())
        return http.client.HTTPConnection(host, port or 80, timeout=target.timeout)

    def send(self, payload: bytes) -> bool:
        """Post one batch. Sent at most once: only a request the collector provably did not take is
        retried, once, on a new connection (see `_unanswered`); a timeout is never retried, since the
        collector may be storing the batch right now."""
        body = gzip.compress(payload) if self.target.gzip else payload
        if self.conn is not None and _dropped(self.conn):
            self.close()  # the collector closed it while idle: do not even try it
        for _ in range(2):
            reused = self.conn is not None and self.conn.sock is not None
            written = False
            try:
                if self.conn is None:
                    self.conn = self._connect()
                self.conn.request("POST", self.target.path, body, self.target.headers)
                written = True
                resp = self.conn.getresponse()
                answer = resp.read()
                if 200 <= resp.status < 300:
                    return True
                self.error = http_refusal(resp.status, answer)
                return False
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                self.error = transport_error(exc, self.target.timeout)
                if not (reused and _unanswered(exc, written)):
                    return False
        return False

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def http_refusal(status: int, body: bytes) -> str:
    """Why a collector refused a batch over OTLP/HTTP: the status and the start of its answer."""
    text = body[:200].decode("utf-8", "replace").strip()
    return f"HTTP {status}" + (f": {text}" if text else "")


def transport_error(exc: BaseException, timeout: float) -> str:
    """A transport failure in a few words, for the log and /status ("connection refused", "no answer
    within 10 s", "name not resolved: ...")."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, socket.gaierror):
        return f"name not resolved ({exc.strerror})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """An idle kept-alive connection that is readable has been closed by the peer (or holds bytes
    nobody asked for): either way it cannot carry a request."""
    if conn.sock is None:
        return False
    poller = select.poll()  # not select(): a busy proxy's sockets may be numbered past FD_SETSIZE
    poller.register(conn.sock, select.POLLIN)
    return bool(poller.poll(0))


def _unanswered(exc: BaseException, written: bool) -> bool:
    """Whether a request that failed on a reused connection certainly did not reach the collector:
    the connection was found closed or reset while writing, or closed before any byte of an answer
    (the collector closing an idle keep-alive connection as the request went out). Never a timeout,
    nor anything after an answer started."""
    if isinstance(exc, TimeoutError):
        return False
    if not written:
        return isinstance(exc, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError))
    # RemoteDisconnected: EOF where the status line should be; a reset while waiting for it
    return isinstance(exc, (http.client.RemoteDisconnected, ConnectionResetError))


class GrpcTransport:
    """OTLP/gRPC: the encoded request sent as-is with grpc's generic unary call."""

    METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

    def __init__(self, endpoint: str | None) -> None:
        import grpc

        endpoint = grpc_endpoint(endpoint)
        parts = urlsplit(endpoint if "://" in endpoint else "http://" + endpoint)
        target = f"{parts.hostname}:{parts.port or 4317}"
        insecure = parts.scheme == "http" or (_env("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")
                                              or "").lower() == "true"
        # gRPC's reconnect backoff grows to 120 s while the collector is down, so export would
        # resume up to two minutes after it is back (spans dropped meanwhile): cap it at 2 s.
        options = [("grpc.initial_reconnect_backoff_ms", 1000), ("grpc.max_reconnect_backoff_ms", 2000)]
        if insecure:
            self.channel = grpc.insecure_channel(target, options=options)
        else:
            cert = _env("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE")
            root = open(cert, "rb").read() if cert else None
            self.channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root), options=options)
        self.call = self.channel.unary_unary(self.METHOD, request_serializer=None, response_deserializer=None)
        self.metadata = list(_headers("TRACES").items())
        self.timeout = _timeout()
        compression = _env("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION")
        self.compression = grpc.Compression.Gzip if compression == "gzip" else None
        self.error: str | None = None

    def send(self, payload: bytes) -> bool:
        import grpc

        try:
            self.call(payload, timeout=self.timeout, metadata=self.metadata, compression=self.compression)
            return True
        except grpc.RpcError as exc:
            self.error = grpc_error(exc)
            return False

    def close(self) -> None:
        self.channel.close()


def grpc_error(exc: Any) -> str:
    """A failed gRPC call in a few words: its status code and details ("UNAVAILABLE: failed to connect
    to all addresses; ... Connection refused (111)")."""
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    name = code().name if callable(code) and code() is not None else type(exc).__name__
    text = details() if callable(details) else None
    return f"{name}: {text}" if text else name


def http_traces_url(endpoint: str | None) -> str:
    """Where OTLP/HTTP spans are posted: a flag's endpoint gets `/v1/traces` appended, as the base variable does."""
    endpoint = endpoint or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if endpoint is None:
        base = _env("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
        return base.rstrip("/") + "/v1/traces"
    if not endpoint.rstrip("/").endswith("/v1/traces") and not _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def grpc_endpoint(endpoint: str | None) -> str:
    return (endpoint or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
            or "http://localhost:4317")


def otlp_target(endpoint: str | None, protocol: str | None) -> tuple[str, str] | None:
    """(protocol, endpoint) spans are exported to, when an endpoint is configured by flag or by the
    standard OTEL_* variables; None when OTLP export is off."""
    env = os.environ
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    if not (endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    protocol = (protocol or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip()
    if protocol == "grpc":
        return protocol, grpc_endpoint(endpoint)
    if protocol == "http/protobuf":
        return protocol, http_traces_url(endpoint)
    raise ValueError(f"unsupported OTLP protocol {protocol!r} (use grpc or http/protobuf)")


def otlp_transport(endpoint: str | None, protocol: str | None) -> Transport | None:
    """A transport when an endpoint is configured by flag or by the standard OTEL_* variables."""
    target = otlp_target(endpoint, protocol)
    if target is None:
        return None
    protocol, endpoint = target
    return GrpcTransport(endpoint) if protocol == "grpc" else HttpTransport(endpoint)
