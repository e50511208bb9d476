"""The report as terminal tables (rich): conditions, metrics side by side, flags, verdict, drill-down.

Readable in an 80-column terminal: cells wrap (never cut with an ellipsis), conditions shared by
every run are listed once under the table, and the drill-down prints one block per request so
trace and request ids are always whole (they are what you look up in the trace backend).
"""

from __future__ import annotations

import os
import textwrap
from typing import Any, Callable

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from pdproxy.bench.attribution import LARGE_KV_TOKENS
from pdproxy.bench.engine_spans import PARTS
from pdproxy.bench.report import CONDITION_LABELS


PIPE_WIDTH = 100  # columns when the output is a file or a pipe: what a terminal shows it in


def make_console(stderr: bool = False) -> Console:
    """The terminal's width; 100 columns when the output is a file or a pipe. COLUMNS, when exported, wins."""
    probe = Console(stderr=stderr)
    columns = os.environ.get("COLUMNS", "")
    return Console(stderr=stderr, width=None if probe.is_terminal or columns.isdigit() else PIPE_WIDTH)


def ms(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x * 1e3:.{digits}f}"


def trio(d: dict[str, Any] | None, keys: tuple[str, ...] = ("p50", "p90", "p99")) -> str:
    if not d or not d.get("count"):
        return "n/a"
    return " / ".join(ms(d.get(k)) for k in keys)


def band_pair(bands: dict[str, Any] | None) -> str:
    """p50 and p99 95 % bands (stats.bands): "44.0–48.0 / ≥130.7" (≥: the run does not bound it above)."""
    if not bands:
        return "n/a"
    return f"{band_text(bands.get('p50'))} / {band_text(bands.get('p99'))}"


def band_text(band: list[float | None] | tuple[float | None, float | None] | None, unit: float = 1e3) -> str:
    """A percentile's band in ms: "44.0–48.0", "≥130.7" where unbounded above, "≤9.0" below, "any" both."""
    if band is None:
        return "n/a"
    lo, hi = (None if b is None else f"{b * unit:,.1f}" for b in band)
    return f"{lo}–{hi}" if lo and hi else f"≥{lo}" if lo else f"≤{hi}" if hi else "any"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def condition_rows(report: dict[str, Any]) -> list[tuple[str, list[str]]]:
    runs = report["runs"]
    keys: list[str] = []
    for e in runs:
        for k in e["conditions"]:
            if k not in keys:
                keys.append(k)
    order = list(CONDITION_LABELS)
    keys.sort(key=lambda k: (order.index(k) if k in order else len(order), k))
    rows = [(CONDITION_LABELS.get(k, k), [str(e["conditions"].get(k, "—")) for e in runs]) for k in keys]
    rows.append(("workload", [_workload_brief(e.get("workload")) for e in runs]))
    rows.append(("tool / target", [f"{e['tool']} → {e.get('target') or '?'}" for e in runs]))
    return rows


def conditions_table(report: dict[str, Any]) -> Group:
    """The conditions that differ between runs side by side; the ones all runs share, once, below."""
    t = Table(title="Fixed conditions", title_justify="left")
    rows = condition_rows(report)
    t.add_column("condition", style="bold", overflow="fold")
    for e in report["runs"]:
        t.add_column(e["label"], overflow="fold")
    shared = []
    for name, cells in rows:
        if len(cells) > 1 and len(set(cells)) == 1:
            shared.append(Text.assemble((f"{name}: ", "bold"), cells[0]))
        else:
            t.add_row(Text(name), *map(Text, cells))
    if shared:
        return Group(t, Text("Same in every run:", style="bold"), *(Text("  ") + line for line in shared))
    return Group(t)


