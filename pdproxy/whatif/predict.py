"""Predictions as reports: each simulated set-up becomes a bench-shaped run, rendered by `pdproxy report`.

The model's outcomes are written as `pdproxy bench` request records (start offset, TTFT, per-token
gaps, tokens) plus the trace stages the report reads (queue, prefill, KV transfer, decode), so
`pdproxy.bench.report.build` computes the very rows a real run gets, and its table and HTML render
them. On top: a verdict per set-up against the recorded one, the expected error of each figure
(from the validation against real vLLM, docs/explanation/whatif.md), and which set-ups the prediction cannot
tell apart within that error, which are the real runs worth making next.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pdproxy.bench import report as bench_report, stats, table
from pdproxy.bench.records import Run
from pdproxy.bench.traces import TraceIndex, TraceInfo
from pdproxy.bench.verdict import Slo, decide
from pdproxy.whatif.model import Death, ModelParams, Outcome, median_gap, simulate
from pdproxy.whatif.setups import Setup
from pdproxy.whatif.workload import Workload

PREDICTION = "a PREDICTION of the what-if model (pdproxy whatif), not a measurement"

# The error a prediction states when it has no leave-one-out of its own (one recording): the largest leave-one-out
# miss per figure over the development set (benchmarks/whatif_validation.py: four clusters of recorded vLLM 0.23
# runs, each recording predicted by the model fitted to the others of its cluster; docs/explanation/whatif.md
# "Validation"), rounded up to 5 %. With two or more recordings `pdproxy whatif` states its own (pdproxy/whatif/loo.py).
# Predictions overlapping within it cannot be told apart.
EXPECTED_ERROR: dict[str, float] = {
    "TTFT p50": 0.40,
    "TTFT p99": 0.50,
    "tail ITL p50": 0.60,
    "tail ITL p99": 1.05,
    "KV wait p50": 0.50,
    "KV wait p99": 0.35,
    "completed": 1.30,
}


# vLLM's own run-to-run spread (tests/fixtures/real-repeats-2026-12-07: one workload repeated three times on one H100,
# P/D and single, `tests/test_whatif_repeats.py`): the largest over the smallest of the three, less one, the wider of
# the two set-ups. A replay closer than this to one run cannot be told from another run of the same workload.
VLLM_SPREAD: dict[str, float] = {"TTFT p50": 0.12, "TTFT p99": 0.39, "tail ITL p50": 0.22, "tail ITL p99": 1.18}
# What a self-replay must come within (issue 56's goal: TTFT ±25 %, tail ITL ±35 %; the KV wait as the TTFT it makes,
# completed requests as a TTFT), or vLLM's own spread where that is wider (`within`): beyond both the model does not
# fit the run.
REPLAY_TOLERANCE: dict[str, float] = {"TTFT p50": 0.25, "TTFT p99": 0.25, "tail ITL p50": 0.35, "tail ITL p99": 0.35,
                                      "KV wait p50": 0.25, "KV wait p99": 0.25, "completed": 0.25}


def within(figure: str, predicted: float, recorded: float, limit: float | None) -> bool:
    """`predicted` within `limit` of `recorded` (relative), or within vLLM's own spread of it (a factor: the repeats
    ran a factor of 2.18 apart on tail ITL p99, so a replay half the recorded one is one of vLLM's own runs)."""
    err = (predicted - recorded) / recorded
    spread = VLLM_SPREAD.get(figure, VLLM_SPREAD.get(figure.replace("KV wait", "TTFT")))
    if limit is not None and abs(err) <= limit:
        return True
    return spread is not None and predicted > 0 and abs(math.log(predicted / recorded)) <= math.log1p(spread)


def _kv(e: dict[str, Any], p: str) -> float | None:
    return ((e.get("kv_transfer") or {}).get("upper_bound") or {}).get(p)


# (name, how to read it from a report run entry): the figures a prediction states and a self-replay checks
FIGURES: tuple[tuple[str, Callable[[dict[str, Any]], float | None]], ...] = (
    ("TTFT p50", lambda e: e["stats"]["ttft"].get("p50")),
    ("TTFT p99", lambda e: e["stats"]["ttft"].get("p99")),
    ("tail ITL p50", lambda e: e["stats"]["tail_itl"]["per_request_max"].get("p50")),
    ("tail ITL p99", lambda e: e["stats"]["tail_itl"]["per_request_max"].get("p99")),
    ("KV wait p50", lambda e: _kv(e, "p50")),
    ("KV wait p99", lambda e: _kv(e, "p99")),
    ("completed", lambda e: float(e["stats"]["requests"]["ok"])),
)
# The model's own spread: the recorded set-up replayed SPREAD_SEEDS more times with up to SPREAD_JITTER_MS of jitter
# in every API server's time per request (the spread of vLLM 0.23's own, tests/fixtures/vllm023), seed by seed.
# Closed-loop clients in step settle into one grouping or another by such timing (docs/notes/whatif-issue40.md "Clients in
# step"): the figures it moves, the model cannot place closer than their spread, whatever the fit.
SPREAD_SEEDS = 4
SPREAD_JITTER_MS = 1.0

