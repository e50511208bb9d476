"""Build the comparison report (a plain dict, which is also the JSON output) from runs and traces.

One entry per run (set-up): its fixed conditions (from bench flags, completed by the trace
resource attributes), the statistics of `stats.run_stats`, the proxy-side stage breakdown and KV
transfer joined from the traces by request id, the slowest and failed requests with trace ids,
and CDF points for the plots. Then the comparison of conditions across runs and the verdict.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Sequence

import numpy as np

from pdproxy import __version__
from pdproxy.bench import attribution, engine_spans, instances, stats, traces
from pdproxy.bench.records import Run
from pdproxy.bench.verdict import Slo, decide

KV_DEFINITION = (
    "pd.kv_transfer span = prefill response read -> first decode token received: an upper bound "
    "(proxy hand-off + HTTP + the decode's intake before its engine queue + its queue and KV pull + one decode "
    "step; for a request moved off a failed decode, the failed attempts too). 'estimated' = that minus one "
    "median ITL of the request (pd.kv_transfer.estimated). 'proxy hand-off gap' = pd.handoff.gap, the proxy's "
    "own measured time from the prefill's answer to the decode's request, less the failed decode attempts "
    "before it. Single-instance set-ups have no transfer."
)

CONDITION_LABELS: dict[str, str] = {
    "pd.run": "run label",
    "pd.mode": "mode",
    "vllm.version": "vLLM version",
    "vllm.model": "model",
    "vllm.model.revision": "model revision",
    "vllm.dtype": "dtype",
    "vllm.max_model_len": "max model len",
    "vllm.enable_chunked_prefill": "chunked prefill",
    "vllm.max_num_batched_tokens": "max-num-batched-tokens",
    "gpu.kind": "GPU kind",
    "gpu.count": "GPU count",
    "pd.kv_connector": "KV connector",
    "pd.kv_connector.version": "connector version",
    "pd.prefill.count": "prefill instances",
    "pd.decode.count": "decode instances",
    "pd.prefill.tp": "prefill TP",
    "pd.prefill.pp": "prefill PP",
    "pd.decode.tp": "decode TP",
    "pd.decode.pp": "decode PP",
    "service.version": "proxy version",
}

# Condition keys grouped into the axes the evaluation plan varies one at a time.
SETUP_KEYS = ("pd.mode", "vllm.enable_chunked_prefill", "vllm.max_num_batched_tokens", "pd.kv_connector",
              "pd.kv_connector.version")
RATIO_KEYS = ("pd.prefill.count", "pd.decode.count")
PARALLEL_KEYS = ("pd.prefill.tp", "pd.prefill.pp", "pd.decode.tp", "pd.decode.pp")
IGNORED_KEYS = {"pd.run", "gpu.count"}


BAND_DEFINITION = (
    f"{stats.BAND_LEVEL:.0%} band of a percentile: where the workload's true percentile lies, given the requests "
    "measured (the order statistics that bracket it; '≥ x': the run does not bound it above, as a p99 of fewer than "
    "368 requests is not bounded above); a lower bound on the run-to-run spread, requests of one run not being "
    "independent. A difference where each run's figure lies inside the other's band may not reproduce")


def _cdf(values: Sequence[float], points: int = 200) -> list[list[float]]:
    """Down-sampled empirical CDF: [[value, fraction], ...] (exact for small sets)."""
    if not values:
        return []
    arr = np.sort(np.asarray(values, dtype=float))
    n = len(arr)
    if n <= points:
        return [[float(v), (i + 1) / n] for i, v in enumerate(arr)]
    qs = np.linspace(0, 100, points)
    return [[float(np.percentile(arr, q)), float(q / 100)] for q in qs]


def _merge_conditions(run: Run, infos: list[traces.TraceInfo]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    given = {k: v for k, v in run.conditions.items() if v is not None and v != ""}
    from_traces = traces.resource_conditions(infos, run.deployment) if infos else {}
    merged = dict(given)
    given_by = str(run.header.get("conditions_source") or "bench")
    sources = {k: given_by for k in given}
    notes = []
    for k, v in from_traces.items():
        if k not in merged:
            merged[k] = v
            sources[k] = "trace"
        elif str(merged[k]) != str(v):
            notes.append(f"{k}: {given_by} says {merged[k]!r}, the proxy's traces say {v!r} (trace value used)")
            merged[k] = v
            sources[k] = "trace"
    return merged, sources, notes


def _engine_split(infos: list[traces.TraceInfo]) -> dict[str, Any] | None:
    """Percentiles of each part of the stages, over the requests whose vLLM spans allow that part."""
    splits = [engine_spans.split(i) for i in infos]
    if not any(splits):
        return None
    parts = {f"{st}.{pt}": stats.describe(s.get(f"{st}.{pt}") for s in splits) for st, pt in engine_spans.PARTS}
    return {"parts": parts, "requests": sum(1 for s in splits if s),
            "id_mismatches": sum(engine_spans.id_mismatches(i) for i in infos)}


def _disaggregation(infos: list[traces.TraceInfo]) -> dict[str, Any] | None:
    """Selective disaggregation's verdicts on the roots (pd.disaggregation), when the proxy made any."""
    verdicts = [(i.attrs["pd.disaggregation"], i.attrs.get("pd.disaggregation.reason")) for i in infos
                if "pd.disaggregation" in i.attrs]
    if not verdicts:
        return None
    decode_only = sum(1 for decision, _ in verdicts if decision == "decode_only")
    reasons: dict[str, int] = {}
    for decision, reason in verdicts:
        key = f"{decision}: {reason}"
        reasons[key] = reasons.get(key, 0) + 1
    return {"requests": len(verdicts), "decode_only": decode_only, "share": decode_only / len(verdicts),
            "reasons": dict(sorted(reasons.items()))}


