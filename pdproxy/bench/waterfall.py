"""One request's waterfall as plain text: the proxy's stages and the instances' spans on one time axis.

Fits the terminal (`width`: its columns, 100 when the output is not a terminal): a 22-character
name, a bar as wide as the rest allows, and the duration; lines longer than that wrap, indented,
never cut. vLLM's `llm_request` bars are shaded by what vLLM says the time was: `·` outside the
engine (API server), `░` queue (on a P/D decode: the wait for the KV), `█` compute (prefill, then
decode). Every attempt shows: each instance span under a stage (a re-prefill's too), and each failed
attempt the proxy recorded (`pd.decode.attempt_failed`, `pd.prefill.attempt_failed`) as a `─` bar
from the step before it to its failure, `✗`. Stalls recorded on `pd.decode` (or in the request's
bench record) are marked `!`. Below: the attempts in words, each stage's split, the largest
contributor, and each stall with its cause when other requests' traces are at hand
(bench/attribution.py).
"""

from __future__ import annotations

import shutil
import textwrap
from dataclasses import dataclass
from typing import Any

from pdproxy.bench import attribution, engine_spans
from pdproxy.bench.engine_spans import PART_LABELS, PARTS
from pdproxy.bench.otlpjson import attrs_of, unix_s
from pdproxy.bench.traces import STAGES, TraceInfo
from pdproxy.telemetry import names as n

NAME = 22
NUMBER = 11  # the duration column
MIN_BAR = 30
DEFAULT_WIDTH = 100  # when the output is not a terminal (a file, a pipe)


def terminal_width() -> int:
    """The terminal's columns (COLUMNS wins), else DEFAULT_WIDTH."""
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


class Axis:
    def __init__(self, start: float, end: float, cols: int) -> None:
        self.start, self.span, self.cols = start, max(end - start, 1e-9), cols

    def col(self, t: float) -> int:
        return min(self.cols - 1, max(0, int((t - self.start) / self.span * self.cols)))

    def bar(self, start: float, end: float, fill: str = "█") -> list[str]:
        cells = [" "] * self.cols
        a, b = self.col(start), self.col(end)
        for i in range(a, max(a, b) + 1):
            cells[i] = fill
        return cells


@dataclass
class Attempt:
    """A failed attempt the proxy recorded on a stage span's events."""

    role: str  # prefill | decode
    number: int | None
    address: str
    reason: str
    start: float  # the step before it: the stage's start, or the previous attempt's end (unix s)
    end: float  # when it failed
    detail: str


def _address(a: dict[str, Any]) -> str:
    host, port = a.get("server.address"), a.get("server.port")
    return f"{host}:{port}" if host and port is not None else "?"


def failed_attempts(info: TraceInfo) -> list[Attempt]:
    """Each failed prefill and decode attempt, in time order, with what happened after it."""
    events = sorted((e for stage in ("prefill", "decode") for e in info.stage_events.get(stage) or []
                     if e.name in (n.ATTEMPT_EVENT, n.PREFILL_ATTEMPT_EVENT, n.PREFILL_RERUN_EVENT)),
                    key=lambda e: e.time)
    total = info.stage_attrs.get("decode", {}).get(n.DECODE_ATTEMPTS)
    prefill_start = (info.stage_times.get("prefill") or (info.start, info.start))[0]
    decode_start = (info.stage_times.get("kv_transfer") or info.stage_times.get("prefill")
                    or (info.start, info.start))[0]
    out: list[Attempt] = []
    last = {"prefill": prefill_start, "decode": decode_start}
    for e in events:
        a = e.attrs
        if e.name == n.PREFILL_RERUN_EVENT:  # a re-prefill answered: the next decode attempt starts then
            last["decode"] = e.time
            continue
        if e.name == n.ATTEMPT_EVENT:
            number = a.get(n.ATTEMPT_NUMBER)
            stage = "before its first token" if a.get(n.MIGRATION_STAGE) == "before_first_token" else \
                "mid-stream" if a.get(n.MIGRATION_STAGE) == "mid_stream" else ""
            moved = isinstance(number, int) and isinstance(total, int) and number < total
            detail = ", ".join(x for x in (stage, "its KV hand-off abandoned" if a.get(n.ABANDONED) is True else "",
                                           "moved to another decode" if moved else "") if x)
            out.append(Attempt("decode", number if isinstance(number, int) else None, _address(a),
                               str(a.get(n.MIGRATION_REASON) or "unknown"), last["decode"], e.time, detail))
            last["decode"] = e.time
        else:
            number = a.get(n.PREFILL_ATTEMPT_NUMBER)
            out.append(Attempt("prefill", number if isinstance(number, int) else None, _address(a),
                               str(a.get("error.type") or "unknown"), last["prefill"], e.time, ""))
            last["prefill"] = last["decode"] = e.time
    return out


