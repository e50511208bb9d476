"""Read pdproxy traces (OTLP-JSON) and join them to bench records by request id.

Input: the proxy's `--trace-file` or a Collector's file exporter output (gzipped or not) — one
`{"resourceSpans": [...]}` object per line (a file holding one pretty-printed object, or a JSON
list of them, is read too). Spans of one trace may be spread over several lines.

A request's trace is found through its root span's `pd.request_id` attribute (the client's
`X-Request-Id`, docs/reference/telemetry.md); the stage spans are that root's children named
`pd.queue`, `pd.prefill`, `pd.kv_transfer`, `pd.decode`. An instance's own span under a stage
span (vLLM's `llm_request`, bench/engine_spans.py) is kept with that stage. Shadow copies
(`pd.deployment=shadow`) are kept apart and never joined to the primary's records; a run built
from the shadow's traces (`bench/deployments.py`) joins to them instead.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from pdproxy.bench.engine_spans import ENGINE_SPAN, EngineSpan, SpanEvent, engine_span, span_events
from pdproxy.bench.otlpjson import attrs_of
from pdproxy.bench.records import open_text

STAGES = ("queue", "prefill", "kv_transfer", "decode")
# Resource attributes that describe a process, not the run's fixed conditions.
_NOT_CONDITIONS = {"service.name", "service.instance.id", "telemetry.sdk.name", "telemetry.sdk.language",
                   "telemetry.sdk.version", "host.name", "process.pid", "process.runtime.version"}
# The resource describes the proxy process and its primary set-up; of it only these hold for the shadow
# too (same proxy, same run, same requests). The shadow's own set-up is not in the resource.
SHADOW_RESOURCE_KEYS = {"pd.run", "service.version", "vllm.model"}


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass
class TraceInfo:
    """The part of one request's trace the report uses."""

    trace_id: str
    request_id: str
    root_name: str
    attrs: dict[str, Any]
    resource: dict[str, Any]
    stages: dict[str, float] = field(default_factory=dict)  # stage → duration (s)
    stage_attrs: dict[str, dict[str, Any]] = field(default_factory=dict)
    stage_status: dict[str, str] = field(default_factory=dict)
    duration: float = 0.0
    status: str = "UNSET"
    status_message: str = ""
    start: float = 0.0  # root start, unix seconds (the proxy's clock shifted to wall time)
    stage_times: dict[str, tuple[float, float]] = field(default_factory=dict)  # stage → (start, end), unix s
    stage_events: dict[str, list[SpanEvent]] = field(default_factory=dict)
    engine: dict[str, EngineSpan] = field(default_factory=dict)  # stage → the instance's span under it
    engine_all: dict[str, list[EngineSpan]] = field(default_factory=dict)  # stage → every one, by start (retries)

    @property
    def deployment(self) -> str:
        return str(self.attrs.get("pd.deployment", "primary"))

    def placement(self) -> dict[str, str]:
        """Where each leg ran and why: `{"prefill": "host:port (policy reason[, fallback])", ...}`, from
        the root's pd.<leg>.instance and the leg span's pd.route.*. Single mode has one leg, `single`: its
        instance computed both the prompt and the tokens (pd.prefill is its time to first token)."""
        out = {}
        if str(self.attrs.get("pd.mode")) == "single":
            instance = self.attrs.get("pd.decode.instance") or self.attrs.get("pd.prefill.instance")
            route = next((r for r in (self.stage_attrs.get(leg) or {} for leg in ("prefill", "decode"))
                          if r.get("pd.route.policy")), {})
            legs: tuple[tuple[str, Any, dict[str, Any]], ...] = (("single", instance, route),)
        else:
            legs = tuple((leg, self.attrs.get(f"pd.{leg}.instance"), self.stage_attrs.get(leg) or {})
                         for leg in ("prefill", "decode"))
        for leg, instance, route in legs:
            if instance is None and not route:
                continue
            if leg == "prefill" and instance is None and route.get("pd.prefill.on_decode"):
                out[leg] = "none: the decode computed the prompt (selective disaggregation)"
                continue
            why = " ".join(str(route[k]) for k in ("pd.route.policy", "pd.route.reason") if route.get(k))
            if route.get("pd.route.fallback_reason"):
                why += f", {route['pd.route.fallback_reason']}"
            out[leg] = f"{instance or '?'}" + (f" ({why})" if why else "")
        return out


@dataclass
class TraceIndex:
    by_request: dict[str, TraceInfo] = field(default_factory=dict)
    shadow: dict[str, TraceInfo] = field(default_factory=dict)
    spans: int = 0
    traces: int = 0
    duplicates: int = 0
    engine_spans: int = 0  # instances' request spans (vLLM's llm_request) seen
    engine_unjoined: int = 0  # of those, not under a pdproxy stage span (sent to the instance directly)
    spans_of: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = field(default_factory=dict)  # keep_spans
    sources: list[str] = field(default_factory=list)


