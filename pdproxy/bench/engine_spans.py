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

The split puts the proxy's stage spans and these intervals together. Each stage's remainder
(the stage minus vLLM's parts) is time spent outside vLLM's engine: HTTP between proxy and
instance, vLLM's API server (request parsing, tokenization, detokenization), and the proxy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdproxy.bench.otlpjson import attrs_of, unix_s

ENGINE_SPAN = "llm_request"

# (stage, part) in the order a request goes through them
PARTS: tuple[tuple[str, str], ...] = (
    ("prefill", "overhead"), ("prefill", "queue"), ("prefill", "compute"),
    ("kv_transfer", "kv_wait"), ("kv_transfer", "first_step"), ("kv_transfer", "handoff"),
    ("decode", "compute"), ("decode", "relay"),
)
PART_LABELS = {
    "prefill.overhead": "proxy→instance overhead", "prefill.queue": "prefill queue",
    "prefill.compute": "prefill compute", "kv_transfer.kv_wait": "decode's wait for the KV",
    "kv_transfer.first_step": "first decode step", "kv_transfer.handoff": "proxy hand-off",
    "decode.compute": "decode compute", "decode.relay": "proxy relay",
}
SPLIT_DEFINITION = (
    "rows 'vLLM split: stage.part'; from vLLM's llm_request spans (children of pd.prefill / pd.decode; single mode: one span under "
    "pd.prefill) and their gen_ai.latency.* attributes: prefill = proxy→instance overhead (the rest: HTTP, "
    "vLLM's API server, tokenization) + prefill queue (time_in_queue) + prefill compute "
    "(time_in_model_prefill); kv_transfer = decode's wait for the KV (the decode's time_in_queue, the NIXL "
    "pull included) + first decode step (the decode's time_in_model_prefill) + proxy hand-off (the rest); "
    "decode = decode compute (time_in_model_decode) + proxy relay (the rest). Requests without vLLM spans "
    "have only the proxy's stages."
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
        return out
    if not single and "kv_transfer" in stages and last.queue is not None and last.prefill is not None:
        out["kv_transfer.kv_wait"], out["kv_transfer.first_step"] = last.queue, last.prefill
        out["kv_transfer.handoff"] = stages["kv_transfer"] - last.queue - last.prefill
    if "decode" in stages and last.decode is not None:
        out["decode.compute"] = last.decode
        out["decode.relay"] = stages["decode"] - last.decode
    return out


def id_mismatches(info: Any) -> int:
    """How many of the request's vLLM spans carry another request's id (a wrongly joined span)."""
    want = expected_request_ids(info.request_id)
    return sum(1 for e in info.engine.values() if e.request_id and e.request_id not in want)