def _workload_brief(w: dict[str, Any] | None) -> str:
    if not w:
        return "—"
    parts = []
    for c in w.get("classes") or []:
        load = f"c={c['concurrency']}" if c.get("concurrency") else f"{c.get('rate'):.3g}/s {c.get('arrival')}"
        src = f"corpus {c['corpus']}" if c.get("corpus") else f"prompt {c.get('prompt')}"
        parts.append(f"{c.get('name')}: {src}, out {c.get('output')}, {load}")
    stop = f"{w['requests']} req" if w.get("requests") else f"{w.get('duration'):g}s"
    warm = []
    if w.get("warmup_requests"):
        warm.append(f"{w['warmup_requests']} req")
    if w.get("warmup_seconds"):
        warm.append(f"{w['warmup_seconds']:g}s")
    return "; ".join(parts) + f"; {stop}, seed {w.get('seed')}, warm-up {' + '.join(warm) or 'none'}"


def metric_rows(report: dict[str, Any], all_rows: bool = True) -> list[tuple[str, list[str]]]:
    """The comparison table as data: (metric, one cell per run). Shared by the terminal and HTML.

    Without `all_rows`, only the rows that decide: what the verdict weighs (TTFT, per-request max ITL, KV
    transfer, errors) and what says whether to trust it (counts, bands, stalls, stages, throughput); the
    others (per class, pooled ITL, TPOT, E2E, vLLM's split, ...) come with `all_rows` (`--all`, the HTML)."""
    return [(name, cells) for name, cells, key in _rows(report) if all_rows or key]


def hidden_rows(report: dict[str, Any]) -> int:
    """How many rows `metric_rows(report, all_rows=False)` leaves out."""
    return sum(1 for _, _, key in _rows(report) if not key)


def _rows(report: dict[str, Any]) -> list[tuple[str, list[str], bool]]:
    runs = report["runs"]
    d = report["definitions"]
    rows: list[tuple[str, list[str], bool]] = []

    def row(name: str, fn: Callable[[dict[str, Any]], str], key: bool = False) -> None:
        rows.append((name, [fn(e) for e in runs], key))

    row("requests measured (ok / failed)", lambda e: "{measured} ({ok} / {failed})".format(**e["stats"]["requests"]),
        True)
    length_classes = sorted({c for e in runs for c in (e["stats"].get("lengths") or {})})
    for what in ("prompt", "output"):
        for c in length_classes:
            off = any((((e["stats"].get("lengths") or {}).get(c) or {}).get(what) or {}).get("flagged") for e in runs)
            row(f"{what} tokens asked → actual (p50), class {c}", lambda e, c=c, what=what: _asked(e, c, what), off)
    row("TTFT", lambda e: trio(e["stats"]["ttft"]), True)
    row("  TTFT p50 / p99: 95 % band", lambda e: band_pair((e["stats"].get("bands") or {}).get("ttft")), True)
    classes = sorted({c for e in runs for c in (e["stats"].get("classes") or {})})
    for c in classes:
        row(f"  TTFT, class {c}", lambda e, c=c: trio(((e["stats"].get("classes") or {}).get(c) or {}).get("ttft")))
    row(f"ITL pooled (per {d['itl_unit']})", _pooled_itl)
    row("tail ITL: per-request p99", lambda e: trio(e["stats"]["tail_itl"]["per_request_p99"]))
    row("tail ITL: per-request max", lambda e: trio(e["stats"]["tail_itl"]["per_request_max"]), True)
    row("  per-request max p50 / p99: 95 % band",
        lambda e: band_pair((e["stats"].get("bands") or {}).get("tail_itl")), True)
    for c in classes:
        row(f"  per-request max, class {c}", lambda e, c=c: trio(
            (((e["stats"].get("classes") or {}).get(c) or {}).get("tail_itl") or {}).get("per_request_max")))
    row(f"requests with a gap > {d['stall_threshold_s'] * 1e3:g} ms",
        lambda e: _num(e["stats"]["stalls"]["share"], "{:.1%}"), True)
    row("TPOT", lambda e: trio(e["stats"]["tpot"]))
    row("E2E", lambda e: trio(e["stats"]["e2e"]))
    pd_runs = any(e.get("kv_transfer") for e in runs)
    row("KV transfer, upper bound", lambda e: trio((e.get("kv_transfer") or {}).get("upper_bound")) if e.get(
        "kv_transfer") else ("n/a (no P/D)" if e.get("stages") else "n/a (no traces)"), pd_runs)
    row("KV transfer, estimated", lambda e: trio((e.get("kv_transfer") or {}).get("estimated")) if e.get(
        "kv_transfer") else "n/a")
    row("proxy hand-off gap", lambda e: trio((e.get("kv_transfer") or {}).get("handoff_gap")) if e.get(
        "kv_transfer") else "n/a")
    if any(e.get("disaggregation") for e in runs):
        row("decode only (selective disaggregation)", lambda e: "{share:.1%} ({decode_only} of {requests})".format(
            **e["disaggregation"]) if e.get("disaggregation") else "n/a", True)
    row("stages p50: queue, prefill, kv, decode", _stage_split, any(e.get("stages") for e in runs))
    if any(e.get("engine_split") for e in runs):
        for st, pt in PARTS:
            key = f"{st}.{pt}"
            cells = [((e.get("engine_split") or {}).get("parts") or {}).get(key) for e in runs]
            if not any(c and c.get("count") for c in cells):
                continue  # a part no run has (no failed attempts, single runs only, ...)
            if pt == "overlap" and not any(c and c.get("max") for c in cells):
                continue  # nothing overlapped
            row(f"  vLLM split: {key}", lambda e, key=key: trio(
                ((e.get("engine_split") or {}).get("parts") or {}).get(key)) if e.get("engine_split") else "n/a")
    if any(e.get("stall_attribution") for e in runs):
        row("stall time by cause", _stall_shares, True)
        row("max gap p50, with / without a large KV arrival (n)", _overlap)
    if any(e.get("engine_counters") for e in runs):
        row("prefix-cache hit rate (instances' counters)", _prefix_hits)
        row("prompt tokens computed (instances' counters)", lambda e: _num(
            (e.get("engine_counters") or {}).get("computed"), "{:.0f}") if e.get("engine_counters") else "n/a")
    row("proxy TTFT (trace)", lambda e: trio(e.get("proxy_ttft")) if e.get("proxy_ttft") else "n/a")
    row("throughput, output tokens/s", _throughput, True)
    row("throughput, requests/s", lambda e: _num(e["stats"]["throughput"]["requests_per_s"], "{:.2f}"))
    row("error rate", lambda e: _num(e["stats"]["requests"]["error_rate"], "{:.2%}"), True)
    row("errors by reason", lambda e: ", ".join(f"{k}: {v}" for k, v in e["stats"]["requests"]["errors"].items())
        or "none", True)
    pairing = report.get("pairing")
    if pairing:
        row("requests paired by id (+ only in this run)",
            lambda e: f"{pairing['paired']} (+{pairing.get(e.get('deployment', '') + '_only', 0)})", True)
    elif any(e.get("traces") for e in runs) and not report.get("traffic"):  # traffic: its records are the traces
        row("records joined to traces",
            lambda e: "{joined}/{records}".format(**e["traces"]) if e.get("traces") else "no traces", True)
    return rows


