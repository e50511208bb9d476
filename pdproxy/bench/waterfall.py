"""One request's waterfall as plain text: the proxy's stages and the instances' spans on one time axis.

Fits 80 columns: a 22-character name, a 44-character bar and the duration. vLLM's `llm_request`
bars are shaded by what vLLM says the time was: `·` outside the engine (API server), `░` queue (on
a P/D decode: the wait for the KV), `█` compute (prefill, then decode). Stalls recorded on
`pd.decode` (or in the request's bench record) are marked `!`. Below: each stage's split, the
largest contributor, and each stall with its cause when other requests' traces are at hand
(bench/attribution.py).
"""

from __future__ import annotations

from typing import Any

from pdproxy.bench import attribution, engine_spans
from pdproxy.bench.engine_spans import PART_LABELS, PARTS
from pdproxy.bench.otlpjson import attrs_of, unix_s
from pdproxy.bench.traces import STAGES, TraceInfo

WIDTH = 80
NAME = 22
BAR = 44


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


class Axis:
    def __init__(self, start: float, end: float) -> None:
        self.start, self.span = start, max(end - start, 1e-9)

    def col(self, t: float) -> int:
        return min(BAR - 1, max(0, int((t - self.start) / self.span * BAR)))

    def bar(self, start: float, end: float, fill: str = "█") -> list[str]:
        cells = [" "] * BAR
        a, b = self.col(start), self.col(end)
        for i in range(a, max(a, b) + 1):
            cells[i] = fill
        return cells


def _row(name: str, cells: list[str], duration: float) -> str:
    name = name if len(name) <= NAME else name[:NAME - 1] + "…"
    return f"{name:<{NAME}} {''.join(cells)} {_ms(duration):>11}"


def _engine_cells(axis: Axis, e: engine_spans.EngineSpan) -> list[str]:
    cells = axis.bar(e.start, e.end, "·")
    ft, sched = e.first_token, e.scheduled
    if sched is not None and e.queue is not None:
        for i in range(axis.col(sched - e.queue), axis.col(sched) + 1):
            cells[i] = "░"
    if sched is not None and ft is not None:
        for i in range(axis.col(sched), axis.col(ft) + 1):
            cells[i] = "█"
    if ft is not None and e.decode:
        for i in range(axis.col(ft), axis.col(ft + e.decode) + 1):
            cells[i] = "█"
    return cells


def largest(info: TraceInfo) -> tuple[str, float]:
    """The part (or, without vLLM spans, the stage) that took longest."""
    split = engine_spans.split(info)
    if split:
        key = max(split, key=lambda k: split[k])
        return f"{key.split('.')[0]}: {PART_LABELS[key]}", split[key]
    if not info.stages:  # a trace without its stage spans (e.g. cut by a store's sampling)
        return info.root_name, info.duration
    stage = max(info.stages, key=lambda s: info.stages[s])
    return stage, info.stages[stage]