COMPARED = (("TTFT p50", "ttft", "p50"), ("TTFT p99", "ttft", "p99"),
            ("tail ITL p50", "tail_itl", "p50"), ("tail ITL p99", "tail_itl", "p99"))


def figures(entry: dict[str, Any]) -> dict[str, float | None]:
    """The FIGURES of a report entry, and the median token gap (all requests' gaps pooled: the fit reads the GPU's
    sharing in a P/D run off it)."""
    return {**{name: get(entry) for name, get in FIGURES}, "ITL p50": (entry["stats"].get("itl") or {}).get("p50")}


def overlap(a: float, b: float, err: float) -> bool:
    """Two predictions with the same relative error `err` whose bands [x(1-err), x(1+err)] meet."""
    return a * (1 - err) <= b * (1 + err) and b * (1 - err) <= a * (1 + err)


ERROR_SOURCES = {
    "validation": "the largest leave-one-out miss over the development set's recorded vLLM 0.23 runs, "
                  "docs/explanation/whatif.md \"Validation\"",
    "leave-one-out": "the largest miss of each given recording predicted by the model fitted to the others "
                     "(leave-one-out), at least the fit's own miss",
}


def error_text(errors: dict[str, float] = EXPECTED_ERROR, source: str = "validation") -> str:
    parts = ", ".join(f"{k} ±{v:.0%}" for k, v in errors.items())  # tail ITL = per-request max ITL
    return f"This is {PREDICTION}. Expected error per figure ({ERROR_SOURCES[source]}): {parts}."


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


def prediction_figures(pred: Prediction) -> dict[str, float | None]:
    """The FIGURES of one predicted run straight from its records: what `build_report` gives, without its cost
    (the whole-run fit replays the recorded set-up several times and reads only these)."""
    ok = [r for r in pred.run.requests if not r.get("warmup") and r.get("ok")]
    ttft = stats.describe(r["ttft"] for r in ok)
    tail = stats.describe(max(r["itl"]) for r in ok if r["itl"])
    kv = stats.describe(i.stages["kv_transfer"] for r in ok
                        if (i := pred.traces.get(r["request_id"])) is not None and "kv_transfer" in i.stages)
    gaps = stats.describe(g for r in ok for g in r["itl"])
    return {"TTFT p50": ttft["p50"], "TTFT p99": ttft["p99"], "tail ITL p50": tail["p50"], "tail ITL p99": tail["p99"],
            "KV wait p50": kv["p50"], "KV wait p99": kv["p99"], "completed": float(len(ok)), "ITL p50": gaps["p50"]}


def run_setup(workload: Workload, setup: Setup, params: ModelParams, deaths: tuple[Death, ...] = ()) -> Prediction:
    outcomes = simulate(workload, setup, params, deaths)
    label = setup.name + {(True, False): " (recorded)", (True, True): " (recorded, its failures replayed)",
                          (False, True): " (its failures replayed)"}.get((setup.recorded, bool(deaths)), "")
    recs = [_record(o, label, workload.warmup_seconds) for o in outcomes]
    infos = {}
    for o, rec in zip(outcomes, recs):
        info = _trace(o, rec)
        if info is not None:
            infos[rec["request_id"]] = info
    header = {"type": "run", "format": "pdproxy-bench/1", "run_id": label, "label": label,
              "tool": "pdproxy whatif", "target": f"virtual-time model, preset {params.preset.name}",
              "conditions": setup.conditions(), "workload": workload.header.get("workload"),
              "conditions_source": "whatif"}
    return Prediction(setup, Run(header=header, requests=recs, source=f"whatif:{setup.name}"), infos)


def jittered(params: ModelParams, seeds: int = SPREAD_SEEDS, jitter_ms: float = SPREAD_JITTER_MS) -> list[ModelParams]:
    """The parameters of the spread's replays: `jitter_ms` of API-server jitter, one seed each."""
    preset = replace(params.preset, frontend_jitter_ms=jitter_ms)
    return [replace(params, preset=preset, seed=seed) for seed in range(1, seeds + 1)]


