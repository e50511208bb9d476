"""`pdproxy report`: bench records (+ the proxy's traces) → comparison table, verdict, JSON, HTML; or, from
traces alone, a drill-down of live traffic.

Examples:

    pdproxy report single.jsonl chunked.jsonl pd.jsonl --traces traces.jsonl --html report.html
    pdproxy report base=aiperf-artifacts/ pd.jsonl --slo-ttft-ms 500 --slo-tail-itl-ms 100 --json -
    pdproxy report --traces traces.jsonl --by-deployment --shadow-condition gpu.count=1 --html live.html
    pdproxy report --traces live.jsonl --slowest 10
    pdproxy report --jaeger http://localhost:16686 --since 15m --slo-ttft-ms 500
    pdproxy report --definitions

Record files: `pdproxy bench` output, or aiperf's `profile_export.jsonl` (or its artifact
directory). `LABEL=PATH` renames a run. Traces: the proxy's `--trace-file` or a Collector's
file-exporter output (OTLP-JSON lines, gzipped or not), joined to records by request id. When they
hold vLLM's own `llm_request` spans (vLLM with --otlp-traces-endpoint), each stage is split by them
and each stall is put down to what ran on the same instance then. With --by-deployment
there are no record files: the runs are the primary and the shadow of `pdproxy serve --shadow-url`,
built from the traces' root spans and paired by request id (measured at the proxy).

Live traffic: with --traces and no record files (or --jaeger / --tempo, which read a trace store's
window of --since, or --start/--end), each proxy run (resource pd.run) and deployment is a run of its
own, measured at the proxy: the slowest requests (--slowest N) with their stages and stalls, each
instance, stall time by cause and the errors. No verdict unless SLOs are given (the run against them)
or --candidate picks one run to weigh against the others.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import textwrap
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from pdproxy.bench import deployments, html, report, stats, table, traces
from pdproxy.bench.external import read_any
from pdproxy.bench.records import RecordError
from pdproxy.bench.trace_store import TraceStore
from pdproxy.bench.verdict import Slo

STORE_LIMIT = 2000  # traces read from a store by default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n", 2)[2]
    p.add_argument("runs", nargs="*", metavar="[LABEL=]RECORDS", help="one record file (or aiperf dir) per run")
    p.add_argument("--traces", action="append", default=[], metavar="FILE",
                   help="OTLP-JSON trace file (repeatable); without record files: a report of the live traffic in it")
    t = p.add_argument_group("live traffic from a trace store (instead of --traces FILE)")
    store = t.add_mutually_exclusive_group()
    store.add_argument("--jaeger", metavar="URL", help="Jaeger's query service (api/v3, else api/traces)")
    store.add_argument("--tempo", metavar="URL", help="Tempo's HTTP API")
    t.add_argument("--service", default="pdproxy", help="the proxy's service.name (default pdproxy)")
    t.add_argument("--since", metavar="DURATION", help="the window up to now, e.g. 15m, 2h, 90s (default 1h)")
    t.add_argument("--start", metavar="TIME", help="window start: ISO 8601 (2026-12-01T10:00:00Z) or unix seconds")
    t.add_argument("--end", metavar="TIME", help="window end (default: now)")
    t.add_argument("--limit", type=int, default=STORE_LIMIT, help=f"at most this many traces (default {STORE_LIMIT})")
    s = p.add_argument_group("primary vs shadow from traces alone (no record files)")
    s.add_argument("--by-deployment", action="store_true",
                   help="one run per pd.deployment (primary, shadow) from the --traces root spans, paired by request "
                        "id; default verdict: primary is the candidate, shadow the baseline")
    s.add_argument("--shadow-condition", action="append", default=[], metavar="KEY=VALUE",
                   help="a fixed condition of the shadow set-up (e.g. gpu.count=1); the proxy's resource attributes "
                        "describe the primary")
    s.add_argument("--warmup-requests", type=int, default=0,
                   help="exclude the first N paired requests (both runs; live traffic: each run's first N)")
    s.add_argument("--warmup-seconds", type=float, default=0.0,
                   help="exclude paired requests started in the first S seconds (both runs; live traffic: each run's)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON ('-' for stdout)")
    p.add_argument("--html", metavar="PATH", help="write a self-contained HTML page with plots")
    p.add_argument("--no-table", action="store_true", help="do not print the terminal table")
    p.add_argument("--all", action="store_true", dest="all_rows",
                   help="every row of the results table (default: the rows that decide; the HTML has them all)")
    v = p.add_argument_group("verdict (candidate vs every baseline)")
    v.add_argument("--candidate", metavar="LABEL", help="run to adopt or not (default: the P/D run, else the last)")
    v.add_argument("--baseline", action="append", metavar="LABEL", help="baseline run(s) (default: all others)")
    add_slo_arguments(v)
    d = p.add_argument_group("definitions")
    d.add_argument("--itl-unit", choices=["auto", "chunk", "token"], default="auto",
                   help="ITL per chunk or per token (token needs usage on every chunk; default auto)")
    d.add_argument("--stall-threshold-ms", type=float, default=stats.DEFAULT_STALL_THRESHOLD * 1e3,
                   help="a gap above this is a stall (default 100)")
    d.add_argument("--slowest", type=int, default=5,
                   help="slowest requests kept per run and criterion (the table shows 3 of them; live traffic: all)")
    d.add_argument("--definitions", action="store_true",
                   help="print how every row is defined after the table (always in --json and --html); alone, "
                        "without runs or traces: every definition")


def add_slo_arguments(v: argparse._ArgumentGroup) -> None:
    """The verdict's SLOs and bounds (shared with `pdproxy demo`)."""
    v.add_argument("--slo-ttft-ms", type=float, help="TTFT SLO at --slo-percentile")
    v.add_argument("--slo-tail-itl-ms", type=float, help="tail ITL (per-request max gap) SLO at --slo-percentile")
    v.add_argument("--slo-percentile", type=int, default=99, choices=[50, 90, 99], help="percentile for SLOs (99)")
    v.add_argument("--max-kv-transfer-ms", type=float, help="bound on the candidate's KV transfer at the percentile")
    v.add_argument("--kv-metric", choices=["upper_bound", "estimated"], default="upper_bound",
                   help="which KV-transfer number the bound applies to (default upper_bound)")
    v.add_argument("--max-error-rate", type=float, default=0.01, help="bound on the error rate (fraction, 0.01)")
    v.add_argument("--min-improvement", type=float, default=0.0,
                   help="TTFT/tail ITL must be lower by at least this fraction (default 0: any improvement)")


