"""vLLM's own request spans inside the proxy's traces, and the split of each stage they allow.

vLLM started with `--otlp-traces-endpoint` exports one `llm_request` span (kind SERVER) per
request, created when the request ends and back-dated to its arrival at vLLM's API server. With
the `traceparent` the proxy sends on each leg, it is a child of `pd.prefill` or `pd.decode`
(single mode: of `pd.prefill`). Its `gen_ai.latency.*` attributes are vLLM's own intervals
(vllm/v1/engine/output_processor.py, `do_tracing`):

* time_in_queue = scheduled − queued (engine core). On a P/D decode the request waits, unscheduled,
  until the remote KV has been pulled, so this includes the KV transfer (NIXL pull).
* time_in_model_prefill = first token − scheduled: the prefill compute; on a P/D decode, the first
  step after the KV arrived.
* time_in_model_decode = last token − first token; time_in_model_inference = last token − scheduled.
* time_to_first_token = first token − arrival; e2e = finish − arrival (arrival: the API server).

Where those timestamps come from (vLLM 0.23, docs/reference/telemetry.md has the details): arrival is the
API server's wall clock when it starts rendering the prompt (vllm/renderers/base.py); queued is the
engine core's QUEUED event, when its busy loop takes the request off its input queue and hands it
to the scheduler (between two engine steps); scheduled is the first SCHEDULED event. A P/D decode
request goes QUEUED -> WAITING_FOR_REMOTE_KVS (no SCHEDULED event) -> WAITING once the connector
reports the KV received -> SCHEDULED: time_in_queue holds the whole KV pull, and the time before
QUEUED (API server, engine-core input) is in time_to_first_token but in neither of the other two.

The split puts the proxy's stage spans and these intervals together. kv_transfer is split five
ways: the proxy's measured hand-off (`pd.handoff.gap`), the decode's intake (vLLM's
time_to_first_token − time_in_queue − time_in_model_prefill: on the decode instance, from its API
server's arrival to its engine core's queueing, plus the first token's way back to its API server),
the KV wait, the first step, and HTTP (the rest: proxy→decode request and first token back). The
other stages' remainders (the stage minus vLLM's parts) are time outside vLLM's engine: HTTP between
proxy and instance, vLLM's API server (request parsing, tokenization, detokenization), the proxy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdproxy.bench.otlpjson import attrs_of, unix_s
from pdproxy.telemetry.names import ATTEMPT_EVENT, HANDOFF_GAP

ENGINE_SPAN = "llm_request"

# (stage, part) in the order a request goes through them
PARTS: tuple[tuple[str, str], ...] = (
    ("prefill", "overhead"), ("prefill", "queue"), ("prefill", "compute"),
    ("kv_transfer", "failed_attempts"), ("kv_transfer", "handoff"), ("kv_transfer", "decode_intake"),
    ("kv_transfer", "kv_wait"), ("kv_transfer", "first_step"), ("kv_transfer", "http"),
    ("decode", "compute"), ("decode", "relay"),
    ("prefill", "overlap"), ("kv_transfer", "overlap"), ("decode", "overlap"),
)
# The parts that are a remainder (the stage less vLLM's intervals). Such a remainder below zero is not
# time: vLLM's interval and the proxy's span start or end at different events, so they overlap. It is
# given as the stage's `overlap` part (subtracted), never as a negative component.
REMAINDERS = ("prefill.overhead", "kv_transfer.decode_intake", "kv_transfer.http", "decode.relay")
PART_LABELS = {
    "prefill.overhead": "proxy→instance overhead", "prefill.queue": "prefill queue",
    "prefill.compute": "prefill compute", "kv_transfer.handoff": "proxy hand-off (measured)",
    "kv_transfer.failed_attempts": "failed decode attempts (moved away)",
    "kv_transfer.decode_intake": "decode's intake before its engine queue",
    "kv_transfer.kv_wait": "decode's wait for the KV", "kv_transfer.first_step": "first decode step",
    "kv_transfer.http": "HTTP proxy↔decode (the rest)",
    "decode.compute": "decode compute", "decode.relay": "proxy relay",
    "prefill.overlap": "overlap (subtracted)", "kv_transfer.overlap": "overlap (subtracted)",
    "decode.overlap": "overlap (subtracted): vLLM decoding before pd.decode began",
}
OVERLAP_DEFINITION = (
    "(subtracted) a stage's parts are the proxy's span and vLLM's intervals, measured between different "
    "events, so a remainder (overhead, intake, HTTP, relay) can come out below zero; that much of vLLM's interval "
    "lies outside the proxy's span, and it is given as the stage's overlap, subtracted, never as a negative part. "
    "The usual one is the decode's: vLLM's time_in_model_decode runs from its first token to its last, pd.decode "
    "from when the proxy received the first token to the end of the stream, so when the first token took longer "
    "to reach the proxy than the last (it is counted in kv_transfer's HTTP, or single mode's prefill), vLLM's "
    "decode began that much before pd.decode did (recorded vLLM 0.23 runs: up to 10 ms)"
)
SPLIT_DEFINITION = (
    "rows 'vLLM split: stage.part'; from vLLM's llm_request spans (children of pd.prefill / pd.decode; single mode: one span under "
    "pd.prefill) and their gen_ai.latency.* attributes: prefill = proxy→instance overhead (the rest: HTTP, "
    "vLLM's API server, tokenization) + prefill queue (time_in_queue) + prefill compute "
    "(time_in_model_prefill); kv_transfer = [failed decode attempts, for a request moved to another decode: "
    "up to its last pd.decode.attempt_failed event] + proxy hand-off (measured: pd.handoff.gap, after a failed "
    "attempt its backoff and re-prefill) + decode's intake "
    "before its engine queue (on the decode, not the proxy: its time_to_first_token − time_in_queue − "
    "time_in_model_prefill, i.e. API server arrival → engine-core QUEUED, plus the first token's way back to "
    "its API server) + decode's wait for the KV (its time_in_queue, the NIXL pull included) + first decode "
    "step (its time_in_model_prefill) + HTTP proxy↔decode (the rest); "
    "decode = decode compute (time_in_model_decode) + proxy relay (the rest); a rest below zero is an overlap "
    "(below). Requests without vLLM spans have only the proxy's stages."
)


@dataclass
class SpanEvent:
    time: float  # unix seconds
    name: str
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineSpan:
    """One instance's account of one request (vLLM's `llm_request`)."""

    service: str
    instance: str  # service.instance.id: one vLLM process
    start: float  # arrival at vLLM's API server, unix seconds
    end: float
    request_id: str  # gen_ai.request.id
    queue: float | None
    prefill: float | None
    decode: float | None
    ttft: float | None
    e2e: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    attrs: dict[str, Any] = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)

    @property
    def first_token(self) -> float | None:
        """When vLLM produced the first token (its frontend's clock)."""
        return None if self.ttft is None else self.start + self.ttft

    @property
    def scheduled(self) -> float | None:
        """When the engine first scheduled the request: on a P/D decode, when the KV had arrived."""
        ft = self.first_token
        return None if ft is None or self.prefill is None else ft - self.prefill


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def span_events(sp: dict[str, Any]) -> list[SpanEvent]:
    return [SpanEvent(unix_s(e.get("timeUnixNano")), str(e.get("name", "")), attrs_of(e.get("attributes")))
            for e in sp.get("events") or [] if isinstance(e, dict)]


def engine_span(sp: dict[str, Any], resource: dict[str, Any]) -> EngineSpan:
    a = attrs_of(sp.get("attributes"))
    tokens = {k: a.get(f"gen_ai.usage.{k}") for k in ("prompt_tokens", "completion_tokens")}
    return EngineSpan(
        service=str(resource.get("service.name", "")), instance=str(resource.get("service.instance.id", "")),
        start=unix_s(sp.get("startTimeUnixNano")), end=unix_s(sp.get("endTimeUnixNano")),
        request_id=str(a.get("gen_ai.request.id", "")), queue=_num(a.get("gen_ai.latency.time_in_queue")),
        prefill=_num(a.get("gen_ai.latency.time_in_model_prefill")),
        decode=_num(a.get("gen_ai.latency.time_in_model_decode")),
        ttft=_num(a.get("gen_ai.latency.time_to_first_token")), e2e=_num(a.get("gen_ai.latency.e2e")),
        prompt_tokens=tokens["prompt_tokens"] if isinstance(tokens["prompt_tokens"], int) else None,
        completion_tokens=tokens["completion_tokens"] if isinstance(tokens["completion_tokens"], int) else None,
        attrs=a, events=span_events(sp))


def expected_request_ids(request_id: str) -> set[str]:
    """vLLM's id for a request sent with X-Request-Id: `cmpl-<id>-0` (chat: `chatcmpl-<id>`)."""
    return {f"cmpl-{request_id}-0", f"chatcmpl-{request_id}", f"chatcmpl-{request_id}-0"}


def split(info: Any) -> dict[str, float]:
    """`stage.part` → seconds, for the parts this request's spans allow (empty without vLLM spans)."""
    out: dict[str, float] = {}
    stages, engine = info.stages, info.engine
    single = str(info.attrs.get("pd.mode")) == "single"
    first = engine.get("prefill")
    if first is not None and "prefill" in stages and first.queue is not None and first.prefill is not None:
        out["prefill.queue"], out["prefill.compute"] = first.queue, first.prefill
        out["prefill.overhead"] = stages["prefill"] - first.queue - first.prefill
    last = first if single else engine.get("decode")
    if last is None:
        return _overlaps(out)
    if not single and "kv_transfer" in stages and last.queue is not None and last.prefill is not None:
        out.update(_kv_split(stages["kv_transfer"], handoff(info), last))
    if "decode" in stages and last.decode is not None:
        out["decode.compute"] = last.decode
        out["decode.relay"] = stages["decode"] - last.decode
    return _overlaps(out)


def _overlaps(parts: dict[str, float]) -> dict[str, float]:
    """Each remainder below zero moved to its stage's `overlap` (REMAINDERS); every stage with vLLM's parts
    has one, zero when nothing overlaps, so its percentiles are over the same requests as the others'."""
    for stage in {k.split(".")[0] for k in parts if k in REMAINDERS}:
        parts.setdefault(f"{stage}.overlap", 0.0)
    for key in REMAINDERS:
        if parts.get(key, 0.0) < 0:
            stage = key.split(".")[0]
            parts[f"{stage}.overlap"] += -parts[key]
            parts[key] = 0.0
    return parts


def handoff(info: Any) -> tuple[float | None, float | None]:
    """(the proxy's own hand-off, time lost on failed decode attempts) of a P/D request, from its trace.

    `pd.handoff.gap` runs from the prefill's answer to the last decode attempt's request; for a request
    moved off a failed decode it holds the failed attempts (up to the last pd.decode.attempt_failed
    event), which are not the proxy's: they are given apart. (None, None) without the attribute."""
    gap = _num((info.stage_attrs.get("kv_transfer") or {}).get(HANDOFF_GAP))
    if gap is None:
        return None, None
    failed = [e.time for e in info.stage_events.get("decode") or [] if e.name == ATTEMPT_EVENT]
    if not failed or "kv_transfer" not in info.stage_times:
        return gap, None
    lost = min(max(0.0, max(failed) - info.stage_times["kv_transfer"][0]), gap)
    return gap - lost, lost


def _kv_split(stage: float, handoff: tuple[float | None, float | None], decode: EngineSpan) -> dict[str, float]:
    """pd.kv_transfer in the parts named in the module docstring. The proxy's part is the hand-off it
    measured, never a remainder; without vLLM's time_to_first_token the decode's intake and HTTP
    cannot be told apart, so neither is given."""
    queue, step = decode.queue or 0.0, decode.prefill or 0.0
    out = {"kv_transfer.kv_wait": queue, "kv_transfer.first_step": step}
    own, lost = handoff
    if own is not None:
        out["kv_transfer.handoff"] = own
    if lost is not None:
        out["kv_transfer.failed_attempts"] = lost
    if decode.ttft is not None:
        out["kv_transfer.decode_intake"] = decode.ttft - queue - step
        out["kv_transfer.http"] = stage - decode.ttft - (own or 0.0) - (lost or 0.0)
    return out


def id_mismatches(info: Any) -> int:
    """How many of the request's vLLM spans carry another request's id (a wrongly joined span)."""
    want = expected_request_ids(info.request_id)
    return sum(1 for e in info.engine.values() if e.request_id and e.request_id not in want)