def spread_of(replays: list[dict[str, float | None]]) -> dict[str, tuple[float, float]]:
    """Each figure's range over the jittered replays' `prediction_figures`."""
    values: dict[str, list[float]] = {}
    for figs in replays:
        for name, v in figs.items():
            if v is not None:
                values.setdefault(name, []).append(v)
    return {name: (min(v), max(v)) for name, v in values.items()}


def spread(workload: Workload, setup: Setup, params: ModelParams,
           deaths: tuple[Death, ...] = ()) -> dict[str, tuple[float, float]]:
    """Each figure's range over `setup` replayed with the API servers' jitter, one replay per seed."""
    return spread_of([prediction_figures(run_setup(workload, setup, p, deaths)) for p in jittered(params)])


def around(spread_: tuple[float, float] | None, predicted: float | None) -> list[float] | None:
    """A figure's spread with the unjittered prediction in it."""
    if spread_ is None or predicted is None:
        return None
    return [min(spread_[0], predicted), max(spread_[1], predicted)]


def spread_errors(replay: dict[str, Any] | None, errors: dict[str, float]) -> dict[str, float]:
    """The stated errors, widened where the model's own spread around its prediction is wider: a difference
    inside either is no measurable difference."""
    out = dict(errors)
    for r in (replay or {}).get("rows", []):
        lo_hi, p = r.get("spread"), r["predicted"]
        if lo_hi and p and r["figure"] in out:
            out[r["figure"]] = max(out[r["figure"]], p / lo_hi[0] - 1 if lo_hi[0] else 0.0, lo_hi[1] / p - 1)
    return out


def self_replay(recorded: dict[str, Any], predicted: dict[str, Any],
                errors: dict[str, float] = REPLAY_TOLERANCE,
                spreads: dict[str, tuple[float, float]] | None = None) -> dict[str, Any]:
    """The recorded set-up's prediction against its own recording, figure by figure.

    A figure the model misses by more than its stated error is one it does not fit: its predictions
    for other set-ups are no better than that miss, and the output says so. Unless the miss is inside the
    recording's own sampling band (`recorded.py` `bands`): a p99 of a hundred requests could land there in
    another run of the same workload, so this recording cannot tell the model wrong (`noise`, not `misfit`).
    Nor where the recorded figure lies inside the model's own `spread` (`unsettled`): a replay with a millisecond
    of jitter lands on it."""
    return self_replay_of(recorded, figures(predicted), predicted["label"], errors, spreads)


def self_replay_of(recorded: dict[str, Any], pred: dict[str, float | None], label: str,
                   errors: dict[str, float] = REPLAY_TOLERANCE,
                   spreads: dict[str, tuple[float, float]] | None = None) -> dict[str, Any]:
    """`self_replay` from the predicted figures (`prediction_figures`, a fit's round) of the set-up `label`."""
    rows, misfit, noise, unsettled = [], [], [], []
    rec = figures(recorded)
    bands = recorded.get("bands") or {}
    for name, _ in FIGURES:
        r, p = rec[name], pred[name]
        err = None if r is None or p is None or r == 0 else (p - r) / r
        limit = errors.get(name)
        band = bands.get(name)
        fits = None if err is None or limit is None else within(name, p, r, limit)
        in_band = stats.in_band(p, band)
        lo_hi = around((spreads or {}).get(name), p)
        if fits is False:
            if in_band:
                noise.append(name)
            elif stats.in_band(r, lo_hi):
                unsettled.append(name)
            else:
                misfit.append(name)
        rows.append({"figure": name, "recorded": r, "predicted": p, "error": err, "stated_error": limit,
                     "fits": fits, "band": list(band) if band else None, "in_band": in_band, "spread": lo_hi})
    return {"setup": label, "rows": rows, "misfit": misfit, "noise": noise, "unsettled": unsettled}


