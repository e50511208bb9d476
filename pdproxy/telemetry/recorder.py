"""The one recorder: a request's facts and timestamps in, spans and metrics out.

The request flow (pdproxy/pd.py) only tells a `RequestTrace` what happened and when; this
module turns that into one `Measurement` and writes it twice — as the request's trace and as
Prometheus observations — so the two outputs cannot disagree.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, Final

from pdproxy import errors
from pdproxy.errors import CLIENT_CAUSED
from pdproxy.policies.base import Decision
from pdproxy.stream import ResponseScan
from pdproxy.telemetry import names as n
from pdproxy.telemetry.clock import now, to_unix_ns
from pdproxy.telemetry.measure import Measurement, Timeline, measure, stall_gaps
from pdproxy.telemetry.metrics import Metrics
from pdproxy.telemetry.models import MAX_NAME_LENGTH, OTHER, ModelNames
from pdproxy.telemetry.otlp import (KIND_CLIENT, KIND_INTERNAL, KIND_SERVER, DoubleFields, IntField, SpanData,
                                    StrField, attribute_fields, context_fields, events_field, fixed64, float_attribute,
                                    four_doubles, int_attribute, links_field, span_field, span_head, status_tail,
                                    str_attribute, trace_field, words_attribute)
from pdproxy.telemetry.stalls import (TOLERANCE_NS, Activity, Attributed, InstanceRecord, StallRecords, marked_cause,
                                      span_links)
from pdproxy.telemetry.tracing import DECODE_ID, KV_TRANSFER_ID, PREFILL_ID, QUEUE_ID, ROOT_ID, TraceIds, Tracing

log = logging.getLogger("pdproxy.recorder")
# the stage names as statics: compiled, an imported name that is not Final is a module dict lookup at each
# use, and a request's spans compare them some thirty times
QUEUE: Final = errors.QUEUE
PREFILL: Final = errors.PREFILL
KV_TRANSFER: Final = errors.KV_TRANSFER
DECODE: Final = errors.DECODE

CLIENT_CLOSED: Final = 499  # nginx's convention for "client closed the request"
# each stage span's name and kind, encoded, and where its id is in `TraceIds.raw`
_STAGE_SPANS: Final = {QUEUE: (span_head(n.QUEUE_SPAN, KIND_INTERNAL), QUEUE_ID),
                       PREFILL: (span_head(n.PREFILL_SPAN, KIND_CLIENT), PREFILL_ID),
                       KV_TRANSFER: (span_head(n.KV_TRANSFER_SPAN, KIND_INTERNAL), KV_TRANSFER_ID),
                       DECODE: (span_head(n.DECODE_SPAN, KIND_CLIENT), DECODE_ID)}
_OK_TAIL: Final = status_tail(None, False)


class Recorder:
    def __init__(self, metrics: Metrics, tracing: Tracing | None, *, stall_threshold: float, run_label: str = "",
                 capture_content: bool = False, models: ModelNames | None = None,
                 rejected_trace_rate: float = 10.0, stalls: StallRecords | None = None) -> None:
        self.metrics = metrics
        self.stalls = stalls  # live stall attribution; None: off
        self.models = models if models is not None else ModelNames()
        self.tracing = tracing
        self.stall_threshold = stall_threshold
        self.run_label = run_label
        self.capture_content = capture_content
        # refusals cost a client nothing to send: their traces are rate-limited, their counts are not
        self.refusal_traces = RateLimit(rejected_trace_rate)
        self._deferred: dict[Callable[[], None], asyncio.TimerHandle] = {}  # each pending completion, its timer

    def defer(self, seconds: float, complete: Callable[[], None]) -> None:
        """Run `complete` (the end of a request's record) in `seconds`, or at `flush()` if sooner;
        at once when no event loop runs."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            complete()
            return
        self._deferred[complete] = loop.call_later(seconds, self._run_deferred, complete)

    def _run_deferred(self, complete: Callable[[], None]) -> None:
        del self._deferred[complete]
        complete()

    def flush(self) -> None:
        """Complete every deferred record now (before the span exporter shuts down)."""
        for complete, handle in self._deferred.items():
            handle.cancel()
            complete()
        self._deferred.clear()

    def begin(self, *, route: str, operation: str, chat: bool, headers: Any, request_id: str, pd_mode: bool,
              deployment: str = "primary", parent_ids: TraceIds | None = None) -> RequestTrace:
        """Start recording a request; `parent_ids` puts a shadow request inside its primary's trace."""
        ids = None
        if self.tracing is not None:
            ids = self.tracing.child_ids(parent_ids) if parent_ids else self.tracing.new_ids(headers)
            if ids.tracestate_cut:
                self.metrics.tracestate_cut.labels(ids.tracestate_cut).inc()
        return RequestTrace(self, route, operation, chat, request_id, pd_mode, deployment, ids, headers)

    def forwarded(self, route: str, headers: Any, instance: str | None, status: int, start: int,
                  error_type: str | None = None, refused: bool = False) -> None:
        """One SERVER span for a request passed through to an instance as it is (`POST /tokenize`):
        no stages, no metrics; `start` on the telemetry clock, the end is now. `refused` (before
        admission): traced within --trace-rejected-rate, as refused inference requests are."""
        if self.tracing is None:
            return
        if refused and not self.refusal_traces.take():
            self.metrics.untraced_refusals.inc()
            return
        try:
            ids = self.tracing.new_ids(headers)
            if not ids.sampled:
                return
            attributes: dict[str, Any] = {"http.request.method": "POST", "http.route": route,
                                          "http.response.status_code": status}
            if instance:
                attributes[n.DECODE_INSTANCE] = instance
            if error_type:
                attributes["error.type"] = error_type
            self.tracing.emit([SpanData(f"POST {route}", KIND_SERVER, ids.trace_id, ids.root, ids.parent_span_id,
                                        to_unix_ns(start), to_unix_ns(now()), attributes,
                                        f"HTTP {status}" if status >= 500 else None, ids.tracestate,
                                        ids.parent_remote)])
        except Exception:  # telemetry must never break serving
            log.exception("could not record the span of %s", route)


class RequestTrace:
    """Everything known about one request while it is served."""

    def __init__(self, recorder: Recorder, route: str, operation: str, chat: bool, request_id: str, pd_mode: bool,
                 deployment: str, ids: TraceIds | None, headers: Any) -> None:
        self.recorder = recorder
        self.t = Timeline(received=now())
        self.route, self.operation, self.chat = route, operation, chat
        self.request_id = request_id
        self.pd_mode = pd_mode
        self.deployment = deployment
        self.ids = ids
        self._client_trace_headers = {} if ids else _trace_headers(headers)
        self.model: str | None = None  # as the client wrote it: never a label or span name as such
        self.model_label = OTHER  # what labels metrics and names spans (pdproxy/telemetry/models.py)
        # the request's sampling parameters: they repeat across requests, so they are part of the root span's
        # cached attributes (`_shape`); `request_attrs` are the root's others (seed, disaggregation)
        self.stream = False
        self.max_tokens: int | None = None
        self.temperature: int | float | None = None
        self.top_p: int | float | None = None
        self.request_attrs: dict[str, Any] = {}
        self.prefill_instance: str | None = None
        self.decode_instance: str | None = None
        self.prefill_attempts = self.decode_attempts = 0
        self.prefill_status: int | None = None
        self.decode_status: int | None = None
        self.kv_params: str | None = None
        self.routes: dict[str, Decision] = {}  # leg -> the decision that chose its instance
        self.decode_only = False  # selective disaggregation sent it straight to its decode
        self.scan = ResponseScan(chat)
        self.status = 200
        self.error_type: str | None = None
        self.error_message = ""
        self.failed_stage: str | None = None
        self._delivered = False  # the client has been given the whole answer
        self.finished: Measurement | None = None
        # migration (pdproxy/migration/): failed decode attempts, the moves they caused
        self.attempt_events: list[tuple[int, str, dict[str, Any]]] = []
        self.migrations: list[tuple[str, str]] = []  # (stage, reason)
        self.prefill_reruns = 0
        self.abandoned_handoffs: list[str] = []  # the prefill instance of each
        self.migration_refusal: str | None = None
        self._last_failure = "unknown"
        self._last_failed_at: str | None = None  # the decode of the last failed attempt
        self._prefill_failed_at: str | None = None  # the prefill of a failed attempt not yet followed by another
        self.prefill_events: list[tuple[int, str, dict[str, Any]]] = []  # failed attempts of the first prefill
        self._activity: tuple[InstanceRecord, Activity] | None = None  # its KV arrival or prefill (stalls.py)
        self.stall_marks: list[tuple[int, str]] = []  # (monotonic ns inside a gap, its cause), e.g. migration

    @property
    def prefill_leg(self) -> bool:
        """A prefill instance computes the prompt (P/D, not sent decode-only): the spans have a leg for it."""
        return self.pd_mode and not self.decode_only

    # -- what the flow reports --------------------------------------------------------------

    def leg_headers(self, leg: str, shared: dict[str, str] | None = None) -> dict[str, str]:
        """A leg's headers: `shared` (both legs') and the trace context, the leg span's own id, so vLLM's
        spans become its children. One dict built, not the context's and then both merged."""
        if self.ids is None:  # tracing off: the client's context passes through untouched (no copy without one)
            return {**(shared or {}), **self._client_trace_headers} if self._client_trace_headers else shared or {}
        # without a prefill leg, vLLM's one span covers the prompt too: a child of pd.prefill, as in single mode
        traceparent = self.ids.traceparent(leg == DECODE and self.prefill_leg)
        headers = {**shared, "traceparent": traceparent} if shared is not None else {"traceparent": traceparent}
        if self.ids.tracestate:
            headers["tracestate"] = self.ids.tracestate
        return headers

    def set_request(self, body: dict[str, Any]) -> None:
        if isinstance(body.get("model"), str):
            self.model = body["model"]
        self.stream = bool(body.get("stream"))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(limit, int) and not isinstance(limit, bool):
            self.max_tokens = limit
        self.temperature, self.top_p = _number(body.get("temperature")), _number(body.get("top_p"))
        seed = body.get("seed")
        if isinstance(seed, (int, float)) and not isinstance(seed, bool):
            self.request_attrs["gen_ai.request.seed"] = seed
        if self.recorder.capture_content:
            content = body.get("messages") if self.chat else body.get("prompt")
            self.request_attrs["gen_ai.input.messages"] = json.dumps(content)[:16384]

    def routed(self, leg: str, decision: Decision) -> None:
        """A policy chose the instance for `leg`: on its span and counted."""
        self.routes[leg] = decision
        metrics = self.recorder.metrics
        metrics.route_decision(leg, decision.policy, decision.reason)
        if decision.fallback is not None:
            for address in decision.fallback_at:
                metrics.route_fallback(leg, address, decision.fallback)

    def placed(self, placement: Any) -> None:
        """Where the request goes (pdproxy.routing.Placement): each leg's decision and the verdict, then admitted."""
        if placement.verdict is not None:
            self.disaggregation(placement.verdict)
        for leg, decision in placement.decisions.items():
            self.routed(leg, decision)
        self.admitted(placement.prefill.address if placement.prefill is not None else None, placement.decode.address)

    def disaggregation(self, verdict: Any) -> None:
        """Selective disaggregation's verdict (pdproxy.routing.Verdict): on the root span and counted."""
        self.decode_only = verdict.decode_only
        attrs = self.request_attrs
        attrs["pd.disaggregation"], attrs["pd.disaggregation.reason"] = verdict.decision, verdict.reason
        if verdict.uncached_tokens is not None:
            attrs["pd.disaggregation.uncached_tokens"] = verdict.uncached_tokens
        if verdict.held_tokens is not None:
            attrs["pd.disaggregation.held_tokens"] = verdict.held_tokens
        self.recorder.metrics.disaggregation(verdict.decision, verdict.reason)

    def admitted(self, prefill_address: str | None, decode_address: str) -> None:
        self.t.admitted = now()
        self.prefill_instance, self.decode_instance = prefill_address, decode_address
        if not self.prefill_leg:  # the decode computes the prompt itself
            self._activity_started("prefill", decode_address, self.t.admitted)

    def prefill_sent(self, address: str, tries: int) -> None:
        """A prefill attempt is sent (the request's `tries`-th): counted on its instance, and the failed
        one before it, if any, counted as moved away."""
        self.prefill_instance, self.prefill_attempts = address, tries  # also right when all fail
        if self._counts_attempts:
            counts = self.recorder.metrics.attempts
            if self._prefill_failed_at is not None:
                counts.moved_away(PREFILL, self._prefill_failed_at, "before_first_token")
            counts.attempt(PREFILL, address)
        self._prefill_failed_at = None

    def prefill_failed(self, address: str, tries: int, reason: str) -> None:
        """A prefill attempt failed (`reason`: its error type)."""
        self._prefill_failed_at = address
        if self._counts_attempts:
            self.recorder.metrics.attempts.attempt_failed(PREFILL, address, reason, False)
        events = self.prefill_events if self.t.prefill_done is None else self.attempt_events
        events.append((now(), n.PREFILL_ATTEMPT_EVENT, {
            n.PREFILL_ATTEMPT_NUMBER: tries, **_leg_attributes(address, "prefill", None), "error.type": reason}))

    def prefill_done(self, address: str, status: int, attempts: int, kv_params: str) -> None:
        self.t.prefill_done = now()
        self.prefill_instance, self.prefill_status, self.prefill_attempts = address, status, attempts
        self.kv_params = kv_params

    def decode_sent(self, address: str) -> None:
        self.t.decode_sent = now()
        self.decode_instance = address
        self.decode_attempts += 1
        if self._counts_attempts:
            self.recorder.metrics.attempts.attempt(DECODE, address)
        if self.prefill_leg:
            self._activity_started("kv_arrival", address, self.t.prefill_done or self.t.decode_sent)

    def decode_headers(self, status: int) -> None:
        self.t.decode_headers = now()
        self.decode_status = status

    def first_token(self) -> None:
        """The decode's first token (or whole answer) is in: the KV arrival or prefill it waited for
        has ended, and others' stalls no longer look it up among those going on."""
        if self.scan.first_token_ns is not None:
            self._end_activity(self.scan.first_token_ns, None)

    def decode_failed(self, address: str, reason: str, abandoned: str | None) -> None:
        """A decode attempt failed (`reason`: its error type); `abandoned`: the prefill instance whose
        hand-off it had and that is now given up."""
        self._last_failure, self._last_failed_at = reason, address
        if abandoned:
            self.abandoned_handoffs.append(abandoned)
        stage = "mid_stream" if self.scan.first_token_ns is not None else "before_first_token"
        if self._counts_attempts:
            self.recorder.metrics.attempts.attempt_failed(DECODE, address, reason, abandoned is not None)
        self.attempt_events.append((now(), n.ATTEMPT_EVENT, {
            n.ATTEMPT_NUMBER: self.decode_attempts, **_leg_attributes(address, "decode", None),
            n.MIGRATION_REASON: reason, n.MIGRATION_STAGE: stage, n.ABANDONED: abandoned is not None}))

    def handoff_abandoned(self, address: str | None, reason: str) -> None:
        """The request gave up the hand-off of prefill instance `address` (if any) without a decode
        pulling it: its blocks stay held there until vLLM's abort timeout. Put down to the decode that
        gave it up unless that decode refused the request as the client's mistake (`reason`
        client-caused, e.g. too many tokens): then no instance failed (and pdproxy/served.py refuses
        the requests it can foresee before their prefill)."""
        if address:
            self.abandoned_handoffs.append(address)
            if self._counts_attempts and self._last_failed_at is not None and reason not in CLIENT_CAUSED:
                self.recorder.metrics.attempts.handoff_abandoned(DECODE, self._last_failed_at)

    def migrating(self, stage: str, address: str) -> None:
        """Another decode attempt starts in place of the last failed one."""
        self.migrations.append((stage, self._last_failure))
        if self._counts_attempts and self._last_failed_at is not None:
            self.recorder.metrics.attempts.moved_away(DECODE, self._last_failed_at, stage)
        if stage == "mid_stream":
            self.mark_stall("migration")  # the gap this splice leaves is the migration's doing

    def prefill_rerun(self, address: str) -> None:
        self.prefill_reruns += 1
        self.attempt_events.append((now(), n.PREFILL_RERUN_EVENT, _leg_attributes(address, "prefill", None)))

    def mark_stall(self, cause: str) -> None:
        """The gap the stream is in now has a known cause (a migration's splice): attribution keeps it."""
        self.stall_marks.append((now(), cause))

    def fail(self, status: int, error_type: str, message: str) -> None:
        """The request failed in whichever stage is open now; the first failure is the one reported."""
        if self.error_type is not None:
            return
        self.status, self.error_type, self.error_message = status, error_type, message
        self.failed_stage = self._open_stage()

    def delivered(self) -> None:
        """The end of the answer (`[DONE]`) reached the client."""
        self._delivered = True

    def client_gone(self) -> None:
        if self._delivered:
            return  # a client that hangs up after the whole answer (e.g. right after [DONE]) was served
        self.fail(CLIENT_CLOSED, "client_disconnect", "client closed the connection")

    def finish(self) -> Measurement:
        """Close the timeline and write spans and metrics; safe to call more than once."""
        if self.finished is not None:
            return self.finished
        self.t.end = now()
        self.t.first_token = self.scan.first_token_ns
        if self.scan.error is not None and self.error_type is None:
            # the instance reported an error inside a stream that had already started
            message = str(self.scan.error.get("message", "error event in stream"))
            self.fail(self.status, "stream_error", message)
        m = measure(self.t, pd_mode=self.pd_mode, status=self.status, failed_stage=self.failed_stage,
                    error_type=self.error_type, chunk_times=self.scan.chunk_times, chunk_tokens=self.scan.chunk_tokens,
                    usage=self.scan.usage, server_metrics=self.scan.server_metrics,
                    stall_threshold=self.recorder.stall_threshold)
        self.finished = m
        models = self.recorder.models
        answered = self.scan.response_model if m.ok else None  # picks among known names, never adds one
        self.model_label = models.label(self.model, answered)
        self._end_activity(self.t.first_token or self.t.end or now(), m.input_tokens)
        traced = self.ids is not None and self.ids.sampled and self._trace_allowed(m)
        trace_id = self.ids.trace_hex if traced and self.ids is not None else None
        mode = "pd" if self.pd_mode else "single"
        if self.decode_only:  # its prompt was computed on the decode: not a prefill leg's duration
            m.stages = {k: v for k, v in m.stages.items() if k != PREFILL}
        self.recorder.metrics.record(m, self.route, self.model_label, mode, self.deployment, trace_id)
        if self.migrations or self.abandoned_handoffs:
            self.recorder.metrics.migrated(self.migrations, self.abandoned_handoffs)
        wait = self._attribution_wait(m)
        if wait > 0:
            self.recorder.defer(wait, lambda: self._complete(m, traced, trace_id, mode))
        else:
            self._complete(m, traced, trace_id, mode)
        return m

    def _complete(self, m: Measurement, traced: bool, trace_id: str | None, mode: str) -> None:
        """Its stalls' causes, then its spans (the pd.stall events carry the causes) and stall metrics."""
        stalls = self._attribute_stalls(m)
        if traced and self.ids is not None:
            try:
                self._emit_spans(self.ids, m, stalls)
            except Exception:  # telemetry must never break serving
                log.exception("could not record spans for request %s", self.request_id)
        if stalls:
            self.recorder.metrics.record_stalls(stalls, mode, self.deployment, self.decode_instance, trace_id)

    def _attribution_wait(self, m: Measurement) -> float:
        """Seconds until the rule's window around its last stall has closed (stalls.TOLERANCE past the
        gap's end, at the latest its last event): an activity that starts within the tolerance after
        the stall counts for it, offline as live, and a stream that ends right after a stall would
        otherwise be attributed before such an activity could be seen. 0: attribute now."""
        if not m.stalls or self.recorder.stalls is None or not self.scan.chunk_times:
            return 0.0
        return (self.scan.chunk_times[-1] + TOLERANCE_NS - now()) / 1e9

    # -- internals ----------------------------------------------------------------------

    @property
    def _counts_attempts(self) -> bool:
        """The primary's attempts go to the per-instance counters; the shadow's instances are not configured."""
        return self.deployment == "primary"

    def _trace_allowed(self, m: Measurement) -> bool:
        """Requests refused before admission (401, 400, 413, 503 ...) are traced within the rate limit."""
        if m.ok or self.t.admitted is not None or self.recorder.refusal_traces.take():
            return True
        self.recorder.metrics.untraced_refusals.inc()
        return False

    def _activity_started(self, kind: str, address: str, start: int | None) -> None:
        """Its KV arrival (P/D decode) or prefill (single) began on `address`: others' stalls may be its doing."""
        records = self.recorder.stalls
        if records is None or start is None:
            return
        self._end_activity(now(), None)  # an earlier decode attempt's
        ids = self.ids if self.ids is not None and self.ids.sampled else None
        at = DECODE_ID if kind == "kv_arrival" else PREFILL_ID
        self._activity = records.begin(kind, address, self.request_id, start, ids.raw[:16] if ids else None,
                                       ids.raw[at:at + 8] if ids else None, self.scan)

    def _end_activity(self, end: int, tokens: int | None) -> None:
        """Its KV arrival or prefill ended (at its first token, else `end`); again later only to add
        its prompt tokens, known once the request has ended."""
        if self._activity is not None:
            record, activity = self._activity
            record.end(activity, end, tokens)

    def _attribute_stalls(self, m: Measurement) -> list[Attributed]:
        """Each of its stalls put down to what its instance was doing."""
        records = self.recorder.stalls
        if records is None or not m.stalls:
            return []
        gaps = stall_gaps(self.scan.chunk_times, self.scan.chunk_tokens, self.recorder.stall_threshold,
                          n.MAX_ATTRIBUTED_STALLS)
        return records.attribute(self.decode_instance, self.request_id, gaps, self.stall_marks)

    def _open_stage(self) -> str:
        t = self.t
        if t.admitted is None:
            return QUEUE
        if self.scan.first_token_ns is not None:
            return DECODE
        if self.pd_mode and t.prefill_done is not None:
            return KV_TRANSFER
        return PREFILL

    def _emit_spans(self, ids: TraceIds, m: Measurement, stalls: list[Attributed]) -> None:
        """The request's spans, encoded straight from its fields: what its spans share (trace id, context,
        each time where one stage ends and the next starts) encoded once, what repeats across requests
        (`_shape`) looked up ready encoded."""
        t = self.t
        end = t.end if t.end is not None else t.received  # finish() has set it
        error = self.error_message if not m.ok else None
        reason = _one_reason(self.scan.finish_reasons)
        itl = _has_itl(m)
        shape = self._shape(m, error is not None, reason, itl)
        raw = ids.raw
        trace, root = trace_field(raw[:16]), raw[ROOT_ID:ROOT_ID + 8]
        received, finished = fixed64(to_unix_ns(t.received)), fixed64(to_unix_ns(end))
        root_fields = self._root_fields(m, shape.root, reason, itl)
        spans = [span_field(trace, root, context_fields(ids.tracestate, ids.parent_span), shape.head, received,
                            finished, root_fields, status_tail(error, ids.parent_remote))]
        context = context_fields(ids.tracestate, root)  # every stage span's: a child of the root
        bounds = m.bounds
        if self.prefill_leg and t.decode_sent is not None and DECODE not in bounds:
            bounds = {**bounds, DECODE: (end, end)}  # the decode leg was sent: keep vLLM's span's parent in the trace
        edge, edge_time = t.received, received  # where the last stage ended: the next one starts there
        for stage, (start, stop) in bounds.items():
            leg: str | None = None
            if stage == PREFILL:
                leg = PREFILL if self.prefill_leg else DECODE
            elif stage == DECODE:
                leg = DECODE
            decision = self.routes.get(leg) if leg is not None else None
            measured = self._stage_measurements(decision) if decision is not None else []
            events: list[tuple[int, str, dict[str, Any]]] | None = None
            links = None
            if stage == PREFILL and self.prefill_events:
                events = [(to_unix_ns(at), label, attrs) for at, label, attrs in self.prefill_events]
            if stage == DECODE and (self.attempt_events or m.stalls or stalls):
                events = [(to_unix_ns(at), label, attrs) for at, label, attrs in self.attempt_events]
                if m.stalls:
                    events += self._stall_events(stalls)
                if stalls:
                    links = span_links(stalls, n.MAX_STALL_LINKS)
                    measured += _stall_times(stalls).items()
            tail = _OK_TAIL
            if stage == m.failed_stage:
                measured.append(("error.type", m.error_type))
                tail = status_tail(self.error_message, False)
            if events or links:
                tail = events_field(events) + links_field(links) + tail
            head, at, fields = shape.stages[stage]
            if stage == KV_TRANSFER:
                fields = fields + _handoff_fields(m)  # not +=: compiled, `+` of bytes is a direct concat
            if measured:
                fields = fields + attribute_fields(measured)
            begin = edge_time if start == edge else fixed64(to_unix_ns(start))
            close = finished if stop == end else fixed64(to_unix_ns(stop))
            edge, edge_time = stop, close
            spans.append(span_field(trace, raw[at:at + 8], context, head, begin, close, fields, tail))
        if self.recorder.tracing is not None:  # it is whenever there are ids
            self.recorder.tracing.emit_encoded(spans)

    def _stall_events(self, stalls: list[Attributed]) -> list[tuple[int, str, dict[str, Any]]]:
        """Each stall's time and length on pd.decode (the longest ones), with its cause when attributed."""
        if not stalls:
            gaps = stall_gaps(self.scan.chunk_times, self.scan.chunk_tokens, self.recorder.stall_threshold,
                              n.MAX_STALL_EVENTS)
            marked = ((start, gap, k, marked_cause(start, gap, self.stall_marks)) for start, gap, k in gaps)
            return [(to_unix_ns(start), n.STALL_EVENT, {n.STALL_DURATION: gap, n.STALL_TOKENS: k,
                                                        **({n.STALL_CAUSE: cause} if cause else {})})
                    for start, gap, k, cause in marked]
        if len(stalls) > n.MAX_STALL_EVENTS:
            stalls = sorted(sorted(stalls, key=lambda s: -s.duration)[:n.MAX_STALL_EVENTS], key=lambda s: s.start)
        return [(to_unix_ns(s.start), n.STALL_EVENT, {
            n.STALL_DURATION: s.duration, n.STALL_TOKENS: s.tokens, n.STALL_CAUSE: s.cause,
            n.STALL_CULPRITS: len(s.culprits), **_culprit_ids(s)}) for s in stalls]

    def _shape(self, m: Measurement, failed: bool, reason: str | None, itl: bool) -> _Shape:
        """What the request's spans share with others like it (operation, model, mode, instances,
        statuses, sampling parameters, routing, a one-word finish reason ...), encoded once per distinct
        set and looked up by everything it is made of, in one lookup a request."""
        prefill = self.routes.get(PREFILL if self.prefill_leg else DECODE)
        decode = self.routes.get(DECODE)
        # flat: a nested tuple would be built, hashed and compared item by item each time. The sampling
        # parameters' types too: 1 == 1.0, but they encode differently
        prefill_policy, prefill_reason, prefill_fallback = _decision_parts(prefill)
        decode_policy, decode_reason, decode_fallback = _decision_parts(decode)
        key = (self.operation, self.model_label, self.pd_mode, self.deployment, m.status, self.recorder.run_label,
               self.prefill_instance, self.decode_instance, m.failed_stage, self.kv_params, self.stream,
               self.max_tokens, self.temperature, type(self.temperature), self.top_p, type(self.top_p), reason,
               m.itl_unit if itl else None, m.error_type if failed else None, self.decode_only, self.prefill_status,
               self.prefill_attempts, self.decode_status, self.decode_attempts, prefill_policy, prefill_reason,
               prefill_fallback, decode_policy, decode_reason, decode_fallback)
        shape = _SHAPES.get(key)
        if shape is None:
            # semconv's `{operation} {model}` for a known model; the operation alone otherwise (bounded names)
            name = self.operation if self.model_label == OTHER else f"{self.operation} {self.model_label}"
            root = attribute_fields(self._repeating_root_attributes(m, reason, itl, failed).items())
            decisions = {PREFILL: prefill, DECODE: decode}
            stages = {stage: (head, at, self._stage_block(stage, decisions.get(stage)))
                      for stage, (head, at) in _STAGE_SPANS.items()}
            shape = _Shape(span_head(name, KIND_SERVER), root, stages)
            if len(_SHAPES) < _SHAPES_MAX:
                _SHAPES[key] = shape
        return shape

    def _root_fields(self, m: Measurement, fields: bytes, reason: str | None, itl: bool) -> bytes:
        """The root span's attributes, encoded: those that repeat across requests (`fields`, from
        `_shape`), then the request's own, each key's prefix ready (`otlp.IntField` ...). One `%` of
        bytes operands, an absent attribute an empty one: compiled, one allocation and its copies, no
        list appended to and joined."""
        scan = self.scan
        reasons = scan.finish_reasons
        return b"%b%b%b%b%b%b%b%b%b%b%b%b%b" % (
            fields, _REQUEST_ID.encode(self.request_id), _CHUNKS.encode(m.chunks), _root_times(m, itl),
            _ITL_COUNT.encode(len(m.gaps)) if itl else b"", _STALLS.encode(m.stalls) if itl else b"",
            attribute_fields(self.request_attrs.items()) if self.request_attrs else b"",
            _MIGRATIONS.encode(len(self.migrations)) if self.decode_attempts else b"", self._rare_root_fields(),
            _RESPONSE_ID.encode(scan.response_id) if scan.response_id is not None else b"",
            _INPUT_TOKENS.encode(m.input_tokens) if m.input_tokens is not None else b"",
            _OUTPUT_TOKENS.encode(m.output_tokens) if m.output_tokens is not None else b"",
            words_attribute(_FINISH_REASONS, reasons) if reasons and reason is None else b"")

    def _rare_root_fields(self) -> bytes:
        """The root span's attributes of what seldom happens: prefills run again, hand-offs given up, a
        migration refused, a model name not among the known ones."""
        a = []
        if self.prefill_reruns:
            a.append(int_attribute(n.PREFILL_RERUNS, self.prefill_reruns))
        if self.abandoned_handoffs:
            a.append(int_attribute(n.HANDOFFS_ABANDONED, len(self.abandoned_handoffs)))
        if self.migration_refusal:
            a.append(str_attribute(n.MIGRATION_INELIGIBLE, self.migration_refusal))
        if self.model is not None and self.model != self.model_label:
            # for reading the trace; no collector keys on it
            a.append(str_attribute(n.REQUESTED_MODEL, self.model[:MAX_NAME_LENGTH]))
        return b"".join(a) if a else b""

    def _repeating_root_attributes(self, m: Measurement, reason: str | None, itl: bool, failed: bool) -> dict[str, Any]:
        a: dict[str, Any] = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.provider.name": "vllm",
            "gen_ai.request.model": self.model_label,
            n.MODE: "pd" if self.pd_mode else "single",
            n.DEPLOYMENT: self.deployment,
            "http.response.status_code": m.status,
        }
        if self.recorder.run_label:
            a[n.RUN] = self.recorder.run_label
        repeating = {
            n.PREFILL_INSTANCE: self.prefill_instance,
            n.DECODE_INSTANCE: self.decode_instance,
            n.FAILED_STAGE: m.failed_stage,
            n.KV_PARAMS: self.kv_params,
        }
        a.update({k: v for k, v in repeating.items() if v is not None})
        a["gen_ai.request.stream"] = self.stream
        sampling = {"gen_ai.request.max_tokens": self.max_tokens, "gen_ai.request.temperature": self.temperature,
                    "gen_ai.request.top_p": self.top_p}
        a.update({k: v for k, v in sampling.items() if v is not None})
        if reason is not None:
            a[_FINISH_REASONS] = [reason]
        if itl:
            a[n.ITL_UNIT] = m.itl_unit
        if failed:
            a["error.type"] = m.error_type
        return a

    def _stage_block(self, stage: str, decision: Decision | None) -> bytes:
        """A stage span's attributes that repeat across requests (see `_shape`): every stage span
        names its model and deployment (span-derived metrics split like the proxy's), its instance and
        status, and the policy that chose the instance and why."""
        address: str | None
        status: int | None
        attempts: int | None
        if stage == PREFILL:
            address, status, attempts = self.prefill_instance, self.prefill_status, max(self.prefill_attempts, 1)
            if not self.prefill_leg:  # the decode computed the prompt: its leg, no prefill attempts
                address, status, attempts = self.decode_instance, self.decode_status, None
        elif stage == DECODE:
            address, status, attempts = self.decode_instance, self.decode_status, self.decode_attempts
        else:
            address = status = attempts = None
        policy: str | None = None
        reason: str | None = None
        fallback: str | None = None
        if decision is not None:
            policy, reason, fallback = decision.policy, decision.reason, decision.fallback
        attrs = self._stage_attributes(stage, address, status, attempts, policy, reason)
        if fallback is not None:
            attrs[n.ROUTE_FALLBACK_REASON] = fallback
        if stage == PREFILL and self.pd_mode and self.decode_only:
            attrs[n.PREFILL_ON_DECODE] = True
        return attribute_fields(attrs.items())

    def _stage_attributes(self, stage: str, address: str | None, status: int | None, attempts: int | None,
                          policy: str | None, reason: str | None) -> dict[str, Any]:
        attrs: dict[str, Any] = {"gen_ai.request.model": self.model_label, n.DEPLOYMENT: self.deployment}
        if stage in (PREFILL, DECODE):
            attrs.update(_leg_attributes(address, "prefill" if stage == PREFILL else "decode", status))
            if attempts is not None:
                attrs[n.PREFILL_ATTEMPTS if stage == PREFILL else n.DECODE_ATTEMPTS] = attempts
        elif stage == KV_TRANSFER:
            attrs[n.KV_DEFINITION] = "upper_bound"
        if policy is not None:
            attrs[n.ROUTE_POLICY], attrs[n.ROUTE_REASON] = policy, reason
        return attrs

    @staticmethod
    def _stage_measurements(decision: Decision) -> list[tuple[str, Any]]:
        """A leg span's attributes of this request alone (after the KV hand-off's times: `_handoff_fields`):
        the routing decision's scores and matched prefix."""
        attrs: list[tuple[str, Any]] = []
        if decision.matched is not None:
            attrs += ((n.ROUTE_MATCHED, decision.matched), (n.ROUTE_MATCHED_UNIT, decision.unit))
        if decision.compared:  # no instances compared, no scores
            scores = decision.scores()
            if scores:
                attrs.append((n.ROUTE_SCORES, [f"{address}={score:g}" for address, score in scores.items()]))
        return attrs