def run_entry(run: Run, idx: traces.TraceIndex | None, *, unit: str, stall_threshold: float,
              slowest: int, timeline: attribution.Timeline | None = None) -> dict[str, Any]:
    st = stats.run_stats(run.requests, unit=unit, stall_threshold=stall_threshold)
    u = st["itl"]["unit"]
    measured = [r for r in run.requests if not r.get("warmup")]
    ok = [r for r in measured if r.get("ok")]
    joined: dict[str, traces.TraceInfo] = {}
    join_counts = None
    if idx is not None:
        joined, join_counts = traces.join(run.requests, idx, run.deployment)
        run.traces = joined
    ok_infos = [joined[r["request_id"]] for r in ok if r["request_id"] in joined]
    conditions, sources, notes = _merge_conditions(run, list(joined.values()))
    kv = None
    stages = None
    proxy_ttft = None
    if ok_infos:
        stages = {s: stats.describe(i.stages[s] for i in ok_infos if s in i.stages) for s in traces.STAGES}
        proxy_ttft = stats.describe(i.attrs.get("gen_ai.response.time_to_first_chunk") for i in ok_infos)
        kv_infos = [i for i in ok_infos if "kv_transfer" in i.stages]
        if kv_infos:
            kv = {
                "definition": KV_DEFINITION,
                "upper_bound": stats.describe(i.stages["kv_transfer"] for i in kv_infos),
                "upper_bound_bands": stats.bands(i.stages["kv_transfer"] for i in kv_infos),
                "estimated": stats.describe(i.stage_attrs["kv_transfer"].get("pd.kv_transfer.estimated")
                                            for i in kv_infos),
                "handoff_gap": stats.describe(engine_spans.handoff(i)[0] for i in kv_infos),
                "failed_attempts": stats.describe(engine_spans.handoff(i)[1] for i in kv_infos),
                "decode_queue": stats.describe(i.stage_attrs["kv_transfer"].get("pd.decode.queue_time")
                                               for i in kv_infos),
            }
    mode = conditions.get("pd.mode")
    gpu = conditions.get("gpu.count")
    try:
        gpu_total = int(gpu) if gpu is not None else None
    except (TypeError, ValueError):
        gpu_total = None

    def brief(r: dict[str, Any]) -> dict[str, Any]:
        t = stats.request_tail(r, u)
        info = joined.get(r["request_id"])
        stalls = attribution.request_stalls(info, r, stall_threshold, timeline) if timeline and r.get("ok") else []
        return {
            "request_id": r["request_id"],
            "trace_id": info.trace_id if info else r.get("trace_id"),
            "traced": info is not None,
            "class": r.get("class"),
            "prompt_words": r.get("prompt_words"),
            "status": r.get("status"),
            "error": r.get("error"),
            "error_detail": r.get("error_detail"),
            "ttft": r.get("ttft"),
            "itl_p99": t[0] if t else None,
            "itl_max": t[1] if t else None,
            "e2e": r.get("e2e"),
            "stages": dict(info.stages) if info else None,
            "split": engine_spans.split(info) if info else {},
            "stalls": stalls[:5],
            "stall_count": len(stalls),
            "failed_stage": info.attrs.get("pd.failed_stage") if info else None,
            "instances": {k: info.attrs.get(f"pd.{k}.instance") for k in ("prefill", "decode")} if info else None,
            "placement": info.placement() if info else {},
        }

    by_ttft = sorted(ok, key=lambda r: r["ttft"], reverse=True)[:slowest]
    with_tail = [(stats.request_tail(r, u), r) for r in ok]
    by_tail = [r for t, r in sorted(((t, r) for t, r in with_tail if t), key=lambda x: x[0][1], reverse=True)][:slowest]
    failed = [r for r in measured if not r.get("ok")]
    pooled: list[float] = []
    maxes: list[float] = []
    by_start: list[list[float]] = []
    for r in ok:
        pooled.extend(stats.request_gaps(r, u))
        t = stats.request_tail(r, u)
        if t:
            maxes.append(t[1])
            by_start.append([r["start_offset"], t[1]])
    per_instance = instances.breakdown(run.requests, joined, unit=u, stall_threshold=stall_threshold)
    length_flags = [f"class {c}: {what} tokens {v['actual']:g} at the median, {v['requested']:g} asked "
                    f"({v['off']:+.1%})" for c, ls in (st.get("lengths") or {}).items()
                    for what, v in ls.items() if v["flagged"]]
    return {
        "label": run.label,
        "run_id": run.header.get("run_id"),
        "prompts": run.header.get("prompts"),
        "length_flags": length_flags,
        "source": run.source,
        "tool": run.header.get("tool", "pdproxy bench"),
        "measured_at": run.header.get("measured_at", "client"),
        "deployment": run.deployment,
        "target": run.header.get("target"),
        "started_at": run.header.get("started_at"),
        "conditions": conditions,
        "condition_sources": sources,
        "condition_notes": notes,
        "workload": run.header.get("workload"),
        "sweep": run.header.get("sweep"),
        "mode": mode,
        "gpu_total": gpu_total,
        "stats": st,
        "traces": join_counts,
        "proxy_ttft": proxy_ttft,
        "stages": stages,
        "kv_transfer": kv,
        "disaggregation": _disaggregation(ok_infos),
        "engine_split": _engine_split(ok_infos),
        "instances": per_instance,
        "instance_flags": instances.flags(per_instance),
        "engine_counters": (run.summary or {}).get("engine_counters"),
        "stall_attribution": attribution.run_attribution(ok, joined, timeline, threshold=stall_threshold, unit=u)
        if timeline is not None and joined else None,
        "slowest": {"ttft": [brief(r) for r in by_ttft], "tail_itl": [brief(r) for r in by_tail]},
        "failed": [brief(r) for r in failed[:slowest * 2]],
        # each measured request's TTFT and largest gap: the verdict's goodput counts those meeting the SLOs
        "slo_points": [[r["ttft"], t[1] if t else None] for t, r in with_tail],
        "plots": {"ttft": _cdf([r["ttft"] for r in ok]), "itl": _cdf(pooled), "tail_itl": _cdf(maxes),
                  "tail_itl_by_start": by_start[:2000]},
    }


