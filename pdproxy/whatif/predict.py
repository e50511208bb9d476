"""Predictions as reports: each simulated set-up becomes a bench-shaped run, rendered by `pdproxy report`.

The model's outcomes are written as `pdproxy bench` request records (start offset, TTFT, per-token
gaps, tokens) plus the trace stages the report reads (queue, prefill, KV transfer, decode), so
`pdproxy.bench.report.build` computes the very rows a real run gets, and its table and HTML render
them. On top: a verdict per set-up against the recorded one, the expected error of each figure
(from the validation against real vLLM, docs/whatif.md), and which set-ups the prediction cannot
tell apart within that error, which are the real runs worth making next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdproxy.bench import report as bench_report
from pdproxy.bench.records import Run
from pdproxy.bench.traces import TraceIndex, TraceInfo
from pdproxy.bench.verdict import Slo, decide
from pdproxy.whatif.model import ModelParams, Outcome, median_gap, simulate
from pdproxy.whatif.setups import Setup
from pdproxy.whatif.workload import Workload

PREDICTION = "a PREDICTION of the what-if model (pdproxy whatif), not a measurement"

# Relative error of each figure: the largest |predicted - recorded| / recorded seen when replaying recorded
# vLLM 0.23 runs on the model (docs/whatif.md, "Validation": vllm023 one and two GPUs, P/D targets), leaving
# out the cases the docs name as outside the model (instances sharing one GPU's compute, a prefix cache
# warmed by an earlier run). Two set-ups whose predictions differ by less than that cannot be told apart.
EXPECTED_ERROR: dict[str, float] = {
    "TTFT p50": 0.50,
    "TTFT p99": 0.50,
    "tail ITL p50": 0.65,
    "tail ITL p99": 0.70,
    "KV wait p50": 0.50,
    "KV wait p99": 0.50,
}
FIGURES = (("ttft", "p50", "TTFT p50"), ("ttft", "p99", "TTFT p99"),
           ("tail_itl", "p50", "tail ITL p50"), ("tail_itl", "p99", "tail ITL p99"))


def error_text(errors: dict[str, float] = EXPECTED_ERROR) -> str:
    parts = ", ".join(f"{k} ±{v:.0%}" for k, v in errors.items())  # tail ITL = per-request max ITL
    return (f"This is {PREDICTION}. Expected error per figure (largest seen against recorded vLLM 0.23 runs, "
            f"docs/whatif.md): {parts}.")


@dataclass
class Prediction:
    """One set-up's predicted run: bench-shaped records and the trace stages the report joins to them."""

    setup: Setup
    run: Run
    traces: dict[str, TraceInfo]


def _record(o: Outcome, label: str, warmup_s: float) -> dict[str, Any]:
    r = o.request
    ok = o.error is None and o.first_token is not None and o.end is not None
    t = o.token_times
    gaps = [b - a for a, b in zip(t, t[1:])]
    return {
        "type": "request", "run_id": label, "request_id": f"{r.request_id}@{label}", "trace_id": None,
        "class": r.cls, "index": r.index, "seq": o.seq, "warmup": o.start < warmup_s,
        "start_time": o.start, "start_offset": o.start, "prompt_words": None,
        "prompt_tokens_requested": r.prompt_tokens_requested, "max_tokens": r.max_tokens or r.output_tokens,
        "status": 200 if ok else 500, "ok": ok, "error": None if ok else "model_error",
        "error_detail": o.error, "ttft": (o.first_token - o.start) if ok else None,
        "e2e": (o.end - o.start) if ok else None, "end": (o.end - o.start) if o.end is not None else None,
        "itl": gaps, "chunk_tokens": [1] * len(t), "chunks": len(t), "output_tokens": len(t) if ok else None,
        "prompt_tokens": r.prompt_tokens, "finish_reason": "length" if ok else None,
    }


def _trace(o: Outcome, rec: dict[str, Any]) -> TraceInfo | None:
    if not rec["ok"]:
        return None
    pd = o.prefill_instance is not None
    first, end, start = o.first_token, o.end, o.start
    assert first is not None and end is not None
    stages: dict[str, float] = {"queue": o.queue, "decode": end - first}
    times: dict[str, tuple[float, float]] = {"decode": (first, end)}
    attrs: dict[str, Any] = {"pd.mode": "pd" if pd else "single", "pd.decode.instance": o.decode_instance,
                             "gen_ai.usage.input_tokens": o.request.prompt_tokens}
    stage_attrs: dict[str, dict[str, Any]] = {}
    if pd and o.prefill_done is not None:
        attrs["pd.prefill.instance"] = o.prefill_instance
        stages["prefill"] = o.prefill_done - start
        times["prefill"] = (start, o.prefill_done)
        stages["kv_transfer"] = first - o.prefill_done
        times["kv_transfer"] = (o.prefill_done, first)
        mg = median_gap(o)
        stage_attrs["kv_transfer"] = {
            "pd.kv_transfer.estimated": stages["kv_transfer"] - (mg or 0.0), "pd.handoff.gap": 0.0,
            "pd.decode.queue_time": o.decode_queue}
    else:
        stages["prefill"] = first - start
        times["prefill"] = (start, first)
    return TraceInfo(trace_id="", request_id=rec["request_id"], root_name="whatif", attrs=attrs, resource={},
                     stages=stages, stage_attrs=stage_attrs, duration=end - start, status="OK", start=start,
                     stage_times=times)