_ITL_KEYS: Final = (n.ITL_MEAN, n.ITL_P50, n.ITL_P99, n.ITL_MAX)
_TTFT: Final = "gen_ai.response.time_to_first_chunk"
_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
# the root span's attributes of each request, their keys' encodings ready
_ROOT_TIMES: Final = DoubleFields((n.E2E, _TTFT, n.TPOT, *_ITL_KEYS))
_REQUEST_ID: Final = StrField(n.REQUEST_ID)
_RESPONSE_ID: Final = StrField("gen_ai.response.id")
_CHUNKS: Final = IntField(n.CHUNKS)
_ITL_COUNT: Final = IntField(n.ITL_COUNT)
_STALLS: Final = IntField(n.STALLS)
_MIGRATIONS: Final = IntField(n.MIGRATIONS)
_INPUT_TOKENS: Final = IntField("gen_ai.usage.input_tokens")
_OUTPUT_TOKENS: Final = IntField("gen_ai.usage.output_tokens")


class _Shape:
    """What a request's spans share with every request alike (`RequestTrace._shape`), encoded: the root
    span's name and kind, the root's repeating attributes, and each stage span's name and kind, where its
    id is (`_STAGE_SPANS`) and its repeating attributes."""

    def __init__(self, head: bytes, root: bytes, stages: dict[str, tuple[bytes, int, bytes]]) -> None:
        self.head = head
        self.root = root
        self.stages = stages


