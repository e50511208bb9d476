"""Primary vs shadow from the proxy's traces alone: one run per deployment, paired by request id.

`pdproxy serve --shadow-url ...` in front of live traffic leaves no bench records, only traces:
every request has a root span with `pd.deployment=primary` and, when it was mirrored, a second
root with `pd.deployment=shadow` and the same `pd.request_id` (docs/reference/telemetry.md). This module
turns those roots into bench-like request records so the report's statistics, verdict, table and
HTML apply unchanged. Only requests present in both deployments count (identical traffic on both
sides); the others are counted as unpaired and left out.

What the records hold is what the root span measured, at the proxy: TTFT = received → first
token-bearing chunk, E2E = received → end of stream, TPOT as the proxy computed it, and, instead
of every gap, the proxy's per-request ITL summary (`pd.itl.*`). Pooled ITL therefore does not
exist for these runs (stats.py says so in the report).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdproxy.bench import stats
from pdproxy.bench.records import Run
from pdproxy.bench.traces import TraceIndex, TraceInfo

PRIMARY, SHADOW = "primary", "shadow"
TOOL = "pdproxy serve (trace roots, proxy-side)"

DEFINITIONS = {
    "measured_at": "the proxy (root spans of its traces), not a client: no client network or client queueing "
                   "is included",
    "ttft": "proxy received the request -> first token-bearing chunk from the instance "
            "(gen_ai.response.time_to_first_chunk, proxy clock)",
    "e2e": "proxy received the request -> end of the stream (pd.e2e)",
    "tpot": "(last token - first token) / (output tokens - 1), as the proxy measured it (pd.tpot)",
    "tail_itl": "per request: the proxy's p99 and max of its own gaps (pd.itl.p99, pd.itl.max); then "
                "p50/p90/p99 across requests",
    "itl_pooled": "not available: traces carry per-request ITL summaries (pd.itl.*), not every gap",
    "failures": "a root with error.type (proxy's error vocabulary), or without a first token (no_token); "
                "counted in error rate, excluded from latency distributions",
    "pairing": "runs hold only the request ids with a root in both deployments; unpaired ids are counted, "
               "not used",
    "warmup": "the first --warmup-requests paired requests (by primary start) and those started in the first "
              "--warmup-seconds are excluded from both runs",
    "throughput": "each deployment's over its own requests, paired or not (a shadow sampling part of the traffic "
                  "serves fewer): output tokens of its successful requests / its first start to its last end, "
                  "warm-up left out; the number of its requests is given beside it",
}
# A report of live traffic from traces alone (`pdproxy report --traces FILE`, no record files): no pairing.
TRAFFIC_DEFINITIONS = {k: v for k, v in DEFINITIONS.items() if k not in ("pairing", "warmup", "throughput")}
TRAFFIC_DEFINITIONS["warmup"] = ("the first --warmup-requests requests of each run and those started in its first "
                                 "--warmup-seconds are left out")
TRAFFIC_TOOL = "pdproxy serve (live traffic: trace roots, proxy-side)"


@dataclass
class Pairing:
    """How the two deployments' requests matched up, and each one's throughput over its own requests."""

    paired: int
    primary_only: int
    shadow_only: int
    warmup: int
    examples: dict[str, list[str]]
    own: dict[str, dict[str, Any]] | None = None  # deployment -> throughput over all its requests

    def as_dict(self) -> dict[str, Any]:
        return {"paired": self.paired, "primary_only": self.primary_only, "shadow_only": self.shadow_only,
                "warmup": self.warmup, "unpaired_examples": self.examples, "own_throughput": self.own}


def own_throughput(infos: list[TraceInfo], warmup_requests: int = 0, warmup_seconds: float = 0.0) -> dict[str, Any]:
    """Throughput over every request of one deployment (stats.run_stats' window and counts), warm-up left out:
    the first `warmup_requests` and those started in its first `warmup_seconds`."""
    infos = sorted(infos, key=lambda i: (i.start, i.request_id))
    t0 = infos[0].start if infos else 0.0
    recs = [record(i, n, t0, n < warmup_requests or i.start - t0 < warmup_seconds) for n, i in enumerate(infos)]
    st = stats.run_stats(recs, by_class=False)
    return {**st["throughput"], "requests": st["requests"]["measured"], "ok": st["requests"]["ok"]}


def _itl_summary(a: dict[str, Any]) -> dict[str, Any] | None:
    if not a.get("pd.itl.count"):
        return None
    return {"unit": a.get("pd.itl.unit", "chunk"), "count": a["pd.itl.count"],
            **{k: a.get(f"pd.itl.{k}") for k in ("mean", "p50", "p99", "max")}}


def record(info: TraceInfo, seq: int, t0: float, warmup: bool) -> dict[str, Any]:
    """One root span as a request record (the fields stats.py and report.py read)."""
    a = info.attrs
    ttft = a.get("gen_ai.response.time_to_first_chunk")
    error = a.get("error.type")
    if error is None and ttft is None:
        error = "no_token"  # as the bench counts it: an answer without a token is a failure
    ok = error is None
    rec: dict[str, Any] = {
        "type": "request",
        "request_id": info.request_id,
        "trace_id": info.trace_id,
        "class": a.get("gen_ai.operation.name", "unknown"),
        "index": seq,
        "seq": seq,
        "warmup": warmup,
        "start_time": info.start,
        "start_offset": info.start - t0,
        "prompt_words": None,
        "max_tokens": a.get("gen_ai.request.max_tokens"),
        "status": a.get("http.response.status_code"),
        "ok": ok,
        "error": error,
        "error_detail": info.status_message or None,
        "ttft": ttft if ok else None,
        "e2e": a.get("pd.e2e") if ok else None,
        "end": info.duration,
        "itl": [],
        "itl_summary": _itl_summary(a) if ok else None,
        "chunk_tokens": None,
        "chunks": a.get("pd.chunks"),
        "output_tokens": a.get("gen_ai.usage.output_tokens"),
        "prompt_tokens": a.get("gen_ai.usage.input_tokens"),
        "tpot": a.get("pd.tpot"),
        "stalls": a.get("pd.stalls"),
        "finish_reason": (a.get("gen_ai.response.finish_reasons") or [None])[0],
    }
    return rec


def split(idx: TraceIndex, *, warmup_requests: int = 0, warmup_seconds: float = 0.0,
          shadow_conditions: dict[str, Any] | None = None) -> tuple[list[Run], Pairing]:
    """Runs `primary` and `shadow` over the request ids both deployments traced."""
    if not idx.by_request:
        raise ValueError(f"no primary request traces in {', '.join(idx.sources)}")
    if not idx.shadow:
        raise ValueError(f"no shadow traces (pd.deployment=shadow) in {', '.join(idx.sources)}: "
                         "was the proxy started with --shadow-url?")
    both = set(idx.by_request) & set(idx.shadow)
    if not both:
        raise ValueError("no request id has a root in both deployments: nothing to compare")
    order = sorted(both, key=lambda rid: (idx.by_request[rid].start, rid))
    t0 = idx.by_request[order[0]].start
    warm = {rid for n, rid in enumerate(order)
            if n < warmup_requests or idx.by_request[rid].start - t0 < warmup_seconds}
    primary_only = sorted(set(idx.by_request) - both)
    shadow_only = sorted(set(idx.shadow) - both)
    own = {name: own_throughput(list(table.values()), warmup_requests, warmup_seconds)
           for name, table in ((PRIMARY, idx.by_request), (SHADOW, idx.shadow))}
    pairing = Pairing(paired=len(both), primary_only=len(primary_only), shadow_only=len(shadow_only),
                      warmup=len(warm), examples={PRIMARY: primary_only[:5], SHADOW: shadow_only[:5]}, own=own)
    runs = []
    for name, table in ((PRIMARY, idx.by_request), (SHADOW, idx.shadow)):
        first = min(table[rid].start for rid in order)
        reqs = [record(table[rid], n, first, rid in warm) for n, rid in enumerate(order)]
        targets = sorted({str(table[rid].attrs.get("pd.decode.instance")) for rid in order
                          if table[rid].attrs.get("pd.decode.instance")})
        header = {
            "type": "run", "run_id": name, "label": name, "tool": TOOL, "measured_at": "proxy",
            "target": ", ".join(targets[:4]) + (f" (+{len(targets) - 4})" if len(targets) > 4 else "") or None,
            "conditions": dict(shadow_conditions or {}) if name == SHADOW else {},
            "conditions_source": "--shadow-condition", "workload": None,
        }
        runs.append(Run(header=header, requests=reqs, source=", ".join(idx.sources), deployment=name))
    return runs, pairing


def traffic(idx: TraceIndex, *, warmup_requests: int = 0, warmup_seconds: float = 0.0) -> list[Run]:
    """Live traffic from traces alone: one run per proxy run (resource `pd.run`) and deployment, over every
    request it traced (no pairing, no record files). Labelled by the run, else `primary` / `shadow`."""
    groups: dict[tuple[str, str], list[TraceInfo]] = {}
    for info in [*idx.by_request.values(), *idx.shadow.values()]:
        groups.setdefault((str(info.resource.get("pd.run") or ""), info.deployment), []).append(info)
    if not groups:
        raise ValueError(f"no request traces (root spans with pd.request_id) in {', '.join(idx.sources) or 'the store'}")
    runs = []
    for (name, deployment), infos in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1] != PRIMARY, g[0][1])):
        infos.sort(key=lambda i: (i.start, i.request_id))
        t0 = infos[0].start
        reqs = [record(i, n, t0, n < warmup_requests or i.start - t0 < warmup_seconds) for n, i in enumerate(infos)]
        label = name if name and deployment == PRIMARY else f"{name} {deployment}".strip()
        targets = sorted({str(i.attrs[k]) for i in infos for k in ("pd.prefill.instance", "pd.decode.instance")
                          if i.attrs.get(k)})
        header = {
            "type": "run", "run_id": label, "label": label, "tool": TRAFFIC_TOOL, "measured_at": "proxy",
            "target": ", ".join(targets[:4]) + (f" (+{len(targets) - 4})" if len(targets) > 4 else "") or None,
            "conditions": {}, "conditions_source": "traces", "workload": None,
        }
        runs.append(Run(header=header, requests=reqs, source=", ".join(idx.sources), deployment=deployment))
    return runs