def slo_from(args: argparse.Namespace) -> Slo:
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tail-itl-ms", args.slo_tail_itl_ms),
                        ("--max-kv-transfer-ms", args.max_kv_transfer_ms)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} {value:g}: must be above 0")
    if not 0 <= args.max_error_rate <= 1:
        raise ValueError(f"--max-error-rate {args.max_error_rate:g}: a fraction between 0 and 1")
    if not 0 <= args.min_improvement < 1:
        raise ValueError(f"--min-improvement {args.min_improvement:g}: a fraction between 0 and 1")

    def s(ms: float | None) -> float | None:
        return None if ms is None else ms / 1e3

    return Slo(ttft=s(args.slo_ttft_ms), tail_itl=s(args.slo_tail_itl_ms), percentile=args.slo_percentile,
               max_kv_transfer=s(args.max_kv_transfer_ms), kv_metric=args.kv_metric,
               max_error_rate=args.max_error_rate, min_improvement=args.min_improvement)


def load_runs(specs: list[str]) -> list:
    runs = []
    for spec in specs:
        label = None
        path = spec
        if "=" in spec and not Path(spec).exists():
            label, path = spec.split("=", 1)
        runs.append(read_any(path, label))
    return runs


def _conditions(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--shadow-condition {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _by_deployment(args: argparse.Namespace) -> dict:
    """Primary vs shadow out of the traces alone (bench/deployments.py)."""
    if args.runs:
        raise ValueError("--by-deployment builds its runs from --traces: give no record files")
    if not args.traces and not (args.jaeger or args.tempo):
        raise ValueError("--by-deployment needs --traces FILE (or --jaeger / --tempo URL)")
    idx = _read_traces(args)
    runs, pairing = deployments.split(idx, warmup_requests=args.warmup_requests, warmup_seconds=args.warmup_seconds,
                                      shadow_conditions=_conditions(args.shadow_condition))
    rep = report.build(runs, idx, unit=args.itl_unit, stall_threshold=args.stall_threshold_ms / 1e3,
                       slowest=args.slowest, slo=slo_from(args), candidate=args.candidate or deployments.PRIMARY,
                       baselines=args.baseline, definitions=deployments.DEFINITIONS)
    rep["pairing"] = pairing.as_dict()
    for e in rep["runs"]:  # each deployment's throughput over its own requests, not only the paired ones
        e["own_throughput"] = (pairing.own or {}).get(e["deployment"])
    return rep


def _traffic(args: argparse.Namespace) -> dict:
    """Live traffic out of the traces alone: no records, no pairing (bench/deployments.py, `traffic`)."""
    if args.shadow_condition:
        raise ValueError("--shadow-condition applies to --by-deployment only")
    idx = _read_traces(args)
    runs = deployments.traffic(idx, warmup_requests=args.warmup_requests, warmup_seconds=args.warmup_seconds)
    slo = slo_from(args)
    weigh = bool(args.candidate) or (len(runs) == 1 and bool(slo.targets))
    rep = report.build(runs, idx, unit=args.itl_unit, stall_threshold=args.stall_threshold_ms / 1e3,
                       slowest=args.slowest, slo=slo, candidate=args.candidate, baselines=args.baseline,
                       verdict=weigh, definitions=deployments.TRAFFIC_DEFINITIONS)
    rep["traffic"] = True
    return rep


def _read_traces(args: argparse.Namespace) -> traces.TraceIndex:
    """The trace files, or the store's window of traffic (with every span of each trace, the instances' too)."""
    if not (args.jaeger or args.tempo):
        if args.since or args.start or args.end:
            raise ValueError("--since, --start and --end choose a trace store's window: give --jaeger or --tempo URL")
        return traces.read_traces(args.traces)
    if args.traces:
        raise ValueError("read traces from files (--traces) or from a store (--jaeger / --tempo), not both")
    start, end = window(args.since, args.start, args.end)
    store = TraceStore("tempo" if args.tempo else "jaeger", args.tempo or args.jaeger, args.service)
    docs, found = store.search(start, end, args.limit)
    where = (f"{store.url} ({args.service}, {_iso(start)} to {_iso(end)}"
             + (f"; the first {args.limit} traces only: narrow the window or raise --limit" if found >= args.limit
                else "") + ")")
    idx = traces.index_documents([(where, d) for d in docs])
    idx.sources.append(where)
    return idx


DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)?$")


def window(since: str | None, start: str | None, end: str | None, now: float | None = None) -> tuple[float, float]:
    """(start, end) in unix seconds from --since (a duration up to --end or now) or --start/--end."""
    now = time.time() if now is None else now
    t1 = _when(end, "--end") if end else now
    if since and start:
        raise ValueError("give --since or --start, not both")
    if start:
        t0 = _when(start, "--start")
    else:
        m = DURATION.match((since or "1h").strip())
        if not m:
            raise ValueError(f"--since {since!r}: expected a duration such as 90s, 15m, 2h or 1d")
        t0 = t1 - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2) or "s"]
    if t0 >= t1:
        raise ValueError(f"the window is empty: start {_iso(t0)} is not before end {_iso(t1)}")
    return t0, t1