def _throughput(e: dict[str, Any]) -> str:
    """Output tokens/s; for a deployment of a shadow report, over its own requests (not only the paired)."""
    own = e.get("own_throughput")
    if own:
        return f"{_num(own['output_tokens_per_s'])} ({own['requests']} req)"
    return _num(e["stats"]["throughput"]["output_tokens_per_s"])


def _prefix_hits(e: dict[str, Any]) -> str:
    c = e.get("engine_counters")
    if not c:
        return "n/a"
    unread = [url for url, i in c["instances"].items() if "error" in i]
    text = _num(c["hit_rate"], "{:.1%}") + f" ({c['hits']:.0f} of {c['queries']:.0f} tokens)"
    return text + (f", {len(unread)} unreadable" if unread else "")


INSTANCE_NOTE = ("* attempts where they were sent, warm-up included (failed ones by reason, and KV hand-offs "
                 "abandoned, in the FLAG lines); the other columns: measured requests where they ended")
# Each role's own columns: a prefill has no KV wait, ITL or stalls (they happen on the decode), a decode's
# TTFT is its requests' (the prefill's included), a single instance does it all.
ROLE_COLUMNS: dict[str, tuple[str, ...]] = {
    "prefill": ("requests (failed)", "attempts* (failed)", "moved away*", "TTFT p50 / p99"),
    "decode": ("requests (failed)", "attempts* (failed)", "moved away*", "KV wait p50 / p99", "max ITL p50 / p99",
               "stalls"),
    "single": ("requests (failed)", "attempts* (failed)", "moved away*", "TTFT p50 / p99", "max ITL p50 / p99",
               "stalls"),
}


