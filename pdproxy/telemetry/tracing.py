"""Trace ids, sampling, and the export of each finished request's spans.

Spans are written when the request ends, with explicit timestamps from the request's timeline:
nothing touches tracing while tokens stream. The ids are chosen when the request arrives,
because the prefill and decode legs must carry their span's id in `traceparent` before those
spans exist.

A finished request's spans are encoded to OTLP protobuf bytes on the event loop (pdproxy/telemetry/
otlp.py: no SDK span objects) and queued; full batches, or what is queued when the schedule delay
runs out, are framed and handed to the sinks from the loop too (pdproxy/telemetry/export.py: no
thread of ours between the loop and OTLP/HTTP). The queue is bounded: spans that do not fit, or
that the collector refuses, are dropped and counted, a whole request at a time, so a slow or dead
collector never slows serving and a trace is never cut in half by the queue. The OpenTelemetry
SDK still provides the resource (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME work as usual) and,
when the operator sets OTEL_TRACES_SAMPLER, the sampler. Without it every request is traced,
whatever the client's `sampled` flag says: the proxy exists to trace every request, and a client
must not turn that off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdproxy import __version__
from pdproxy.telemetry.export import Exporter, LossLog
from pdproxy.telemetry.otlp import SpanData, encode_span, export_framed, frame_prefix

log = logging.getLogger("pdproxy.tracing")
_propagator = TraceContextTextMapPropagator()
_NO_PARENT: Final = Context()  # Final: compiled, no module dict lookup per request

DropCounter = Callable[[str, int], None]
MAX_BATCH = 512  # spans per export request
# W3C Trace Context: vendors SHOULD propagate at least 512 characters of tracestate, and when cutting,
# drop members longer than 128 characters first, then members from the right (the oldest)
TRACESTATE_MAX_CHARS, TRACESTATE_LONG_MEMBER = 512, 128

__all__ = ["SpanData", "TraceIds", "Tracing"]

_getrandbits: Final = random.getrandbits  # Final: compiled, no module attribute lookup per id
_hex: Final = bytes.hex  # nor a method looked up by name


class TraceIds:
    """Ids of one request's trace, fixed on arrival, kept as the bytes the spans carry: `raw` is the trace
    id (16 bytes), then the span ids (8 bytes each, big-endian, as OTLP and W3C write them) of the prefill
    leg, the decode leg, the root and the two stage spans no leg names (queue, KV transfer). A new trace's
    are one random draw in one `to_bytes` (compiled, each `getrandbits` and `to_bytes` is a call, and
    splitting one number by shifts is big-int arithmetic); the ints are read from the bytes when asked
    for, off the hot path. A plain class, not a dataclass: compiled, a dataclass's generated `__init__`
    runs interpreted, and each request makes one."""

    def __init__(self, parent: Context, raw: bytes, sampled: bool, tracestate: str | None,
                 parent_span: bytes | None = None, parent_remote: bool = False,
                 tracestate_cut: str | None = None) -> None:
        self.parent = parent
        self.raw = raw
        self.sampled = sampled
        self.tracestate = tracestate
        self.parent_span = parent_span  # the root's parent: the client's span, or the primary's root for a shadow
        self.parent_remote = parent_remote
        self.tracestate_cut = tracestate_cut  # why the client's tracestate was not kept whole: "too_long", "invalid"
        # formatted once, the trace id and both legs' span ids in one `hex`: the legs' traceparent, the exemplars
        hexed = _hex(raw[:32])
        self.trace_hex = hexed[:32]
        self._prefill_hex = hexed[32:48]
        self._decode_hex = hexed[48:]

    @property
    def trace_id(self) -> int:
        return int.from_bytes(self.raw[:16], "big")

    @property
    def prefill(self) -> int:
        return int.from_bytes(self.raw[PREFILL_ID:PREFILL_ID + 8], "big")

    @property
    def decode(self) -> int:
        return int.from_bytes(self.raw[DECODE_ID:DECODE_ID + 8], "big")

    @property
    def root(self) -> int:
        return int.from_bytes(self.raw[ROOT_ID:ROOT_ID + 8], "big")

    @property
    def parent_span_id(self) -> int | None:
        return int.from_bytes(self.parent_span, "big") if self.parent_span is not None else None

    def traceparent(self, decode: bool) -> str:
        """The W3C traceparent naming the decode leg's span, or the prefill leg's."""
        span_hex = self._decode_hex if decode else self._prefill_hex
        return f"00-{self.trace_hex}-{span_hex}-{'01' if self.sampled else '00'}"


# where each span id is in `TraceIds.raw`
PREFILL_ID: Final = 16
DECODE_ID: Final = 24
ROOT_ID: Final = 32
QUEUE_ID: Final = 40
KV_TRANSFER_ID: Final = 48
_SPAN_IDS_BITS: Final = 320  # the five span ids after the trace id


def _span_ids() -> bytes:
    return _getrandbits(_SPAN_IDS_BITS).to_bytes(_SPAN_IDS_BITS // 8, "big")


class Tracing:
    def __init__(self, resource_attrs: dict[str, str], sinks: list[Any], queue_size: int,
                 on_drop: DropCounter) -> None:
        provider = TracerProvider(resource=_resource(resource_attrs))  # for its env-configured sampler and resource
        # the SDK's own default (parentbased_always_on) would let a client's sampled=00 switch the proxy's spans off
        self.sampler = provider.sampler if os.environ.get("OTEL_TRACES_SAMPLER", "").strip() else sampling.ALWAYS_ON
        # samplers that keep every trace starting here, or every trace: no need to ask them (a few us per request)
        self._sample_all = self.sampler is sampling.ALWAYS_ON
        self._sample_new_traces = self._sample_all or self.sampler is sampling.DEFAULT_ON
        self.resource = provider.resource
        self.resource_field, self.scope_field = frame_prefix(dict(self.resource.attributes), "pdproxy", __version__)
        # each destination watched: its failures said in the log and its state in /status (export.py)
        self.exporters: list[Exporter] = [s if isinstance(s, Exporter) else Exporter(s) for s in sinks]
        self.queue_size = queue_size
        self.on_drop = on_drop
        self.queue_loss = LossLog(f"span queue ({queue_size} spans, --span-queue-size)", "queue_full", "is full",
                                  "has room again")
        self.dropped_queue_full = 0
        self.delay = float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", 1000)) / 1000.0
        self.batch = min(MAX_BATCH, queue_size)
        self.queue: list[list[bytes]] = []  # each request's framed spans, oldest first
        self.queued = 0  # spans in the queue
        self.sending: asyncio.Task | None = None  # the batches being sent: one post at a time
        self.timer: asyncio.TimerHandle | None = None  # for what is queued when the delay runs out

    # -- ids ------------------------------------------------------------------------------

    def new_ids(self, headers: Mapping[str, str] | None) -> TraceIds:
        """Continue the client's W3C trace context if it sent one, else start a trace."""
        if self._sample_new_traces and (headers is None or "traceparent" not in headers):
            return TraceIds(_NO_PARENT, _getrandbits(128 + _SPAN_IDS_BITS).to_bytes(16 + _SPAN_IDS_BITS // 8, "big"),
                            True, None)
        parent = _propagator.extract(headers)
        parent_span = trace_api.get_current_span(parent).get_span_context()
        trace_id = parent_span.trace_id if parent_span.is_valid else _getrandbits(128)
        sampled = self._sample_all or self.sampler.should_sample(parent, trace_id, "request",
                                                                 SpanKind.SERVER).decision.is_sampled()
        state, cut = None, None
        if parent_span.is_valid and headers is not None:
            state, cut = _tracestate(parent_span.trace_state, headers.get("tracestate"))
        return TraceIds(parent, trace_id.to_bytes(16, "big") + _span_ids(), sampled, state,
                        parent_span.span_id.to_bytes(8, "big") if parent_span.is_valid else None,
                        parent_span.is_remote, cut)

    def child_ids(self, primary: TraceIds) -> TraceIds:
        """Ids for a second request (the shadow) whose root is a child of `primary`'s root."""
        flags = trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED if primary.sampled else trace_api.TraceFlags.DEFAULT)
        parent_span = trace_api.NonRecordingSpan(trace_api.SpanContext(primary.trace_id, primary.root, False, flags))
        return TraceIds(trace_api.set_span_in_context(parent_span), primary.raw[:16] + _span_ids(), primary.sampled,
                        primary.tracestate, primary.raw[ROOT_ID:ROOT_ID + 8], False)

    # -- export ---------------------------------------------------------------------------

    def emit(self, spans: list[SpanData]) -> None:
        """Queue one request's spans (all or none); called on the event loop."""
        self.emit_encoded([encode_span(s) for s in spans])

    def emit_encoded(self, spans: list[bytes]) -> None:
        """Queue one request's spans, each encoded and framed (`otlp.span_field`), all or none; called on
        the event loop. Not joined here: the batch's join copies them once (a copy of a few KB is some
        thousand instructions)."""
        count = len(spans)
        if self.queued + count > self.queue_size:
            self.on_drop("queue_full", count)
            self.dropped_queue_full += count
            self.queue_loss.lost(count, "spans come faster than the destinations take them", time.monotonic())
            return
        self.queue.append(spans)
        self.queued += count
        if self.sending is None:
            if self.queued >= self.batch:
                self._send(self.batch)
            else:
                self._wait_for_delay()

    def _wait_for_delay(self) -> None:
        """What is queued goes when the schedule delay runs out, unless a full batch comes first."""
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.delay, self._delay_over)

    def _delay_over(self) -> None:
        self.timer = None
        if self.sending is None and self.queued:
            self._send(1)

    def _send(self, least: int) -> asyncio.Task:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.sending = task = asyncio.get_running_loop().create_task(self._drain(least), name="span-export")
        return task

    async def _drain(self, least: int) -> None:
        """Send a batch when at least `least` spans are queued (the delay ran out: any), then while a
        full batch is: the spans that come while one is sent wait for the next full one or the delay,
        instead of going as a post of a few spans each time (a post takes long enough that a busy
        proxy would otherwise post again and again). A batch holds whole requests, up to
        `self.batch` spans."""
        queue = self.queue
        try:
            while self.queued >= least:
                # the oldest requests whose spans fit a batch (at least one), taken as one slice: compiled, a
                # plain loop over a list, no method called by name per request
                taken, count = 0, 0
                for request in queue:
                    if taken and count + len(request) > self.batch:
                        break
                    taken += 1
                    count += len(request)
                spans = [span for request in queue[:taken] for span in request]
                del queue[:taken]
                self.queued -= count
                payload = export_framed(self.resource_field, self.scope_field, spans)
                least = self.batch
                for ok in await asyncio.gather(*[exporter.export(payload, count) for exporter in self.exporters]):
                    if not ok:
                        self.on_drop("export_failed", count)
                if self.queue_loss.failing_since is not None and self.queued < self.queue_size // 2:
                    self.queue_loss.recovered(time.monotonic())
        finally:
            self.sending = None
        if self.queued:
            self._wait_for_delay()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Send what can be sent within `timeout`: a dead or slow collector must not hold up exit."""
        try:
            async with asyncio.timeout(timeout):
                while self.sending is not None or self.queued:
                    await asyncio.shield(self.sending or self._send(1))
        except TimeoutError:
            log.warning("span export still in progress after %gs at shutdown: the batch being sent and %d "
                        "queued span(s) not sent", timeout, self.queued)
            if self.sending is not None:
                self.sending.cancel()
        if self.timer is not None:
            self.timer.cancel()
        for exporter in self.exporters:
            try:
                await exporter.close()
            except Exception:
                pass

    def start(self) -> None:
        """On the serving loop: probe the OTLP endpoint in the background (start-up says when nothing answers)."""
        for exporter in self.exporters:
            exporter.start_probe()

    def status(self) -> dict[str, Any]:
        """For /status: each destination's state, and the queue in front of them (this process's)."""
        return {"exporters": [exporter.status() for exporter in self.exporters],
                "queue": {"spans": self.queued, "capacity": self.queue_size,
                          "spans_dropped_full": self.dropped_queue_full}}


def _tracestate(state: trace_api.TraceState | None, header: str | None) -> tuple[str | None, str | None]:
    """The client's tracestate as the proxy carries it on: within the W3C limits (at most 32 members,
    which the parser enforces, and 512 characters), and why it was cut, if it was."""
    if not state:
        # the parser discards a whole tracestate that breaks the rules (a bad member, over 32 or 8192)
        return None, ("invalid" if header and header.strip(" \t,") else None)
    members = [f"{key}={value}" for key, value in state.items()]
    if len(",".join(members)) <= TRACESTATE_MAX_CHARS:
        return ",".join(members), None
    members = [m for m in members if len(m) <= TRACESTATE_LONG_MEMBER]
    while len(",".join(members)) > TRACESTATE_MAX_CHARS:
        members.pop()
    return ",".join(members) or None, "too_long"


def _resource(attrs: dict[str, str]) -> Resource:
    base = {"service.version": __version__, "service.instance.id": f"{socket.gethostname()}-{os.getpid()}"}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        base["service.name"] = "pdproxy"
    return Resource.create({**base, **attrs})