def self_replay_lines(replay: dict[str, Any]) -> list[str]:
    lines = [f"Self-replay: the recorded set-up {replay['setup']} predicted against its own recording:"]
    noise, unsettled = replay.get("noise", []), replay.get("unsettled", [])
    for r in replay["rows"]:
        if r["recorded"] is None and r["predicted"] is None:
            continue
        unit = 1.0 if r["figure"] == "completed" else 1e3
        rec = "—" if r["recorded"] is None else f"{r['recorded'] * unit:,.1f}"
        pred = "—" if r["predicted"] is None else f"{r['predicted'] * unit:,.1f}"
        err = "n/a" if r["error"] is None else f"{r['error']:+.0%}"
        verdict = {True: "fits", False: "DOES NOT FIT", None: ""}[r["fits"]]
        if r["figure"] in noise:
            verdict = "inside the recording's own band"
        elif r["figure"] in unsettled:
            verdict = "inside the model's own spread"
        stated = f" (bound ±{r['stated_error']:.0%})" if r["stated_error"] is not None else ""
        what = "requests" if r["figure"] == "completed" else "ms"
        band = f", the recording's band {table.band_text(r['band'], unit)} {what}" if r.get("band") else ""
        spread_ = f", the model's spread {table.band_text(r['spread'], unit)} {what}" if r.get("spread") else ""
        lines.append(f"  {r['figure']}: recorded {rec} {what}, predicted {pred} {what}, error {err}{stated}{band}"
                     f"{spread_}: {verdict}")
    if noise:
        lines.append(f"Outside the stated error but inside the recording's own band for {', '.join(noise)}: the band "
                     f"holds the workload's true figure {stats.BAND_LEVEL:.0%} of the time (the order statistics "
                     "that bracket it among the recorded requests: a lower bound on the recording's noise); this "
                     "recording cannot tell the model wrong there")
    if unsettled:
        lines.append(f"Outside the stated error but inside the model's own spread for {', '.join(unsettled)}: replayed "
                     f"with up to {SPREAD_JITTER_MS:g} ms of jitter in each API server's time per request (the spread "
                     "of vLLM's own), one replay per seed, the model lands on the recorded figure: clients in step "
                     "fall into one grouping or another by timing no recording resolves, so the model places these "
                     "figures no closer than that spread (the verdicts count differences inside it as none)")
    if replay["misfit"]:
        lines.append(f"The model does not fit this recording for {', '.join(replay['misfit'])}: its predictions of "
                     "those figures, for every set-up, are not within the stated error (read them as an ordering "
                     "only)")
    return lines


def _figure_of(criterion: str, p: int) -> str | None:
    if criterion.startswith("TTFT"):
        return f"TTFT p{p}"
    if criterion.startswith("tail ITL"):
        return f"tail ITL p{p}"
    return None


def with_misfit(v: dict[str, Any], misfit: list[str]) -> dict[str, Any]:
    """The verdict (`verdict.decide` with the stated errors: a difference inside them decides nothing) noted where
    the figure that decided it, or any, is one the self-replay could not reproduce."""
    p = int(v["slo"]["percentile"])
    decided = next((c for c in v["criteria"] if _label(c) == v.get("decided_by")), None)
    fig = _figure_of(decided["criterion"], p) if decided else None
    if fig in misfit:
        v["reason"] += (f" — but the model does not fit the recording for {fig} (self-replay): this verdict rests on a "
                        "figure it could not reproduce")
    if misfit:
        v["notes"] = [*v.get("notes", []), f"the model does not fit this recording for {', '.join(misfit)} "
                                           "(self-replay): verdicts on those figures are unreliable"]
    return v


def _label(c: dict[str, Any]) -> str:
    return c["criterion"] + (f" vs {c['baseline']}" if c.get("baseline") else "")


def replay_entry(pred: Prediction) -> dict[str, Any]:
    """One prediction's report entry on its own: the recorded set-up replayed with the failures of its run,
    which the self-replay checks and no verdict compares."""
    idx = TraceIndex()
    idx.by_request.update(pred.traces)
    return bench_report.build([pred.run], idx, unit="chunk", verdict=False)["runs"][0]


