"""Which other request caused a stall: what happened on the same instance while a stream stalled.

A stall is a gap between token-bearing events above the stall threshold. Its time comes from the
bench record's gaps (client clock; the report's other stall numbers come from them too) or, for
requests without a record's gaps, from the `pd.stall` events the proxy records on `pd.decode`
(proxy clock, its own --stall-threshold). Client, proxy and instances are assumed on one clock
(one host, or NTP-synchronised hosts: TOLERANCE absorbs a few ms). What happened on the
instance comes from the other requests' traces, all of them (both deployments, every run):

* kv_arrival: another request's KV was arriving on the same decode instance (P/D): from when that
  request reached the decode until its first token — vLLM's [first token − time_in_model_prefill −
  time_in_queue, first token] when its decode `llm_request` span is there, else its `pd.kv_transfer`
  span. On the real 2-GPU sample the decode's other streams stall while a long prompt's KV is pulled
  (the stalls end ~16 ms before vLLM schedules the request whose KV arrived).
* prefill: another request's prefill ran on the same instance (single / chunked prefill): vLLM's
  [scheduled, first token] when its `llm_request` span is there, else the proxy's `pd.prefill`.
* preemption: the instance reported a preemption (an event named `*preempt*` on an instance's
  span) of this or another request on it at that moment. vLLM 0.23's spans carry none.
* client: the proxy saw no gap that long (its pd.itl.max is shorter): the delay arose between the
  proxy and the client (e.g. a loaded client host). Only for stalls taken from bench records.
* none: nothing of the above found within the stall (± TOLERANCE).

A stall with several candidate causes takes the first of preemption, kv_arrival, prefill; its
coinciding requests are listed largest prompt first. That rule (window, tolerance, priority) is
pdproxy/telemetry/stalls.py's, which the proxy applies live: one definition for both. Where no
per-gap times exist, the request-level view still holds: requests whose decode window contains a
large KV arrival on their decode instance, against the others, compared by their per-request max gap.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from pdproxy.bench import stats
from pdproxy.bench.traces import TraceInfo
from pdproxy.telemetry.names import STALL_DURATION, STALL_EVENT, STALL_TOKENS
from pdproxy.telemetry.stalls import TOLERANCE, pick, window

CAUSES = ("kv_arrival", "prefill", "preemption", "client", "none")
LARGE_KV_TOKENS = 1024  # prompt tokens from which a KV arrival counts as large (request-level view)
DEFINITION = (
    "a stall is a gap above the stall threshold (times from the bench record, else from the pd.stall "
    "events on pd.decode); it is put down to what happened on the same instance within the gap (±10 ms): another "
    "request's KV arrival (P/D decode: from its decode's queueing, KV pull included, to its first token; else "
    "its pd.kv_transfer), another request's prefill (vLLM's "
    "scheduled→first token, else pd.prefill), a preemption the instance reported, the client side (a "
    "recorded gap the proxy did not see: longer than its pd.itl.max), or none; shares are of "
    "stall time. Request level (row 'max gap p50, with / without a large KV arrival (n)'): P/D requests with a "
    "short prompt whose pd.decode window contains a KV arrival of ≥ {tokens} prompt tokens (its first token at "
    "the proxy) on their decode instance vs the others, by max gap (pd.itl.max), with how many requests each. "
    "Drill-down split: ms, each part named."
)


@dataclass
class Stall:
    start: float  # unix seconds
    duration: float
    source: str  # "span" (pd.stall event) or "record" (bench record)
    unit_gap: float = 0.0  # per token when the gap's tokens are known, as the threshold is applied

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(order=True)
class Activity:
    """Something that happened on one instance: [start, end] (a moment when equal)."""

    start: float
    end: float
    kind: str = field(compare=False)
    request_id: str = field(compare=False)
    tokens: int = field(compare=False, default=0)
    moment: float = field(compare=False, default=0.0)  # kv_arrival: its first token at the proxy


def prompt_tokens(info: TraceInfo) -> int:
    v = info.attrs.get("gen_ai.usage.input_tokens")
    if isinstance(v, int):
        return v
    for e in info.engine.values():
        if e.prompt_tokens is not None:
            return e.prompt_tokens
    return 0


def decode_instance(info: TraceInfo) -> str | None:
    """The instance that streamed the tokens (the decode in P/D, the one instance in single mode)."""
    v = info.attrs.get("pd.decode.instance")
    return str(v) if v else None


class Timeline:
    """Every request's activity per instance, sorted by start, from all traces read."""

    def __init__(self, infos: Iterable[TraceInfo]) -> None:
        per: dict[str, list[Activity]] = defaultdict(list)
        for info in infos:
            inst = decode_instance(info)
            if inst is None:
                continue
            tokens = prompt_tokens(info)
            single = str(info.attrs.get("pd.mode")) == "single"
            if not single and "kv_transfer" in info.stage_times and "decode" in info.stages:
                a, b = info.stage_times["kv_transfer"]
                e = info.engine.get("decode")
                if e is not None and e.scheduled is not None and e.queue is not None and e.first_token is not None:
                    a, b = e.scheduled - e.queue, e.first_token
                per[inst].append(Activity(a, b, "kv_arrival", info.request_id, tokens,
                                          info.stage_times["kv_transfer"][1]))
            if single:
                e = info.engine.get("prefill")
                if e is not None and e.scheduled is not None and e.first_token is not None:
                    per[inst].append(Activity(e.scheduled, e.first_token, "prefill", info.request_id, tokens))
                elif "prefill" in info.stage_times:
                    a, b = info.stage_times["prefill"]
                    per[inst].append(Activity(a, b, "prefill", info.request_id, tokens))
            for e in info.engine.values():
                for ev in e.events:
                    if "preempt" in ev.name.lower():
                        per[inst].append(Activity(ev.time, ev.time, "preemption", info.request_id, tokens))
        self.per = {k: sorted(v) for k, v in per.items()}
        # the longest activity per instance bounds how far back an overlapping one can start
        self.longest = {k: max((a.end - a.start for a in v), default=0.0) for k, v in self.per.items()}

    def around(self, instance: str, start: float, end: float) -> list[Activity]:
        acts = self.per.get(instance) or []
        lo = bisect.bisect_left(acts, Activity(start - self.longest.get(instance, 0.0), 0, "", ""))
        hi = bisect.bisect_right(acts, Activity(end, float("inf"), "", ""))
        return [a for a in acts[lo:hi] if a.end >= start and a.start <= end]