def run_setup(workload: Workload, setup: Setup, params: ModelParams) -> Prediction:
    outcomes = simulate(workload, setup, params)
    label = setup.name + (" (recorded)" if setup.recorded else "")
    recs = [_record(o, label, workload.warmup_seconds) for o in outcomes]
    infos = {}
    for o, rec in zip(outcomes, recs):
        info = _trace(o, rec)
        if info is not None:
            infos[rec["request_id"]] = info
    header = {"type": "run", "format": "pdproxy-bench/1", "run_id": label, "label": label,
              "tool": "pdproxy whatif", "conditions": setup.conditions(), "workload": workload.header.get("workload"),
              "conditions_source": "whatif"}
    return Prediction(setup, Run(header=header, requests=recs, source=f"whatif:{setup.name}"), infos)


def build_report(workload: Workload, predictions: list[Prediction], slo: Slo | None = None,
                 errors: dict[str, float] = EXPECTED_ERROR) -> dict[str, Any]:
    idx = TraceIndex()
    for p in predictions:
        idx.by_request.update(p.traces)
    idx.sources = [f"whatif model of {workload.source}"]
    # the model streams one token per chunk, so its per-chunk gaps are per-token gaps: read as they are
    # (unit "chunk"), not re-split token by token, which costs the report most of its time on long replays
    report = bench_report.build([p.run for p in predictions], idx, unit="chunk", verdict=False, slo=slo, definitions={
        "itl_unit": "token", "itl_unit_note": "the model sends one token per chunk: its chunk gaps are token gaps",
        "ttft": "predicted: request sent -> first token, on the model's virtual clock",
        "prediction": error_text(errors),
        "stages": "queue = engine queue of the first leg (the model has no proxy queue); prefill, kv, decode as "
                  "pdproxy's stage spans",
    })
    entries = report["runs"]
    base = next((e for e, p in zip(entries, predictions) if p.setup.recorded), entries[0])
    verdicts = []
    for e in entries:
        if e is base:
            continue
        v = decide(e, [base], slo or Slo())
        v["resources"] = "same resources"
        v["resources_text"] = f"same GPU total; {PREDICTION}"
        v["notes"] = [*v.get("notes", []), "predicted figures: a difference inside the expected error is not a "
                                           "difference (see the suggested runs)"]
        verdicts.append(v)
    if verdicts:
        report["verdicts"] = verdicts
        report["verdict"] = verdicts[0]
    report["whatif"] = {
        "prediction": error_text(errors),
        "expected_error": dict(errors),
        "workload": {"source": workload.source, "requests": len(workload.requests), "notes": workload.notes},
        "suggested_runs": suggest(entries, predictions, errors),
    }
    return report


def _figure(e: dict[str, Any], metric: str, p: str) -> float | None:
    st = e["stats"]
    d = st["ttft"] if metric == "ttft" else st["tail_itl"]["per_request_max"]
    return d.get(p) if d else None


def suggest(entries: list[dict[str, Any]], predictions: list[Prediction],
            errors: dict[str, float] = EXPECTED_ERROR) -> list[str]:
    """The set-ups worth running for real: per figure, the best prediction and every set-up within the error."""
    out: list[str] = []
    worth: dict[str, list[str]] = {}
    for metric, p, name in FIGURES:
        err = errors.get(name, 0.5)
        vals = [(v, e["label"]) for e in entries if (v := _figure(e, metric, p)) is not None]
        if not vals:
            continue
        best, best_label = min(vals)
        close = [lab for v, lab in vals if lab != best_label and v * (1 - err) <= best * (1 + err)]
        worth.setdefault(best_label, []).append(name)
        if close:
            out.append(f"{name}: {best_label} predicts best ({best * 1e3:.0f} ms) but {', '.join(close)} "
                       f"{'is' if len(close) == 1 else 'are'} within the ±{err:.0%} error: measure "
                       f"{', '.join([best_label, *close])} for real")
        else:
            out.append(f"{name}: {best_label} predicts best ({best * 1e3:.0f} ms), clear of the others by more "
                       f"than the ±{err:.0%} error")
    recorded = next((p.setup.name for p in predictions if p.setup.recorded), None)
    runs = ", ".join(f"{lab} ({', '.join(figs)})" for lab, figs in worth.items())
    head = f"Real runs worth making next: {runs}" + (f", against the recorded {recorded}" if recorded else "")
    return [head, *out]