def _instance_cells(i: dict[str, Any]) -> dict[str, str]:
    return {
        "requests (failed)": f"{i['requests']} ({_by_reason(i['failed'], i['failures'])})",
        "attempts* (failed)": f"{i.get('attempts', 'n/a')} ({i.get('attempts_failed', 0)})",  # reasons: the flags
        "moved away*": str(i.get("moved_away", 0)),
        "TTFT p50 / p99": trio(i["ttft"], ("p50", "p99")),
        "KV wait p50 / p99": trio(i["kv_wait"], ("p50", "p99")) if i["kv_wait"]["count"] else "n/a",
        "max ITL p50 / p99": trio(i["max_itl"], ("p50", "p99")),
        "stalls": str(i["stalls"]),
    }


def instance_groups(e: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """A run's per-instance breakdown (bench/instances.py) as one table per role: (role, columns, rows), the
    first column the instance's address. Shared by the terminal and HTML."""
    out = []
    rows = e.get("instances") or []
    for role in [*ROLE_COLUMNS, *sorted({i["role"] for i in rows} - set(ROLE_COLUMNS))]:
        mine = [i for i in rows if i["role"] == role]
        if not mine:
            continue
        columns = ROLE_COLUMNS.get(role, ROLE_COLUMNS["single"])
        out.append((role, [role, *columns], [[i["address"], *(_instance_cells(i)[c] for c in columns)]
                                             for i in mine]))
    return out


def _by_reason(total: int, reasons: dict[str, int]) -> str:
    text = ", ".join(f"{k}: {v}" for k, v in reasons.items())
    return f"{total}" + (f": {text}" if text else "")


def shows_instances(report: dict[str, Any]) -> bool:
    """The breakdown is worth a table when some run spreads over more than one instance."""
    return any(len(e.get("instances") or []) > 1 for e in report["runs"])


def instances_tables(report: dict[str, Any]) -> list[Table]:
    out = []
    for e in report["runs"]:
        if len(e.get("instances") or []) < 2:
            continue
        for role, columns, rows in instance_groups(e):
            t = Table(title=f"Per {role} instance, {e['label']} (from the traces; ms)", title_justify="left")
            for c in columns:  # an address is looked up as it is: never broken over lines
                t.add_column(c, overflow="fold", justify="left" if c == role else "right", no_wrap=c == role)
            for r in rows:
                t.add_row(*map(Text, r))
            t.caption, t.caption_justify = INSTANCE_NOTE, "left"
            out.append(t)
    return out


def _asked(e: dict[str, Any], cls: str, what: str) -> str:
    v = ((e["stats"].get("lengths") or {}).get(cls) or {}).get(what)
    if not v or v["actual"] is None:
        return "n/a"
    asked = "?" if v["requested"] is None else f"{v['requested']:g}"
    return f"{asked} → {v['actual']:g}" + (" (off)" if v["flagged"] else "")


def _pooled_itl(e: dict[str, Any]) -> str:
    itl = e["stats"]["itl"]
    return "n/a: not in traces" if itl.get("available") is False else trio(itl)


def pairing_text(report: dict[str, Any]) -> str | None:
    """One sentence on how the deployments' requests matched up (None for bench runs)."""
    p = report.get("pairing")
    if not p:
        return None
    return (f"Paired by request id: {p['paired']} requests traced by both deployments"
            + (f" ({p['warmup']} of them warm-up)" if p.get("warmup") else "")
            + f"; unpaired, left out: {p['primary_only']} primary only, {p['shadow_only']} shadow only.")


def results_title(report: dict[str, Any]) -> str:
    """Says where the numbers were measured when it is not the client (runs built from traces)."""
    at = "" if all(e.get("measured_at", "client") == "client" for e in report["runs"]) else ", measured at the proxy"
    return f"Results{at} (ms unless stated; p50 / p90 / p99)"


MIN_LABEL = 20  # the metric column's narrowest before the figures are written tighter


def metrics_table(report: dict[str, Any], all_rows: bool = True, width: int | None = None) -> Table:
    """The results side by side. Where the runs' figures do not fit `width` on one line each, they are written
    without spaces ("46.0/59.9/149.1") if that makes them fit beside a metric column of MIN_LABEL; else they
    wrap between figures."""
    rows = metric_rows(report, all_rows)
    n = len(report["runs"])
    if width and rows:
        def need(cells_of: list[list[str]]) -> int:  # figures only: prose cells wrap as they must
            return sum(max((len(r[i]) for r in cells_of if "/" in r[i]), default=0) for i in range(n)) \
                + 3 * (n + 1) + 1

        natural = need([c for _, c in rows]) + max(len(name) for name, _ in rows)
        tight = [[c.replace(" / ", "/") for c in cells] for _, cells in rows]
        if natural > width and width - need(tight) >= MIN_LABEL:
            rows = [(name, cells) for (name, _), cells in zip(rows, tight)]
    t = Table(title=results_title(report), title_justify="left")
    t.add_column("metric", style="bold", overflow="fold")
    for e in report["runs"]:
        t.add_column(e["label"], justify="right", overflow="fold")
    for name, cells in rows:
        t.add_row(Text(name), *map(Text, cells))
    return t


def _stage_split(e: dict[str, Any]) -> str:
    st = e.get("stages")
    if not st:
        return "n/a"
    return " / ".join(ms(st[s]["p50"]) if st.get(s) and st[s]["count"] else "—"
                      for s in ("queue", "prefill", "kv_transfer", "decode"))


def _stall_shares(e: dict[str, Any]) -> str:
    a = e.get("stall_attribution")
    if not a:
        return "n/a (no traces)"
    if not a["stalls"]:
        return "no stalls"
    parts = [f"{c} {v['share']:.0%}" for c, v in a["by_cause"].items() if v["stalls"]]
    return f"{a['stalls']} stalls, {a['stall_time'] * 1e3:.0f} ms: " + ", ".join(parts)


def _overlap(e: dict[str, Any]) -> str:
    o = (e.get("stall_attribution") or {}).get("overlap")
    if not o:
        return "n/a (no P/D)"
    w, x = o["with_large_kv_arrival"], o["others"]
    return f"{ms(w['p50'])} ({w['count']}) / {ms(x['p50'])} ({x['count']})"


SHORT_PARTS = {"overhead": "overhead", "queue": "queue", "compute": "compute", "failed_attempts": "failed attempts",
               "handoff": "hand-off", "decode_intake": "intake", "kv_wait": "KV wait", "first_step": "first step",
               "http": "HTTP", "relay": "relay"}


def split_text(split: dict[str, float]) -> str:
    """A request's stages split by vLLM's spans (ms, named parts in PARTS order, those under 0.5 ms left out):
    `prefill 15 overhead + 17 compute | kv 57 KV wait + 7 first step | decode 1,330 compute − 2 overlap`."""
    out = []
    for stage, short in (("prefill", "prefill"), ("kv_transfer", "kv"), ("decode", "decode")):
        parts = [(pt, split[f"{st}.{pt}"]) for st, pt in PARTS if st == stage and f"{st}.{pt}" in split]
        if not parts:
            continue
        text = " + ".join(f"{v * 1e3:,.0f} {SHORT_PARTS.get(pt, pt)}" for pt, v in parts
                          if pt != "overlap" and v >= 5e-4)
        over = split.get(f"{stage}.overlap", 0.0)
        if over >= 5e-4:
            text += f" − {over * 1e3:,.0f} overlap"
        out.append(f"{short} {text or '0'}")
    return " | ".join(out)


def stalls_text(stalls: list[dict[str, Any]], total: int) -> str:
    """A request's stalls with their cause and the requests that coincided."""
    if not stalls:
        return ""
    out = []
    for s in stalls[:2]:
        who = ", ".join(w["request_id"] for w in s["with"][:2])
        out.append(f"{s['duration'] * 1e3:.0f}ms {s['cause']}" + (f" ({who})" if who else ""))
    more = f" +{total - 2}" if total > 2 else ""
    return "; ".join(out) + more


def verdict_text(report: dict[str, Any]) -> Group | None:
    """One verdict per kind of comparison: same resources first, then capacity, each named."""
    verdicts = report.get("verdicts") or ([report["verdict"]] if report.get("verdict") else [])
    if not verdicts:
        return None
    return Group(*(_one_verdict(v) for v in verdicts))


def _one_verdict(v: dict[str, Any]) -> Group:
    style = "bold green" if v["decision"] in ("adopt", "pass") else "bold red" if v["decision"] in (
        "don't adopt", "fail") else "bold yellow"  # no measurable difference, a trade-off, cannot tell
    head = Text.assemble(("Verdict: ", "bold"), (v["decision"].upper(), style),
                         f"  ({v['candidate']}" + (f" vs {', '.join(v['baselines'])})" if v["baselines"] else ")"))
    if v.get("resources_text"):
        head.append(f" · {v['resources_text']}", style="bold")
    t = Table(show_header=True, box=None, padding=(0, 1))
    for col in ("", "criterion", "detail"):
        t.add_column(col, overflow="fold")
    for c in v["criteria"]:
        mark = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "[dim]—[/]"}[c["passed"]]
        name = c["criterion"] + (f" vs {c['baseline']}" if c.get("baseline") else "")
        t.add_row(mark, Text(name), Text(c["detail"]))
    lines: list[Any] = [head, Text(f"decided by: {v['reason']}"), t]
    for n in v.get("notes") or []:
        lines.append(Text(f"note: {n}", style="yellow"))
    return Group(*lines)