_SHAPES: Final[dict[tuple, _Shape]] = {}  # by what they are made of, bounded
_SHAPES_MAX: Final = 4096


def _root_times(m: Measurement, itl: bool) -> bytes:
    """The root span's times: a stream's usual seven in one pack, else each one measured."""
    ttft, tpot = m.ttft, m.tpot
    mean, p50, p99, most = m.itl_mean, m.itl_p50, m.itl_p99, m.itl_max
    if itl and ttft is not None and tpot is not None and mean is not None and p50 is not None and p99 is not None \
            and most is not None:
        return _ROOT_TIMES.seven(m.e2e, ttft, tpot, mean, p50, p99, most)
    a = [float_attribute(n.E2E, m.e2e)]
    if ttft is not None:
        a.append(float_attribute(_TTFT, ttft))
    if tpot is not None:
        a.append(float_attribute(n.TPOT, tpot))
    if itl and mean is not None and p50 is not None and p99 is not None and most is not None:
        a.append(four_doubles(_ITL_KEYS, mean, p50, p99, most))
    return b"".join(a)


def _decision_parts(decision: Decision | None) -> tuple[str | None, str | None, str | None]:
    """A decision's policy, reason and fallback reason (a fixed-size tuple: compiled, not an object)."""
    if decision is None:
        return None, None, None
    return decision.policy, decision.reason, decision.fallback


