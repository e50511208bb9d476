"""`pdproxy trace ID`: one request's waterfall in the terminal, from trace files or a trace store.

Examples:

    pdproxy trace bench-0210e3e3-stream-42 --traces traces.jsonl --traces vllm.jsonl.gz --records pd.jsonl
    pdproxy trace 4d77811eaae16d28d109cbdc9c404c0d --jaeger http://localhost:16686
    pdproxy trace bench-0210e3e3-long-3 --tempo http://localhost:3200

ID is a trace id (32 hex digits) or a request id (the X-Request-Id, pd.request_id on the root span),
or, with trace files, a prefix of either that only one request has (a prefix that several have lists
them).
The proxy's stages and the instances' own spans (vLLM's llm_request, with --otlp-traces-endpoint)
share one time axis; each stage is split where vLLM's spans allow, the largest part is named, and
the stalls recorded on pd.decode are listed with their cause: what the other requests did on the
same instance then (from the trace files; a store is asked for the requests its decode instance
served in the 10 s before this one started and while it ran). The lines under the request id say
where each leg ran and why: its instance, the routing policy and its reason.
"""

from __future__ import annotations

import argparse
import re
import sys

from pdproxy.bench import attribution, traces, waterfall
from pdproxy.bench.records import RecordError, read_run
from pdproxy.bench.report_cli import window
from pdproxy.bench.trace_store import TraceStore

TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")
LOOKBACK = 10.0  # s: other requests that started this long before may overlap this one's stalls
MAX_CANDIDATES = 20  # an ambiguous prefix lists this many of the requests it matches


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n", 2)[2]
    p.add_argument("id", metavar="ID", help="trace id or request id")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--traces", action="append", metavar="FILE",
                     help="OTLP-JSON trace file, gzipped or not (repeatable): pdproxy's, a Collector's file exporter's")
    src.add_argument("--jaeger", metavar="URL", help="Jaeger query service (api/v3, else api/traces)")
    src.add_argument("--tempo", metavar="URL", help="Tempo's HTTP API")
    p.add_argument("--service", default="pdproxy", help="the proxy's service.name, for Jaeger's search by request id")
    w = p.add_argument_group("where a store looks for a request id (a trace id needs no window)")
    w.add_argument("--since", metavar="DURATION", help="the window up to now, e.g. 15m, 2h, 7d (default 24h)")
    w.add_argument("--start", metavar="TIME", help="window start: ISO 8601 (2026-12-01T10:00:00Z) or unix seconds")
    w.add_argument("--end", metavar="TIME", help="window end (default: now)")
    p.add_argument("--records", action="append", default=[], metavar="FILE",
                   help="pdproxy bench record file(s), gzipped or not: the request's gaps as the client saw them "
                        "give the stalls' times (else the proxy's pd.stall events)")
    p.add_argument("--stall-threshold-ms", type=float, default=None,
                   help="list stalls above this (default: 100 with --records, else every pd.stall event recorded)")


def candidates(idx: traces.TraceIndex, wanted: str) -> list[traces.TraceInfo]:
    """The requests `wanted` names: by request id or trace id exactly, else each whose request id or trace id
    starts with it (one per trace: a shadow copy shares its request's id). Several: an ambiguous prefix."""
    if wanted in idx.by_request:
        return [idx.by_request[wanted]]
    infos = [*idx.by_request.values(), *idx.shadow.values()]
    tid = wanted.lower()
    found = [i for i in infos if i.trace_id == tid]
    if not found:
        found = [i for i in infos if i.request_id.startswith(wanted) or i.trace_id.startswith(tid)]
    by_trace: dict[str, traces.TraceInfo] = {}
    for i in sorted(found, key=lambda i: i.deployment == "shadow"):  # a trace's primary root first
        by_trace.setdefault(i.trace_id, i)
    return sorted(by_trace.values(), key=lambda i: (i.start, i.request_id))


def _pick(idx: traces.TraceIndex, wanted: str) -> traces.TraceInfo | None:
    """By request id or trace id; a prefix of either will do when only one request has it."""
    found = candidates(idx, wanted)
    return found[0] if len(found) == 1 else None


def _from_store(args: argparse.Namespace) -> traces.TraceIndex:
    """The trace, plus the traces of the requests on the same decode instance around it."""
    store = TraceStore("tempo" if args.tempo else "jaeger", args.tempo or args.jaeger, args.service)
    ids = [args.id] if TRACE_ID.match(args.id) else \
        store.find_request(args.id, *window(args.since or (None if args.start else "24h"), args.start, args.end))
    docs = []
    for tid in ids:
        docs += [(f"{store.url} trace {tid}", d) for d in store.trace(tid)]
    idx = traces.index_documents(docs, keep_spans=True)
    info = _pick(idx, args.id)
    instance = attribution.decode_instance(info) if info is not None else None
    if instance is None:
        return idx
    near = [d for d in store.around(instance, info.start - LOOKBACK, info.start + info.duration)
            if info.trace_id not in _trace_ids(d)]  # the request's own trace is in already
    return traces.index_documents(docs + [(f"{store.url} near {instance}", d) for d in near], keep_spans=True)


def _trace_ids(doc: dict) -> set[str]:
    return {str(sp.get("traceId", "")).lower() for rs in doc.get("resourceSpans") or []
            for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or [] for sp in ss.get("spans") or []}


def run(args: argparse.Namespace) -> int:
    try:
        if args.traces and (args.since or args.start or args.end):
            raise ValueError("--since, --start and --end choose a trace store's window: give --jaeger or --tempo URL")
        idx = traces.read_traces(args.traces, keep_spans=True) if args.traces else _from_store(args)
        records = {r["request_id"]: r for f in args.records for r in read_run(f).requests}
    except (traces.TraceError, RecordError, OSError, ValueError) as e:
        print(f"pdproxy trace: {e}", file=sys.stderr)
        return 2
    found = candidates(idx, args.id)
    if len(found) > 1:
        print(f"pdproxy trace: {args.id!r} is a prefix of {len(found)} requests; give more of one of them "
              f"(request id, trace id):", file=sys.stderr)
        for i in found[:MAX_CANDIDATES]:
            ttft = i.attrs.get("gen_ai.response.time_to_first_chunk")
            facts = f"TTFT {ttft * 1e3:,.1f} ms" if isinstance(ttft, (int, float)) else i.status.lower()
            print(f"  {i.request_id}  {i.trace_id}  {i.deployment}, {facts}", file=sys.stderr)
        if len(found) > MAX_CANDIDATES:
            print(f"  ... and {len(found) - MAX_CANDIDATES} more", file=sys.stderr)
        return 1
    if not found:
        print(f"pdproxy trace: no request trace with id {args.id!r}, nor one with it as a prefix "
              f"({idx.traces} traces read)", file=sys.stderr)
        return 1
    info = found[0]
    spans = idx.spans_of.get(info.trace_id, [])
    timeline = attribution.Timeline([*idx.by_request.values(), *idx.shadow.values()])
    threshold = None if args.stall_threshold_ms is None else args.stall_threshold_ms / 1e3
    for line in waterfall.render(info, spans, timeline, threshold, records.get(info.request_id)):
        print(line)
    return 0