def render(info: TraceInfo, spans: list[tuple[dict[str, Any], dict[str, Any]]] | None = None,
           timeline: attribution.Timeline | None = None, stall_threshold: float | None = None,
           record: dict[str, Any] | None = None) -> list[str]:
    """The waterfall's lines (each at most 80 characters).

    Stalls come from the request's bench `record` when given (above `stall_threshold`, default
    0.1 s), else from its pd.stall events (above `stall_threshold`, default: every one recorded).
    """
    timeline = timeline or attribution.Timeline([])
    from_record = bool(record and record.get("itl"))
    has_events = any(e.name == attribution.STALL_EVENT for e in info.stage_events.get("decode") or [])
    stalls, source = None, ""
    if from_record or has_events:
        threshold = stall_threshold if stall_threshold is not None else (0.1 if from_record else 0.0)
        stalls = attribution.request_stalls(info, record, threshold, timeline)
        source = f"{'bench record' if from_record else 'pd.stall events'}, above {threshold * 1e3:g} ms"
    t0, t1 = info.start, info.start + info.duration
    ends = [e.end for e in info.engine.values()] + [b for _, b in info.stage_times.values()]
    axis = Axis(t0, max([t1, *ends]))
    status = "failed: " + str(info.attrs.get("pd.failed_stage", "?")) if info.status == "ERROR" else "ok"
    head = f"trace {info.trace_id}  {info.attrs.get('pd.mode', '?')}  {status}"
    lines = [head[:WIDTH], f"request {info.request_id}"[:WIDTH],
             *(f"{leg:<8}{where}"[:WIDTH] for leg, where in info.placement().items()),
             f"{'':<{NAME}} {'0 ms':<{BAR - 12}}{_ms(axis.span) + ' ms':>12} {'ms':>11}"]
    lines.append(_row(info.root_name, axis.bar(t0, t1), info.duration))
    for stage in STAGES:
        if stage not in info.stage_times:
            continue
        a, b = info.stage_times[stage]
        cells = axis.bar(a, b)
        if stage == "decode":
            for s in stalls or []:
                cells[axis.col(s["start"])] = "!"
        lines.append(_row(f" pd.{stage}", cells, b - a))
        e = info.engine.get(stage)
        if e is not None:
            lines.append(_row(f"  {e.service or 'instance'}", _engine_cells(axis, e), e.end - e.start))
    for sp, res in spans or []:  # other spans of the trace (e.g. a service between client and proxy)
        if sp.get("name", "").startswith("pd.") or sp.get("name") == engine_spans.ENGINE_SPAN:
            continue
        a, b = unix_s(sp.get("startTimeUnixNano")), unix_s(sp.get("endTimeUnixNano"))
        if "pd.request_id" in attrs_of(sp.get("attributes")):
            continue
        lines.append(_row(f" {res.get('service.name', '?')} {sp.get('name', '')}", axis.bar(a, b), b - a))
    if info.engine:
        lines.append(f"{'':<{NAME}} llm_request: · API server ░ queue (KV wait) █ compute"[:WIDTH])
    lines += split_lines(info)
    what, secs = largest(info)
    share = f" ({secs / info.duration:.0%} of E2E)" if info.duration > 0 else ""
    lines.append(f"largest: {what} {_ms(secs)} ms{share}"[:WIDTH])
    lines += stall_lines(info, stalls, source) if stalls is not None else window_lines(info, timeline)
    return lines


def split_lines(info: TraceInfo) -> list[str]:
    split = engine_spans.split(info)
    out = []
    for stage in ("prefill", "kv_transfer", "decode"):
        parts = [(pt, split[f"{st}.{pt}"]) for st, pt in PARTS if st == stage and f"{st}.{pt}" in split]
        if stage in info.stages:
            line = f"  {stage} {_ms(info.stages[stage])}"
            for i, (pt, v) in enumerate(parts):  # wrapped between parts: every figure stays whole
                item = f"{' = ' if i == 0 else ' + '}{pt.replace('_', ' ')} {_ms(v)}"
                if len(line) + len(item) > WIDTH:
                    out.append(line)
                    line = "    " + item.lstrip()
                else:
                    line += item
            out.append(line[:WIDTH])
    if out and not split:
        out.append("  (no vLLM spans in this trace: the proxy's stages only)")
    return out


def stall_lines(info: TraceInfo, stalls: list[dict[str, Any]] | None, source: str) -> list[str]:
    """Each stall with its cause and the requests that coincided (bench/attribution.py)."""
    if stalls is None:
        return []
    out = [f"stalls ({source}): {len(stalls)}"]
    for s in stalls:
        who = ", ".join(f"{w['request_id']} ({w['tokens']} tok)" for w in s["with"][:2])
        out.append(f"  +{_ms(s['start'] - info.start)} ms: {_ms(s['duration'])} ms {s['cause']}"
                   + (f" with {who}" if who else ""))
    return [line[:WIDTH] for line in out]


def window_lines(info: TraceInfo, timeline: attribution.Timeline) -> list[str]:
    """Without pd.stall events: the max gap, and the large KV arrivals inside the decode window."""
    gap = info.attrs.get("pd.itl.max")
    if not isinstance(gap, (int, float)) or "decode" not in info.stage_times:
        return []
    out = [f"max gap {_ms(gap)} ms (no pd.stall events: times of gaps unknown)"]
    inst = attribution.decode_instance(info)
    if inst is None or "kv_transfer" not in info.stages:
        return out
    a, b = info.stage_times["decode"]
    acts = [x for x in timeline.around(inst, a, b) if x.kind == "kv_arrival" and x.request_id != info.request_id
            and a <= x.moment <= b and x.tokens >= attribution.LARGE_KV_TOKENS]
    out.append(f"large KV arrivals (>= {attribution.LARGE_KV_TOKENS} tok) on {inst} in its decode window: "
               f"{len(acts)}")
    out += [f"  +{_ms(x.moment - info.start)} ms {x.request_id} ({x.tokens} tok)" for x in acts[:5]]
    return [line[:WIDTH] for line in out]