def _stage_of(info: TraceInfo, x: Attempt) -> str:
    """The first stage whose span holds the attempt's failure (the decode stage when none does)."""
    for stage in STAGES:
        a, b = info.stage_times.get(stage, (0.0, -1.0))
        if a <= x.end <= b:
            return stage
    return "decode" if "decode" in info.stage_times else max(info.stage_times, key=lambda s: info.stage_times[s][1],
                                                             default="decode")


class Chart:
    """The waterfall's lines at one width: rows of name, bar and duration, and wrapped text."""

    def __init__(self, width: int) -> None:
        self.width = max(width, NAME + MIN_BAR + NUMBER + 2)
        self.bar = self.width - NAME - NUMBER - 2
        self.lines: list[str] = []

    def row(self, name: str, cells: list[str], duration: float | None) -> None:
        name = name if len(name) <= NAME else name[:NAME - 1] + "…"  # the full name is in the lines below
        number = "" if duration is None else _ms(duration)
        self.lines.append(f"{name:<{NAME}} {''.join(cells)} {number:>{NUMBER}}".rstrip())

    def text(self, line: str, indent: str = "    ") -> None:
        """A line of words, wrapped at the width (never cut): continuation lines indented."""
        if len(line) <= self.width:
            self.lines.append(line)
            return
        lead = line[:len(line) - len(line.lstrip())]
        self.lines += textwrap.wrap(line, self.width, initial_indent="", subsequent_indent=lead + indent,
                                    break_long_words=False, break_on_hyphens=False) or [line]


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
    """The part (or, without vLLM spans, the stage) that took longest; an overlap is not a part."""
    split = {k: v for k, v in engine_spans.split(info).items() if not k.endswith(".overlap")}
    if split:
        key = max(split, key=lambda k: split[k])
        return f"{key.split('.')[0]}: {PART_LABELS[key]}", split[key]
    if not info.stages:  # a trace without its stage spans (e.g. cut by a store's sampling)
        return info.root_name, info.duration
    stage = max(info.stages, key=lambda s: info.stages[s])
    return stage, info.stages[stage]