def stalls_of(info: TraceInfo | None, record: dict[str, Any] | None, threshold: float) -> list[Stall]:
    """The request's stalls: from its bench record's gaps (what the report's other numbers use), else
    from the pd.stall events the proxy recorded (runs built from traces, `pdproxy trace`)."""
    if record is not None and record.get("itl") and record.get("start_time") is not None \
            and record.get("ttft") is not None:
        return _record_stalls(record, threshold)
    if info is None:
        return []
    events = [e for e in info.stage_events.get("decode") or [] if e.name == STALL_EVENT]
    out = []
    for e in events:
        gap, tokens = float(e.attrs.get(STALL_DURATION) or 0.0), int(e.attrs.get(STALL_TOKENS) or 1)
        if gap / max(tokens, 1) > threshold:
            out.append(Stall(e.time, gap, "span", gap / max(tokens, 1)))
    return out


def _record_stalls(record: dict[str, Any], threshold: float) -> list[Stall]:
    gaps, tokens = record["itl"], record.get("chunk_tokens")
    per_token = bool(tokens) and len(tokens) == len(gaps) + 1 and all(k > 0 for k in tokens)
    out = []
    t = float(record["start_time"]) + float(record["ttft"])
    for i, g in enumerate(gaps):
        unit_gap = g / tokens[i + 1] if per_token else g
        if unit_gap > threshold:
            out.append(Stall(t, g, "record", unit_gap))
        t += g
    return out


