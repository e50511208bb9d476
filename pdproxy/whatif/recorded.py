"""The recording's own figures, as `pdproxy report` computes them: what the self-replay is checked against.

From the bench record when there is one (TTFT and token gaps as the client saw them; the proxy's traces
beside it add the KV wait), else from the proxy's traces alone: each root span's time to first chunk,
end-to-end time and per-request ITL summary (`pd.itl.*`), its KV wait from `pd.kv_transfer`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pdproxy.bench import records, report as bench_report, traces


def from_traces(idx: traces.TraceIndex) -> dict[str, Any] | None:
    infos = sorted((i for i in idx.by_request.values() if i.deployment == "primary"), key=lambda i: i.start)
    if not infos:
        return None
    t0 = infos[0].start
    recs = []
    for n, info in enumerate(infos):
        a = info.attrs
        ttft = a.get("gen_ai.response.time_to_first_chunk")
        ok = info.status != "ERROR" and isinstance(ttft, (int, float))
        summary = {"count": a.get("pd.itl.count"), "p99": a.get("pd.itl.p99"), "max": a.get("pd.itl.max")}
        recs.append({"type": "request", "run_id": "recorded", "request_id": info.request_id, "class": "traced",
                     "index": n, "seq": n, "warmup": False, "start_time": info.start - t0,
                     "start_offset": info.start - t0, "status": 200 if ok else 500, "ok": ok,
                     "error": None if ok else "error", "ttft": ttft if ok else None,
                     "e2e": info.duration if ok else None, "end": info.duration, "itl": [], "itl_summary": summary,
                     "output_tokens": a.get("gen_ai.usage.output_tokens"),
                     "prompt_tokens": a.get("gen_ai.usage.input_tokens")})
    run = records.Run(header={"type": "run", "run_id": "recorded", "label": "recorded", "tool": "pdproxy traces",
                              "conditions": {}}, requests=recs, source="traces")
    return _with_bands(bench_report.build([run], idx, unit="chunk", verdict=False)["runs"][0])


def entry(bench: str | None, idx: traces.TraceIndex | None) -> dict[str, Any] | None:
    """The recording's report entry, with the sampling band of each figure the self-replay checks (`bands`);
    None when there is neither a bench record nor a request trace."""
    if bench:
        return _with_bands(bench_report.build([records.read_run(bench)], idx, verdict=False)["runs"][0])
    return from_traces(idx) if idx is not None else None


def _with_bands(e: dict[str, Any]) -> dict[str, Any]:
    """`bands`: per self-replay figure (pdproxy/whatif/predict.py FIGURES), where the workload's true figure lies
    (`stats.percentile_band`, as the report computed it)."""
    found = {"TTFT": e["stats"]["bands"]["ttft"], "tail ITL": e["stats"]["bands"]["tail_itl"],
             "KV wait": (e.get("kv_transfer") or {}).get("upper_bound_bands") or {}}
    e["bands"] = {f"{name} {p}": band for name, per in found.items() for p, band in per.items()
                  if band is not None and p in ("p50", "p99")}
    return e


def routing(idx: traces.TraceIndex) -> dict[str, str]:
    """The routing policy of each leg (prefill, decode) as the recorded proxy named it on the leg's span
    (`pd.route.policy`): the self-replay routes as the run did. Legs whose spans say nothing are left out."""
    seen: dict[str, Counter[str]] = {}
    for info in idx.by_request.values():
        for leg in ("prefill", "decode"):
            policy = (info.stage_attrs.get(leg) or {}).get("pd.route.policy")
            if isinstance(policy, str):
                seen.setdefault(leg, Counter())[policy] += 1
    return {leg: counts.most_common(1)[0][0] for leg, counts in seen.items()}


def policies(routing: dict[str, str], mode: str) -> dict[str, Any]:
    """The model's policy fields (`ModelParams`) the recorded routing sets: P/D legs as recorded; a run of single
    instances routes with its decode pool's policy."""
    if mode == "single":
        return {"single_policy": routing["decode"]} if "decode" in routing else {}
    return {f"{leg}_policy": policy for leg, policy in routing.items()}