def _workload_axes(w: dict[str, Any] | None) -> dict[str, Any]:
    if not w:
        return {}
    classes = w.get("classes") or []
    return {
        "prompt length": [(c.get("name"), c.get("prompt"), c.get("corpus")) for c in classes],
        "output cap": [(c.get("name"), c.get("output")) for c in classes],
        "load": [(c.get("name"), c.get("concurrency"), c.get("rate"), c.get("arrival")) for c in classes],
        "other workload": {k: w.get(k) for k in ("model", "endpoint", "temperature", "seed", "requests", "duration",
                                                 "warmup_requests", "warmup_seconds", "ignore_eos",
                                                 "min_tokens")},
    }


def compare(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Which axes differ between runs; a flag when more than one does, or when GPU totals differ."""
    if len(entries) < 2:
        return {"axes_differing": [], "flags": [], "resources": None, "unknown": []}
    axes: dict[str, list[Any]] = {}
    unknown: list[str] = []
    modes_differ = len({str(e["conditions"].get("pd.mode")) for e in entries}) > 1

    def group(name: str, keys: Sequence[str]) -> None:
        vals = [tuple(str(e["conditions"].get(k)) for k in keys) for e in entries]
        axes[name] = vals

    group("set-up", SETUP_KEYS + (RATIO_KEYS if modes_differ else ()))
    if not modes_differ:
        group("P:D ratio", RATIO_KEYS)
    group("TP/PP", PARALLEL_KEYS)
    grouped = set(SETUP_KEYS) | set(RATIO_KEYS) | set(PARALLEL_KEYS) | IGNORED_KEYS
    others = sorted({k for e in entries for k in e["conditions"]} - grouped)
    for k in others:
        present = [k in e["conditions"] for e in entries]
        if not all(present):
            unknown.append(k)
            vals = [e["conditions"].get(k) for e in entries if k in e["conditions"]]
            axes[CONDITION_LABELS.get(k, k)] = [str(v) for v in vals]
        else:
            axes[CONDITION_LABELS.get(k, k)] = [str(e["conditions"][k]) for e in entries]
    wl = [_workload_axes(e.get("workload")) for e in entries]
    if all(wl):
        for name in wl[0]:
            axes[name] = [json.dumps(w.get(name), sort_keys=True) for w in wl]
    differing = [name for name, vals in axes.items() if len(set(map(str, vals))) > 1]
    flags = []
    if len(differing) > 1:
        flags.append(f"runs differ in {len(differing)} conditions ({', '.join(differing)}): "
                     "the evaluation plan varies one axis per comparison")
    gpus = [e.get("gpu_total") for e in entries]
    if any(g is None for g in gpus):
        resources = "unknown (GPU count not recorded for every run)"
    elif len(set(gpus)) > 1:
        resources = "capacity"
        flags.append("GPU totals differ (" + ", ".join(f"{e['label']}: {g}" for e, g in zip(entries, gpus))
                     + "): a capacity comparison, not same resources")
    else:
        resources = "same resources"
    return {"axes_differing": differing, "flags": flags, "resources": resources, "unknown": unknown}


def pick_candidate(entries: list[dict[str, Any]], wanted: str | None) -> dict[str, Any]:
    if wanted:
        for e in entries:
            if e["label"] == wanted:
                return e
        raise ValueError(f"--candidate {wanted!r} is not one of the runs: {[e['label'] for e in entries]}")
    pd = [e for e in entries if str(e.get("mode")) == "pd"]
    return pd[0] if pd else entries[-1]


def definitions_of(stall_threshold: float = stats.DEFAULT_STALL_THRESHOLD, itl_unit: str = "token or chunk",
                   unit_note: str | None = None) -> dict[str, Any]:
    """How each figure of a report is defined (the report's `definitions`; `pdproxy report --definitions`)."""
    return {
        "percentiles": f"numpy.percentile, method={stats.PERCENTILE_METHOD}",
        "itl_unit": itl_unit,
        "itl_unit_note": unit_note,
        "ttft": "client start -> first token-bearing SSE message (client clock)",
        "tail_itl": "per request: p99 and max of its own gaps; then p50/p90/p99 across requests",
        "bands": BAND_DEFINITION,
        "stall_threshold_s": stall_threshold,
        "kv_transfer": KV_DEFINITION,
        "engine_split": engine_spans.SPLIT_DEFINITION,
        "overlap": engine_spans.OVERLAP_DEFINITION,
        "stall_attribution": attribution.DEFINITION.format(tokens=attribution.LARGE_KV_TOKENS),
        "failures": "non-200, exception, error inside the stream, or no token-bearing message; counted in "
                    "error rate, excluded from latency distributions",
        "warmup": "warm-up requests are recorded but excluded from every statistic",
    }


def build(runs: list[Run], idx: traces.TraceIndex | None = None, *, unit: str = "auto",
          stall_threshold: float = stats.DEFAULT_STALL_THRESHOLD, slowest: int = 5, slo: Slo | None = None,
          candidate: str | None = None, baselines: list[str] | None = None, verdict: bool = True,
          definitions: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of `runs`; `definitions` replaces the default wording where the runs measure differently."""
    if not runs:
        raise ValueError("no runs to report")
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):  # keep labels unique so the columns can be told apart
        seen: dict[str, int] = {}
        for r in runs:
            n = seen.get(r.label, 0)
            seen[r.label] = n + 1
            if n:
                r.header["label"] = f"{r.label}#{n + 1}"
    timeline = attribution.Timeline([*idx.by_request.values(), *idx.shadow.values()]) if idx is not None else None
    entries = [run_entry(r, idx, unit=unit, stall_threshold=stall_threshold, slowest=slowest, timeline=timeline)
               for r in runs]
    units = {e["stats"]["itl"]["unit"] for e in entries}
    unit_note = None
    if len(units) > 1:  # one ITL definition across the comparison
        unit_note = "ITL split per token is not available for every run: all runs use per-chunk gaps"
        entries = [run_entry(r, idx, unit="chunk", stall_threshold=stall_threshold, slowest=slowest,
                             timeline=timeline) for r in runs]
        units = {e["stats"]["itl"]["unit"] for e in entries}
        if len(units) > 1:  # proxy summaries keep the unit they were measured in
            unit_note = ("ITL units differ between runs (" + ", ".join(f"{e['label']}: {e['stats']['itl']['unit']}"
                                                                    for e in entries)
                         + "); per-request summaries from traces cannot be re-split")
    defs = definitions_of(stall_threshold, "/".join(sorted(units)), unit_note)
    defs.update(definitions or {})
    report: dict[str, Any] = {
        "generated_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "pdproxy_version": __version__,
        "definitions": defs,
        "traces": None if idx is None else {
            "files": idx.sources, "spans": idx.spans, "traces": idx.traces,
            "request_traces": len(idx.by_request), "shadow_traces": len(idx.shadow),
            "duplicates": idx.duplicates, "engine_spans": idx.engine_spans,
            "engine_spans_outside_proxy": idx.engine_unjoined,
        },
        "runs": entries,
        "comparison": compare(entries),
        "verdict": None,
    }
    if verdict and len(entries) == 1 and slo is not None and slo.targets:  # no baseline: the run vs its SLOs
        alone = {**decide(entries[0], [], slo), "resources": "slo", "resources_text": "against its SLOs, no baseline"}
        report["verdicts"], report["verdict"] = [alone], alone
    if verdict and len(entries) > 1:
        cand = pick_candidate(entries, candidate)
        if baselines:
            missing = [b for b in baselines if b not in labels and b not in [e["label"] for e in entries]]
            if missing:
                raise ValueError(f"--baseline {missing} not among the runs: {[e['label'] for e in entries]}")
            bases = [e for e in entries if e["label"] in baselines and e is not cand]
        else:
            bases = [e for e in entries if e is not cand]
        verdicts = [{**decide(cand, group, slo or Slo()), "resources": kind, "resources_text": text}
                    for kind, text, group in resource_groups(cand, bases)]
        if verdicts:
            report["verdicts"] = verdicts
            report["verdict"] = verdicts[0]  # same resources first, when there is such a baseline
            comp = report["comparison"]
            if comp["resources"] == "capacity" and verdicts[0]["resources"] == "same resources":
                comp["resources"] = "same resources and capacity"
                comp["flags"] = [f.replace("a capacity comparison, not same resources",
                                           f"{cand['label']} against {', '.join(verdicts[0]['baselines'])} is on the "
                                           "same resources, against the others a capacity comparison (one verdict "
                                           "each)") for f in comp["flags"]]
    return report


def resource_groups(cand: dict[str, Any], bases: list[dict[str, Any]]) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """The baselines split as the plan compares them: on the candidate's GPU total first ("same resources",
    e.g. 1P1D vs two single instances on the same 2 GPUs), then on other totals ("capacity"), then unknown."""
    cg = cand.get("gpu_total")
    same = [b for b in bases if cg is not None and b.get("gpu_total") == cg]
    other = [b for b in bases if cg is not None and b.get("gpu_total") is not None and b.get("gpu_total") != cg]
    unknown = [b for b in bases if b not in same and b not in other]
    out = []
    if same:
        out.append(("same resources", f"same resources: {cg} GPU{'s' if cg != 1 else ''} each", same))
    if other:
        gpus = ", ".join(f"{b['label']} {b['gpu_total']}" for b in other)
        out.append(("capacity", f"capacity comparison with added resources: {cand['label']} {cg} GPUs vs {gpus}",
                    other))
    if unknown:
        out.append(("unknown", "resources unknown: GPU count not recorded for every run", unknown))
    return out