def _one_reason(reasons: list[str]) -> str | None:
    """The usual one short finish reason, which is part of the root's repeating attributes; more, or
    longer, are encoded each time."""
    return reasons[0] if len(reasons) == 1 and len(reasons[0]) <= 32 else None


def _has_itl(m: Measurement) -> bool:
    """Whether the request has its ITL summary (measure() sets it all together)."""
    return bool(m.gaps) and m.itl_mean is not None and m.itl_p50 is not None and m.itl_p99 is not None \
        and m.itl_max is not None

_HANDOFF_KEYS: Final = (n.HANDOFF_GAP, n.DECODE_HEADERS_WAIT, n.DECODE_QUEUE_TIME, n.KV_ESTIMATED)


def _handoff_fields(m: Measurement) -> bytes:
    """The KV hand-off's times on pd.kv_transfer (doubles: measure() divides), those measured: all four (a
    decode that reports its queue time) or the other three in one pack, else one by one."""
    gap, wait, queued, estimated = m.handoff_gap, m.decode_headers_wait, m.decode_queue_time, m.kv_estimated
    if gap is not None and wait is not None and estimated is not None:
        if queued is not None:
            return four_doubles(_HANDOFF_KEYS, gap, wait, queued, estimated)
        return _HANDOFF_THREE.three(gap, wait, estimated)
    fields = b""
    if gap is not None:
        fields += float_attribute(n.HANDOFF_GAP, gap)
    if wait is not None:
        fields += float_attribute(n.DECODE_HEADERS_WAIT, wait)
    if queued is not None:
        fields += float_attribute(n.DECODE_QUEUE_TIME, queued)
    if estimated is not None:
        fields += float_attribute(n.KV_ESTIMATED, estimated)
    return fields