def _when(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected ISO 8601 (2026-12-01T10:00:00Z) or unix seconds") from None
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def print_definitions(console: Console) -> None:
    """Every definition a report uses, without a report (`pdproxy report --definitions` alone)."""
    width = min(console.width, 100)
    sections = (("Bench runs (records from pdproxy bench or aiperf)", report.definitions_of()),
                ("Runs from traces alone (--by-deployment, live traffic): where they differ",
                 deployments.DEFINITIONS))
    for title, defs in sections:
        console.print(Text(title, style="bold"))
        for name, text in table.all_definitions(defs):
            console.print(Text("\n".join(textwrap.wrap(f"{name}: {text}", width, subsequent_indent="    ",
                                                       break_long_words=False, break_on_hyphens=False))))


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    live = bool(args.traces or args.jaeger or args.tempo)
    try:
        if args.definitions and not args.runs and not live and not args.by_deployment:
            print_definitions(table.make_console())
            return 0
        if args.by_deployment:
            rep = _by_deployment(args)
        elif not args.runs and live:
            rep = _traffic(args)
        else:
            if not args.runs:
                raise ValueError("give one record file per run, or --traces FILE (live traffic; --by-deployment: "
                                 "primary vs shadow), or --jaeger / --tempo URL")
            if args.shadow_condition or args.warmup_requests or args.warmup_seconds:
                raise ValueError("--shadow-condition and --warmup-* apply to runs built from traces only")
            if args.jaeger or args.tempo:
                raise ValueError("--jaeger / --tempo read live traffic: give no record files (bench runs join "
                                 "--traces FILE)")
            runs = load_runs(args.runs)
            idx = traces.read_traces(args.traces) if args.traces else None
            rep = report.build(runs, idx, unit=args.itl_unit, stall_threshold=args.stall_threshold_ms / 1e3,
                               slowest=args.slowest, slo=slo_from(args), candidate=args.candidate,
                               baselines=args.baseline)
    except (RecordError, traces.TraceError, ValueError, OSError) as e:
        err.print(f"[red]pdproxy report: {escape(str(e))}[/]", highlight=False, soft_wrap=True)
        return 2
    if not args.no_table:
        rows = args.slowest if rep.get("traffic") else min(args.slowest, 3)
        table.render(rep, table.make_console(stderr=args.json == "-"), definitions=args.definitions,
                     all_rows=args.all_rows, drilldown_rows=rows)
    write_outputs(rep, args.json, (args.html, html.render(rep)) if args.html else None, err)
    return 0


def write_outputs(rep: dict, json_path: str | None, html_page: tuple[str, str] | None, err: Console) -> None:
    """The report as JSON (`-`: standard output) and its HTML page (path, page), where asked for."""
    if json_path:
        text = json.dumps(rep, indent=1)
        if json_path == "-":
            sys.stdout.write(text + "\n")
        else:
            _write(json_path, text)
            err.print(f"JSON report: {json_path}")
    if html_page:
        path, page = html_page
        _write(path, page)
        err.print(f"HTML report: {path}")


def _write(path: str, text: str) -> None:
    """A report file, its directory made first where it is missing (`--json out/run.json` in a fresh tree)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