def drilldown_blocks(report: dict[str, Any], per_run: int = 3, width: int | None = None) -> Group:
    """The slowest and failed requests, one block each: ids on lines of their own, never shortened; a long
    value wraps under itself (at `width`)."""
    lines: list[Any] = [Text("Slowest requests (drill-down: pdproxy trace ID, or your trace backend)",
                             style="bold")]

    def line(name: str, value: str) -> None:
        if width and len(value) > width - 13:
            value = "\n".join(textwrap.wrap(value, width - 13, subsequent_indent=" " * 13,
                                             break_long_words=False, break_on_hyphens=False))
        lines.append(Text(f"  {name:<11}{value}", overflow="fold"))

    def block(run: str, by: str, r: dict[str, Any], facts: str) -> None:
        lines.append(Text.assemble((f"{run} · {by}", "bold"), f"  class {r['class']}  {facts}"))
        line("trace id", r.get("trace_id") or "— (not traced)")
        line("request id", r["request_id"])

    for e in report["runs"]:
        for by in ("ttft", "tail_itl"):
            for r in e["slowest"][by][:per_run]:
                st = r.get("stages") or {}
                split = (" / ".join(ms(st.get(s)) if s in st else "—" for s in ("queue", "prefill", "kv_transfer",
                                                                                "decode")) + " ms"
                         if st else "no trace")
                block(e["label"], "slowest TTFT" if by == "ttft" else "slowest tail ITL", r,
                      f"TTFT {ms(r['ttft'])} ms, max ITL {ms(r['itl_max'])} ms")
                for leg, where in (r.get("placement") or {}).items():
                    line(leg, where)
                line("stages", f"queue/prefill/kv/decode {split}")
                if r.get("split"):
                    line("vLLM split", split_text(r["split"]) + " ms")
                if r.get("stalls"):
                    line("stalls", stalls_text(r["stalls"], r.get("stall_count", 0)))
        for r in e["failed"][:per_run]:
            block(e["label"], "failed", r, f"{r.get('error')} in {r.get('failed_stage') or '?'}")
            for leg, where in (r.get("placement") or {}).items():
                line(leg, where)
            if r.get("error_detail"):
                line("detail", r["error_detail"])
    return Group(*lines)