def build_report(workload: Workload, predictions: list[Prediction], slo: Slo | None = None,
                 errors: dict[str, float] = EXPECTED_ERROR, recorded: dict[str, Any] | None = None,
                 replayed: Prediction | None = None,
                 spreads: dict[str, tuple[float, float]] | None = None,
                 error_source: str = "validation") -> dict[str, Any]:
    """The predicted runs as `pdproxy report` builds them; `recorded` (the recording's own report entry)
    turns on the self-replay check of the recorded set-up's prediction, or of `replayed` when the recorded run
    lost instances (the recorded set-up with those failures; the predictions compared run without them);
    `spreads` (`spread`) is the model's own range of each figure there, which widens the error the verdicts
    and the suggested runs allow."""
    idx = TraceIndex()
    for p in predictions:
        idx.by_request.update(p.traces)
    idx.sources = [f"whatif model of {workload.source}"]
    # the model streams one token per chunk, so its per-chunk gaps are per-token gaps: read as they are
    # (unit "chunk"), not re-split token by token, which costs the report most of its time on long replays
    report = bench_report.build([p.run for p in predictions], idx, unit="chunk", verdict=False, slo=slo, definitions={
        "itl_unit": "token", "itl_unit_note": "the model sends one token per chunk: its chunk gaps are token gaps",
        "ttft": "predicted: request sent -> first token, on the model's virtual clock",
        "prediction": error_text(errors, error_source),
        "stages": "queue = engine queue of the first leg (the model has no proxy queue); prefill, kv, decode as "
                  "pdproxy's stage spans",
    })
    entries = report["runs"]
    base_i = next((i for i, p in enumerate(predictions) if p.setup.recorded), None)
    base = entries[base_i if base_i is not None else 0]
    replay = None
    if recorded is not None and base_i is not None:
        replay = self_replay(recorded, replay_entry(replayed) if replayed is not None else entries[base_i],
                             REPLAY_TOLERANCE, spreads)
    misfit = replay["misfit"] if replay else []
    allowed = spread_errors(replay, errors)
    verdicts = []
    for e in entries:
        if e is base:
            continue
        v = decide(e, [base], slo or Slo(), errors=allowed)
        v["resources"] = "same resources"
        v["resources_text"] = f"same GPU total; {PREDICTION}"
        v["notes"] = [*v.get("notes", []), "predicted figures: a difference inside the stated error is no measurable "
                                           "difference and decides nothing (see the suggested runs)"]
        verdicts.append(with_misfit(v, misfit))
    if verdicts:
        report["verdicts"] = verdicts
        report["verdict"] = verdicts[0]
    report["whatif"] = {
        "prediction": error_text(errors, error_source),
        "expected_error": dict(errors),
        "workload": {"source": workload.source, "requests": len(workload.requests), "notes": workload.notes},
        "self_replay": replay,
        "allowed_error": allowed,
        "suggested_runs": suggest(entries, predictions, allowed),
    }
    return report


def _figure(e: dict[str, Any], metric: str, p: str) -> float | None:
    st = e["stats"]
    d = st["ttft"] if metric == "ttft" else st["tail_itl"]["per_request_max"]
    return d.get(p) if d else None


def suggest(entries: list[dict[str, Any]], predictions: list[Prediction],
            errors: dict[str, float] = EXPECTED_ERROR) -> list[str]:
    """The set-ups worth running for real: per figure, the best prediction and every set-up whose error band
    overlaps the best one's (the model cannot separate those; a real run can)."""
    if len(entries) < 2:
        return ["Nothing to compare: only one set-up predicted (name others with --setup, or leave --setup out)"]
    out: list[str] = []
    worth: dict[str, list[str]] = {}
    for name, metric, p in COMPARED:
        err = errors.get(name, 0.5)
        vals = [(v, e["label"]) for e in entries if (v := _figure(e, metric, p)) is not None]
        if len(vals) < 2:
            continue
        best, best_label = min(vals)
        close = [lab for v, lab in vals if lab != best_label and overlap(v, best, err)]
        for lab in (best_label, *close):
            worth.setdefault(lab, []).append(name)
        if close and len(close) == len(vals) - 1:
            out.append(f"{name}: nothing separates the {len(vals)} set-ups: all are within the ±{err:.0%} error of "
                       f"the best ({best_label}, {best * 1e3:.0f} ms); only real runs can order them")
        elif close:
            out.append(f"{name}: {best_label} predicts best ({best * 1e3:.0f} ms) but {', '.join(close)} "
                       f"{'overlaps' if len(close) == 1 else 'overlap'} its ±{err:.0%} error band: measure "
                       f"{', '.join([best_label, *close])} for real")
        else:
            out.append(f"{name}: {best_label} predicts best ({best * 1e3:.0f} ms), clear of the others by more "
                       f"than the ±{err:.0%} error")
    recorded = next((p.setup.name for p in predictions if p.setup.recorded), None)
    if worth and all(len(figs) == len(COMPARED) for figs in worth.values()) and len(worth) == len(entries) > 1:
        head = "Nothing separates the set-ups within the stated error on any figure: a real run of each is needed"
    else:
        runs = ", ".join(f"{lab} ({', '.join(figs)})" for lab, figs in worth.items())
        head = f"Real runs worth making next: {runs}" + (f", against the recorded {recorded}" if recorded else "")
    return [head, *out]
