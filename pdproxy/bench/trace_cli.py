"""`pdproxy trace ID`: one request's waterfall in the terminal, from trace files or a trace store.

Examples:

    pdproxy trace bench-0210e3e3-stream-42 --traces traces.jsonl --traces vllm.jsonl.gz --records pd.jsonl
    pdproxy trace 4d77811eaae16d28d109cbdc9c404c0d --jaeger http://localhost:16686
    pdproxy trace bench-0210e3e3-long-3 --tempo http://localhost:3200

ID is a trace id (32 hex digits) or a request id (the X-Request-Id, pd.request_id on the root span),
or, with trace files, a prefix of either that only one request has.
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
from pdproxy.bench.trace_store import TraceStore

TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")
LOOKBACK = 10.0  # s: other requests that started this long before may overlap this one's stalls


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
    p.add_argument("--records", action="append", default=[], metavar="FILE",
                   help="pdproxy bench record file(s), gzipped or not: the request's gaps as the client saw them "
                        "give the stalls' times (else the proxy's pd.stall events)")
    p.add_argument("--stall-threshold-ms", type=float, default=None,
                   help="list stalls above this (default: 100 with --records, else every pd.stall event recorded)")


def _pick(idx: traces.TraceIndex, wanted: str) -> traces.TraceInfo | None:
    """By request id or trace id; a prefix of either will do when only one request has it."""
    if wanted in idx.by_request:
        return idx.by_request[wanted]
    infos = [*idx.by_request.values(), *idx.shadow.values()]
    tid = wanted.lower()
    found = [i for i in infos if i.trace_id == tid]
    if not found:
        found = [i for i in infos if i.request_id.startswith(wanted) or i.trace_id.startswith(tid)]
        if len({i.trace_id for i in found}) != 1:
            return None
    return next((i for i in found if i.deployment != "shadow"), found[0] if found else None)


def _from_store(args: argparse.Namespace) -> traces.TraceIndex:
    """The trace, plus the traces of the requests on the same decode instance around it."""
    store = TraceStore("tempo" if args.tempo else "jaeger", args.tempo or args.jaeger, args.service)
    ids = [args.id] if TRACE_ID.match(args.id) else store.find_request(args.id)
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
        idx = traces.read_traces(args.traces, keep_spans=True) if args.traces else _from_store(args)
        records = {r["request_id"]: r for f in args.records for r in read_run(f).requests}
    except (traces.TraceError, RecordError, OSError) as e:
        print(f"pdproxy trace: {e}", file=sys.stderr)
        return 2
    info = _pick(idx, args.id)
    if info is None:
        print(f"pdproxy trace: no request trace with id {args.id!r}, nor one request alone with it as a prefix "
              f"({idx.traces} traces read)", file=sys.stderr)
        return 1
    spans = idx.spans_of.get(info.trace_id, [])
    timeline = attribution.Timeline([*idx.by_request.values(), *idx.shadow.values()])
    threshold = None if args.stall_threshold_ms is None else args.stall_threshold_ms / 1e3
    for line in waterfall.render(info, spans, timeline, threshold, records.get(info.request_id)):
        print(line)
    return 0