def definitions_text(report: dict[str, Any]) -> str:
    """How every row is defined (the report's `definitions`, as prose)."""
    d = report["definitions"]
    return (f"Percentiles: {d['percentiles']}. ITL unit: {d['itl_unit']}"
            + (f" ({d['itl_unit_note']})" if d.get("itl_unit_note") else "")
            + f". Tail ITL: {d['tail_itl']}. Bands: {d['bands']}. KV transfer: {d['kv_transfer']} Failures: "
              f"{d['failures']}."
            + (f" Split by vLLM's spans: {d['engine_split']} {d.get('overlap', '')}."
               if any(e.get("engine_split") for e in report["runs"]) else "")
            + (f" Stall attribution: {d['stall_attribution']}"
               if any(e.get("stall_attribution") for e in report["runs"]) else "")
            + (f" Measured at {d['measured_at']}; TTFT: {d['ttft']}; E2E: {d['e2e']}. Pooled ITL: {d['itl_pooled']}."
               if d.get("measured_at") else ""))


def all_definitions(defs: dict[str, Any]) -> list[tuple[str, str]]:
    """Every definition a report can use, one (name, text) each: `pdproxy report --definitions` alone."""
    return [(k, str(v)) for k, v in defs.items() if v is not None]


def _definitions_pointer(report: dict[str, Any]) -> str:
    """One line in place of the definitions: what changes between reports, and where the rest is."""
    d = report["definitions"]
    note = f" ({d['itl_unit_note']})" if d.get("itl_unit_note") else ""
    return (f"ITL per {d['itl_unit']}{note}; stall: a gap over {d['stall_threshold_s'] * 1e3:g} ms. How each row "
            "is defined: pdproxy report --definitions.")