def render(info: TraceInfo, spans: list[tuple[dict[str, Any], dict[str, Any]]] | None = None,
           timeline: attribution.Timeline | None = None, stall_threshold: float | None = None,
           record: dict[str, Any] | None = None, width: int | None = None) -> list[str]:
    """The waterfall's lines, each at most `width` characters (default: the terminal's, else 100).

    Stalls come from the request's bench `record` when given (above `stall_threshold`, default
    0.1 s), else from its pd.stall events (above `stall_threshold`, default: every one recorded).
    """
    chart = Chart(width or terminal_width())
    timeline = timeline or attribution.Timeline([])
    from_record = bool(record and record.get("itl"))
    has_events = any(e.name == attribution.STALL_EVENT for e in info.stage_events.get("decode") or [])
    stalls, source = None, ""
    if from_record or has_events:
        threshold = stall_threshold if stall_threshold is not None else (0.1 if from_record else 0.0)
        stalls = attribution.request_stalls(info, record, threshold, timeline)
        source = f"{'bench record' if from_record else 'pd.stall events'}, above {threshold * 1e3:g} ms"
    t0, t1 = info.start, info.start + info.duration
    ends = [e.end for es in info.engine_all.values() for e in es] + [b for _, b in info.stage_times.values()]
    axis = Axis(t0, max([t1, *ends]), chart.bar)
    status = "failed: " + str(info.attrs.get("pd.failed_stage", "?")) if info.status == "ERROR" else "ok"
    chart.text(f"trace {info.trace_id}  {info.attrs.get('pd.mode', '?')}  {status}")
    chart.text(f"request {info.request_id}")
    for leg, where in info.placement().items():
        chart.text(f"{leg:<8}{where}")
    chart.lines.append(f"{'':<{NAME}} {'0 ms':<{chart.bar - 12}}{_ms(axis.span) + ' ms':>12} {'ms':>{NUMBER}}")
    chart.row(info.root_name, axis.bar(t0, t1), info.duration)
    attempts = failed_attempts(info)
    for stage in STAGES:
        if stage not in info.stage_times:
            continue
        a, b = info.stage_times[stage]
        cells = axis.bar(a, b)
        if stage == "decode":
            for s in stalls or []:
                cells[axis.col(s["start"])] = "!"
        chart.row(f" pd.{stage}", cells, b - a)
        for x in attempts:  # a failed attempt under the stage it failed in
            if _stage_of(info, x) == stage:
                cells = axis.bar(x.start, x.end, "─")
                cells[axis.col(x.end)] = "✗"
                chart.row(f"  ✗ {x.role} #{x.number or '?'}", cells, x.end - x.start)
        for e in info.engine_all.get(stage) or []:
            chart.row(f"  {e.service or 'instance'}", _engine_cells(axis, e), e.end - e.start)
    for sp, res in spans or []:  # other spans of the trace (e.g. a service between client and proxy)
        if sp.get("name", "").startswith("pd.") or sp.get("name") == engine_spans.ENGINE_SPAN:
            continue
        a, b = unix_s(sp.get("startTimeUnixNano")), unix_s(sp.get("endTimeUnixNano"))
        if "pd.request_id" in attrs_of(sp.get("attributes")):
            continue
        chart.row(f" {res.get('service.name', '?')} {sp.get('name', '')}", axis.bar(a, b), b - a)
    if info.engine:
        chart.text(f"{'':<{NAME}} llm_request: · API server ░ queue (KV wait) █ compute")
    if attempts:
        chart.text(f"{'':<{NAME}} ─✗ failed attempt, from the step before to its failure")
    for x in attempts:
        chart.text(f"attempt failed: {x.role} #{x.number or '?'} on {x.address} at +{_ms(x.end - t0)} ms: {x.reason}"
                   + (f" ({x.detail})" if x.detail else ""))
    for e in info.stage_events.get("prefill", []) + info.stage_events.get("decode", []):
        if e.name == n.PREFILL_RERUN_EVENT:
            chart.text(f"prefill run again on {_address(e.attrs)}, answered at +{_ms(e.time - t0)} ms: fresh KV "
                       "for the next decode attempt")
    for line in split_lines(info, chart.width):
        chart.text(line)
    what, secs = largest(info)
    share = f" ({secs / info.duration:.0%} of E2E)" if info.duration > 0 else ""
    chart.text(f"largest: {what} {_ms(secs)} ms{share}")
    for line in stall_lines(info, stalls, source) if stalls is not None else window_lines(info, timeline):
        chart.text(line)
    return chart.lines


OVERLAP_NOTE = "  − overlap: vLLM's interval began before the proxy's stage did (pdproxy report --definitions)"


def split_lines(info: TraceInfo, width: int = DEFAULT_WIDTH) -> list[str]:
    """Each stage as the sum of its parts; an overlap is subtracted, a zero rest left out beside it."""
    split = engine_spans.split(info)
    out = []
    overlapped = False
    for stage in ("prefill", "kv_transfer", "decode"):
        parts = [(pt, split[f"{st}.{pt}"]) for st, pt in PARTS if st == stage and f"{st}.{pt}" in split]
        over = split.get(f"{stage}.overlap", 0.0)
        parts = [(pt, v) for pt, v in parts if pt != "overlap" and not (over > 0 and v == 0)]
        if over > 0:
            parts.append(("overlap", -over))
            overlapped = True
        if stage in info.stages:
            line = f"  {stage} {_ms(info.stages[stage])}"
            for i, (pt, v) in enumerate(parts):  # wrapped between parts: every figure stays whole
                sign = " = " if i == 0 else (" − " if v < 0 else " + ")
                item = f"{sign}{pt.replace('_', ' ')} {_ms(abs(v))}"
                if len(line) + len(item) > width:
                    out.append(line)
                    line = "    " + item.lstrip()
                else:
                    line += item
            out.append(line)
    if overlapped:
        out.append(OVERLAP_NOTE)
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
    return out


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
    return out
