"""`pdproxy report`: bench records (+ the proxy's traces) → comparison table, verdict, JSON, HTML.

Examples:

    pdproxy report single.jsonl chunked.jsonl pd.jsonl --traces traces.jsonl --html report.html
    pdproxy report base=aiperf-artifacts/ pd.jsonl --slo-ttft-ms 500 --slo-tail-itl-ms 100 --json -
    pdproxy report --traces traces.jsonl --by-deployment --shadow-condition gpu.count=1 --html live.html

Record files: `pdproxy bench` output, or aiperf's `profile_export.jsonl` (or its artifact
directory). `LABEL=PATH` renames a run. Traces: the proxy's `--trace-file` or a Collector's
file-exporter output (OTLP-JSON lines, gzipped or not), joined to records by request id. When they
hold vLLM's own `llm_request` spans (vLLM with --otlp-traces-endpoint), each stage is split by them
and each stall is put down to what ran on the same instance then (docs/bench.md). With --by-deployment
there are no record files: the runs are the primary and the shadow of `pdproxy serve --shadow-url`,
built from the traces' root spans and paired by request id (measured at the proxy).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from pdproxy.bench import deployments, html, report, stats, table, traces
from pdproxy.bench.external import read_any
from pdproxy.bench.records import RecordError
from pdproxy.bench.verdict import Slo


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n", 2)[2]
    p.add_argument("runs", nargs="*", metavar="[LABEL=]RECORDS", help="one record file (or aiperf dir) per run")
    p.add_argument("--traces", action="append", default=[], metavar="FILE", help="OTLP-JSON trace file (repeatable)")
    s = p.add_argument_group("primary vs shadow from traces alone (no record files)")
    s.add_argument("--by-deployment", action="store_true",
                   help="one run per pd.deployment (primary, shadow) from the --traces root spans, paired by request "
                        "id; default verdict: primary is the candidate, shadow the baseline")
    s.add_argument("--shadow-condition", action="append", default=[], metavar="KEY=VALUE",
                   help="a fixed condition of the shadow set-up (e.g. gpu.count=1); the proxy's resource attributes "
                        "describe the primary")
    s.add_argument("--warmup-requests", type=int, default=0, help="exclude the first N paired requests (both runs)")
    s.add_argument("--warmup-seconds", type=float, default=0.0,
                   help="exclude paired requests started in the first S seconds (both runs)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON ('-' for stdout)")
    p.add_argument("--html", metavar="PATH", help="write a self-contained HTML page with plots")
    p.add_argument("--no-table", action="store_true", help="do not print the terminal table")
    v = p.add_argument_group("verdict (candidate vs every baseline)")
    v.add_argument("--candidate", metavar="LABEL", help="run to adopt or not (default: the P/D run, else the last)")
    v.add_argument("--baseline", action="append", metavar="LABEL", help="baseline run(s) (default: all others)")
    add_slo_arguments(v)
    d = p.add_argument_group("definitions")
    d.add_argument("--itl-unit", choices=["auto", "chunk", "token"], default="auto",
                   help="ITL per chunk or per token (token needs usage on every chunk; default auto)")
    d.add_argument("--stall-threshold-ms", type=float, default=stats.DEFAULT_STALL_THRESHOLD * 1e3,
                   help="a gap above this is a stall (default 100)")
    d.add_argument("--slowest", type=int, default=5, help="slowest requests listed per run and criterion")
    d.add_argument("--definitions", action="store_true",
                   help="print how every row is defined after the table (always in --json and --html)")


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
    if not args.traces:
        raise ValueError("--by-deployment needs --traces FILE")
    idx = traces.read_traces(args.traces)
    runs, pairing = deployments.split(idx, warmup_requests=args.warmup_requests, warmup_seconds=args.warmup_seconds,
                                      shadow_conditions=_conditions(args.shadow_condition))
    rep = report.build(runs, idx, unit=args.itl_unit, stall_threshold=args.stall_threshold_ms / 1e3,
                       slowest=args.slowest, slo=slo_from(args), candidate=args.candidate or deployments.PRIMARY,
                       baselines=args.baseline, definitions=deployments.DEFINITIONS)
    rep["pairing"] = pairing.as_dict()
    return rep


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        if args.by_deployment:
            rep = _by_deployment(args)
        else:
            if not args.runs:
                raise ValueError("give one record file per run, or --traces FILE --by-deployment")
            if args.shadow_condition or args.warmup_requests or args.warmup_seconds:
                raise ValueError("--shadow-condition and --warmup-* apply to --by-deployment only")
            runs = load_runs(args.runs)
            idx = traces.read_traces(args.traces) if args.traces else None
            rep = report.build(runs, idx, unit=args.itl_unit, stall_threshold=args.stall_threshold_ms / 1e3,
                               slowest=args.slowest, slo=slo_from(args), candidate=args.candidate,
                               baselines=args.baseline)
    except (RecordError, traces.TraceError, ValueError, OSError) as e:
        err.print(f"[red]pdproxy report: {e}[/]")
        return 2
    if not args.no_table:
        table.render(rep, table.make_console(stderr=args.json == "-"), definitions=args.definitions)
    write_outputs(rep, args.json, (args.html, html.render(rep)) if args.html else None, err)
    return 0


def write_outputs(rep: dict, json_path: str | None, html_page: tuple[str, str] | None, err: Console) -> None:
    """The report as JSON (`-`: standard output) and its HTML page (path, page), where asked for."""
    if json_path:
        text = json.dumps(rep, indent=1)
        if json_path == "-":
            sys.stdout.write(text + "\n")
        else:
            Path(json_path).write_text(text)
            err.print(f"JSON report: {json_path}")
    if html_page:
        path, page = html_page
        Path(path).write_text(page)
        err.print(f"HTML report: {path}")