def attribute(stall: Stall, request_id: str, instance: str | None, timeline: Timeline,
              proxy_max_gap: float | None = None) -> tuple[str, list[Activity]]:
    """The cause of one stall and the activities (other requests) behind it."""
    if stall.source == "record" and proxy_max_gap is not None and stall.unit_gap > proxy_max_gap + TOLERANCE:
        return "client", []
    if instance is None:
        return "none", []
    return pick(timeline.around(instance, *window(stall.start, stall.end)), request_id)


def request_stalls(info: TraceInfo | None, record: dict[str, Any] | None, threshold: float,
                   timeline: Timeline) -> list[dict[str, Any]]:
    """Each stall of one request with its cause and coinciding requests (for the drill-down)."""
    rid = info.request_id if info is not None else str((record or {}).get("request_id"))
    inst = decode_instance(info) if info is not None else None
    seen = info.attrs.get("pd.itl.max") if info is not None else None
    out = []
    for s in stalls_of(info, record, threshold):
        cause, acts = attribute(s, rid, inst, timeline, seen if isinstance(seen, (int, float)) else None)
        out.append({"start": s.start, "duration": s.duration, "source": s.source, "cause": cause,
                    "with": [{"request_id": a.request_id, "tokens": a.tokens} for a in acts[:5]]})
    return out


def max_gap(info: TraceInfo, record: dict[str, Any] | None, unit: str) -> float | None:
    v = info.attrs.get("pd.itl.max")
    if isinstance(v, (int, float)):
        return float(v)
    t = stats.request_tail(record, unit) if record else None
    return t[1] if t else None


def overlap(infos: Iterable[TraceInfo], timeline: Timeline, records: dict[str, dict[str, Any]] | None = None,
            unit: str = "auto", large_tokens: int = LARGE_KV_TOKENS) -> dict[str, Any] | None:
    """P/D requests with a short prompt: max gap when their decode window holds a large KV arrival, vs not."""
    with_, without = [], []
    for info in infos:
        inst = decode_instance(info)
        if inst is None or "decode" not in info.stage_times or "kv_transfer" not in info.stages:
            continue
        if prompt_tokens(info) >= large_tokens:
            continue
        mg = max_gap(info, (records or {}).get(info.request_id), unit)
        if mg is None:
            continue
        a, b = info.stage_times["decode"]
        hit = any(x.kind == "kv_arrival" and x.tokens >= large_tokens and x.request_id != info.request_id
                  and a <= x.moment <= b for x in timeline.around(inst, a, b))
        (with_ if hit else without).append(mg)
    if not with_ and not without:
        return None
    return {"large_kv_tokens": large_tokens, "with_large_kv_arrival": stats.describe(with_),
            "others": stats.describe(without)}


def run_attribution(ok: list[dict[str, Any]], joined: dict[str, TraceInfo], timeline: Timeline, *,
                    threshold: float, unit: str, large_tokens: int = LARGE_KV_TOKENS) -> dict[str, Any]:
    """Per run: stall time by cause, where the stall times came from, and the request-level overlap."""
    time_by = dict.fromkeys(CAUSES, 0.0)
    count_by = dict.fromkeys(CAUSES, 0)
    sources: dict[str, int] = defaultdict(int)
    for r in ok:
        for s in request_stalls(joined.get(r["request_id"]), r, threshold, timeline):
            time_by[s["cause"]] += s["duration"]
            count_by[s["cause"]] += 1
            sources[s["source"]] += 1
    total = sum(time_by.values())
    infos = [joined[r["request_id"]] for r in ok if r["request_id"] in joined]
    return {
        "stalls": sum(count_by.values()),
        "stall_time": total,
        "by_cause": {c: {"stalls": count_by[c], "time": time_by[c], "share": time_by[c] / total if total else None}
                     for c in CAUSES},
        "stall_times_from": dict(sources),
        "overlap": overlap(infos, timeline, {r["request_id"]: r for r in ok}, unit, large_tokens),
    }