MORE_ROWS = "add --all, or see the HTML page (--html FILE)"


def render(report: dict[str, Any], console: Console | None = None, drilldown: bool = True,
           drilldown_rows: int = 3, definitions: bool = False, all_rows: bool = False,
           more: str = MORE_ROWS) -> None:
    """The report in the terminal; how each row is defined only with `definitions` (it is the same text
    after every table: `pdproxy report --definitions`, and in the JSON). The results table holds the rows
    that decide, every row with `all_rows`; `more` says how to get the others, as the calling command takes it."""
    console = console or Console()
    console.print(conditions_table(report))
    for e in report["runs"]:
        for n in e.get("condition_notes") or []:
            console.print(f"[yellow]note[/] {e['label']}: {n}")
        wrong = (e.get("engine_split") or {}).get("id_mismatches")
        if wrong:
            console.print(f"[yellow]note[/] {e['label']}: {wrong} vLLM span(s) under this run's requests carry another "
                          "request's gen_ai.request.id (expected cmpl-<X-Request-Id>-0): their split may be wrong")
    console.print(metrics_table(report, all_rows, console.width))
    hidden = 0 if all_rows else hidden_rows(report)
    if hidden:
        console.print(Text(f"{hidden} more rows (per class, pooled ITL, TPOT, E2E, vLLM's split, ...): {more}",
                           style="dim"))
    if shows_instances(report):
        for t in instances_tables(report):
            console.print(t)
    console.print(Text(definitions_text(report) if definitions else _definitions_pointer(report), style="dim"))
    pt = pairing_text(report)
    if pt:
        console.print(Text(pt, style="bold"))
    comp = report["comparison"]
    compared = bool(report.get("verdict")) or not report.get("traffic")  # live traffic's runs are not a comparison
    if comp.get("resources") and compared:
        console.print(Text(f"Comparison: {comp['resources']}", style="bold"))
    for f in comp.get("flags") or [] if compared else []:
        console.print(Text(f"FLAG: {f}", style="bold yellow"))
    for e in report["runs"]:
        for f in e.get("instance_flags") or []:
            console.print(Text(f"FLAG: {e['label']}: {f}", style="bold yellow"))
        for f in e.get("length_flags") or []:
            console.print(Text(f"FLAG: {e['label']}: {f}: more than 5 % off what the workload asked",
                               style="bold yellow"))
        for n in (e.get("prompts") or {}).get("notes") or []:
            console.print(Text(f"note: {e['label']}: {n}", style="yellow"))
    vt = verdict_text(report)
    if vt is not None:
        console.print(vt)
    if drilldown:
        console.print(drilldown_blocks(report, drilldown_rows, console.width))