_HANDOFF_THREE: Final = DoubleFields((n.HANDOFF_GAP, n.DECODE_HEADERS_WAIT, n.KV_ESTIMATED))


def _culprit_ids(stall: Attributed) -> dict[str, list[str]]:
    ids = [a.request_id for a in stall.culprits[:n.MAX_STALL_CULPRIT_IDS]]
    return {n.STALL_CULPRIT_IDS: ids} if ids else {}


def _stall_times(stalls: list[Attributed]) -> dict[str, float | int]:
    """The request's stall seconds and stalls per cause: what the collector sums by cause."""
    out: dict[str, float | int] = {}
    for s in stalls:
        seconds, count = n.STALL_TIME + s.cause, n.STALL_COUNT + s.cause
        out[seconds] = out.get(seconds, 0.0) + s.duration
        out[count] = out.get(count, 0) + 1
    return out


def _number(value: Any) -> int | float | None:
    """A sampling parameter as the client sent it, if a number (1 and 1.0 kept apart: they encode differently)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _leg_attributes(address: str | None, phase: str, status: int | None) -> dict[str, Any]:
    attrs: dict[str, Any] = {"vllm.request_phase": phase}
    if address:
        host, _, port = address.rpartition(":")
        attrs["server.address"], attrs["server.port"] = host, int(port)
    if status is not None:
        attrs["http.response.status_code"] = status
    return attrs


def _trace_headers(headers: Any) -> dict[str, str]:
    return {k: headers[k] for k in ("traceparent", "tracestate") if headers is not None and k in headers}


class RateLimit:
    """A token bucket: at most `rate` per second on average, in bursts of up to max(rate, 1); 0 allows none."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = max(rate, 1.0) if rate > 0 else 0.0
        self.tokens = self.burst
        self.stamp = now()

    def take(self) -> bool:
        t = now()
        self.tokens = min(self.burst, self.tokens + (t - self.stamp) / 1e9 * self.rate)
        self.stamp = t
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