def _read_text(path: Path) -> str:
    try:
        with open_text(path) as f:
            return f.read()
    except (OSError, EOFError) as e:  # a broken gzip file: BadGzipFile is an OSError, a cut one EOFError
        raise TraceError(f"{path}: cannot be read ({e})") from None


def _documents(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    text = _read_text(path)
    stripped = text.lstrip()
    if not stripped:
        return
    # One object per line (file exporter); otherwise a single JSON document. A cut last line (a
    # process killed mid-write) is skipped rather than losing the whole file.
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    parsed: list[tuple[int, dict[str, Any]]] = []
    bad: list[int] = []
    for n, line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            bad.append(n)
            continue
        if isinstance(obj, dict):
            parsed.append((n, obj))
        else:
            bad.append(n)
    if not bad or (parsed and bad == [lines[-1][0]] and lines[0][1].lstrip().startswith("{\"")):
        yield from parsed
        return
    try:
        doc = json.loads(text)
    except ValueError:
        raise TraceError(f"{path}: neither OTLP-JSON lines nor one JSON document") from None
    for i, obj in enumerate(doc if isinstance(doc, list) else [doc], 1):
        if not isinstance(obj, dict):
            raise TraceError(f"{path}: item {i} is not an OTLP-JSON object")
        yield i, obj


def read_traces(paths: list[str], keep_spans: bool = False) -> TraceIndex:
    """Index every pdproxy request trace in the given files by request id."""
    idx = TraceIndex()

    def documents() -> Iterator[tuple[str, dict[str, Any]]]:
        for p in paths:
            path = Path(p)
            if not path.is_file():
                raise TraceError(f"{p}: no such trace file")
            idx.sources.append(str(path))
            for n, obj in _documents(path):
                yield f"{p}:{n}", obj

    return index_documents(documents(), idx, keep_spans)


def index_documents(docs: Iterable[tuple[str, dict[str, Any]]], idx: TraceIndex | None = None,
                    keep_spans: bool = False) -> TraceIndex:
    """Index OTLP-JSON `{"resourceSpans": [...]}` documents, each named by where it came from (for errors).

    `keep_spans` keeps every span of every trace (idx.spans_of), for drawing one trace whole.
    """
    idx = idx if idx is not None else TraceIndex()
    spans_by_trace: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    seen: dict[tuple[str, str], int] = {}  # (trace id, span id) -> its place in spans_by_trace[trace id]
    for where, obj in docs:
        rs_list = obj.get("resourceSpans")
        if rs_list is None:
            raise TraceError(f"{where}: no 'resourceSpans' (not OTLP-JSON trace data)")
        for rs in rs_list or []:
            resource = attrs_of((rs.get("resource") or {}).get("attributes"))
            for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []:
                for sp in ss.get("spans") or []:
                    tid = str(sp.get("traceId", "")).lower()
                    if not tid:
                        raise TraceError(f"{where}: a span without traceId")
                    key = (tid, str(sp.get("spanId", "")).lower())
                    if key[1] and key in seen:  # another copy of a span (two files, two exporters)
                        kept, res = spans_by_trace[tid][seen[key]]
                        spans_by_trace[tid][seen[key]] = (_merged(kept, sp), res)
                        continue
                    if key[1]:
                        seen[key] = len(spans_by_trace[tid])
                    spans_by_trace[tid].append((sp, resource))
                    idx.spans += 1
                    idx.engine_spans += sp.get("name") == ENGINE_SPAN
    idx.traces += len(spans_by_trace)
    if keep_spans:
        idx.spans_of = dict(spans_by_trace)
    for tid, spans in spans_by_trace.items():
        for info in _assemble(tid, spans, idx):
            target = idx.shadow if info.deployment == "shadow" else idx.by_request
            if info.request_id in target:
                idx.duplicates += 1
                continue
            target[info.request_id] = info
    return idx


def _merged(kept: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """One span from two copies of it: what either copy holds adds to the other, nothing is lost. A
    collector's copy may lack the events (attempts, stalls) the proxy's own trace file keeps, so the
    copy with more events gives them, and an attribute only one copy has is kept."""
    events = max((kept.get("events") or [], other.get("events") or []), key=len)
    keys = {a.get("key") for a in kept.get("attributes") or []}
    extra = [a for a in other.get("attributes") or [] if a.get("key") not in keys]
    return {**kept, "events": events, "attributes": [*(kept.get("attributes") or []), *extra]}


def _dur(sp: dict[str, Any]) -> float:
    return (int(sp.get("endTimeUnixNano") or 0) - int(sp.get("startTimeUnixNano") or 0)) / 1e9


def _status(sp: dict[str, Any]) -> str:
    code = (sp.get("status") or {}).get("code", 0)
    return {0: "UNSET", 1: "OK", 2: "ERROR"}.get(code, str(code)) if isinstance(code, int) else str(code).replace(
        "STATUS_CODE_", "")


def _assemble(tid: str, spans: list[tuple[dict[str, Any], dict[str, Any]]], idx: TraceIndex) -> list[TraceInfo]:
    out = []
    children: dict[str, list[dict[str, Any]]] = defaultdict(list)
    resources: dict[str, dict[str, Any]] = {}
    for sp, resource in spans:
        if sp.get("parentSpanId"):
            children[str(sp["parentSpanId"])].append(sp)
        resources[str(sp.get("spanId"))] = resource
    joined_engine = 0
    for sp, resource in spans:
        attrs = attrs_of(sp.get("attributes"))
        if "pd.request_id" not in attrs or str(sp.get("name", "")).startswith("pd."):
            continue
        if not attrs["pd.request_id"]:
            continue
        info = TraceInfo(trace_id=tid, request_id=str(attrs["pd.request_id"]), root_name=str(sp.get("name")),
                         attrs=attrs, resource=resource, duration=_dur(sp), status=_status(sp),
                         status_message=str((sp.get("status") or {}).get("message") or ""),
                         start=int(sp.get("startTimeUnixNano") or 0) / 1e9)
        for ch in children.get(str(sp.get("spanId")), []):
            name = str(ch.get("name", ""))
            if name.startswith("pd.") and name[3:] in STAGES:
                stage = name[3:]
                info.stages[stage] = _dur(ch)
                info.stage_attrs[stage] = attrs_of(ch.get("attributes"))
                info.stage_status[stage] = _status(ch)
                info.stage_times[stage] = (int(ch.get("startTimeUnixNano") or 0) / 1e9,
                                           int(ch.get("endTimeUnixNano") or 0) / 1e9)
                info.stage_events[stage] = span_events(ch)
                found = sorted((engine_span(grand, resources.get(str(grand.get("spanId"))) or {})
                                for grand in children.get(str(ch.get("spanId")), [])
                                if grand.get("name") == ENGINE_SPAN), key=lambda e: (e.start, e.end))
                if found:  # several after a retry or a migration: the stage's own is the first prefill, the
                    # last decode (a re-prefill and the decode that finished the stream come after the first)
                    info.engine_all[stage] = found
                    info.engine[stage] = found[0] if stage == "prefill" else max(found, key=lambda e: e.end)
                    joined_engine += len(found)
        out.append(info)
    idx.engine_unjoined += sum(1 for sp, _ in spans if sp.get("name") == ENGINE_SPAN) - joined_engine
    return out


def resource_conditions(infos: list[TraceInfo], deployment: str = "primary") -> dict[str, Any]:
    """The most common value of each condition-like resource attribute (plus the root's pd.mode).

    For the shadow only the process-wide keys are taken from the resource; its instance counts are
    the distinct instances its roots name (the ones that served, a lower bound on the pool).
    """
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    raw: dict[tuple[str, str], Any] = {}
    shadow = deployment == "shadow"
    for info in infos:
        items = {k: v for k, v in info.resource.items()
                 if k not in _NOT_CONDITIONS and (not shadow or k in SHADOW_RESOURCE_KEYS)}
        if "pd.mode" in info.attrs:
            items["pd.mode"] = info.attrs["pd.mode"]
        for k, v in items.items():
            key = json.dumps(v, sort_keys=True)
            counts[k][key] += 1
            raw[(k, key)] = v
    out = {k: raw[(k, c.most_common(1)[0][0])] for k, c in counts.items()}
    if shadow:
        for role in ("prefill", "decode"):
            out[f"pd.{role}.count"] = len({i.attrs[f"pd.{role}.instance"] for i in infos
                                           if i.attrs.get(f"pd.{role}.instance")})
    return out


def join(requests: list[dict[str, Any]], idx: TraceIndex,
         deployment: str = "primary") -> tuple[dict[str, TraceInfo], dict[str, int]]:
    """Match records to one deployment's traces by request id; counts say how complete the join is."""
    matched: dict[str, TraceInfo] = {}
    mismatch = 0
    table = idx.shadow if deployment == "shadow" else idx.by_request
    for r in requests:
        info = table.get(str(r.get("request_id")))
        if info is None:
            continue
        matched[r["request_id"]] = info
        if r.get("trace_id") and r["trace_id"].lower() != info.trace_id:
            mismatch += 1
    return matched, {
        "records": len(requests),
        "joined": len(matched),
        "records_without_trace": len(requests) - len(matched),
        "trace_id_mismatch": mismatch,
    }
