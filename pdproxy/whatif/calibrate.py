"""`pdproxy whatif --calibrate`: the model's curves fitted to the operator's own recorded spans.

From vLLM's `llm_request` spans joined to pdproxy's traces (`pdproxy.bench.traces`):

* prefill: compute (`time_in_model_prefill` of the first leg) against prompt tokens: a line through
  the median of each prompt-length bucket, refitted once without buckets more than 50 % off it (a
  bucket of prefix-cache hits); the preset's curve holds the step's extra time, so one decode step is
  taken off.
* decode step: per-token time of each decode (`time_in_model_decode / (tokens - 1)`) against the
  mean number of requests decoding on the same vLLM process meanwhile; a line through the median
  of each load level.
  P/D decodes are used when there are any (their steps carry no prompt chunks), else singles.
* KV transfer: the decode's wait for the KV (its `time_in_queue`, NIXL pull included) against the
  prompt's KV bytes, fitted as latency + bytes / bandwidth on each size bucket's 10th percentile
  (the link's queueing is the model's own; fitting the median would count it twice), after the
  preset's fixed pull overhead.

Each fit keeps the preset's curve where the spans do not reach (fewer than two buckets), and says so.
Residuals are per bucket: (fitted − measured) / measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pdproxy.bench import traces
from pdproxy.bench.engine_spans import EngineSpan
from pdproxy.sim.presets import SIM_LOOPBACK_MS, Preset
from pdproxy.sim.timing import PiecewiseLinear

MIN_PER_BUCKET = 3
PROMPT_EDGES = (0, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 16384, 32768, 1 << 30)
BATCH_EDGES = (0, 1.5, 3, 6, 12, 24, 48, 96, 192, 1 << 30)


@dataclass
class Fit:
    name: str
    points: list[tuple[float, float]]  # (x, fitted y) as the preset holds it
    residuals: list[tuple[float, float, float]]  # (x, measured, fitted)
    spans: int
    note: str = ""


@dataclass
class Calibration:
    preset: Preset
    fits: list[Fit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"preset": self.preset.name, "notes": self.notes, "fits": [
            {"name": f.name, "points": f.points, "spans": f.spans, "note": f.note,
             "residuals": [{"x": x, "measured": m, "fitted": y} for x, m, y in f.residuals]} for f in self.fits]}


def _buckets(xs: np.ndarray, ys: np.ndarray, edges: tuple[float, ...], q: float) -> list[tuple[float, float]]:
    out = []
    for lo, hi in zip(edges, edges[1:]):
        sel = (xs >= lo) & (xs < hi)
        if sel.sum() >= MIN_PER_BUCKET:
            out.append((float(np.median(xs[sel])), float(np.percentile(ys[sel], q))))
    return out


def _line(buckets: list[tuple[float, float]]) -> tuple[float, float, list[tuple[float, float]]]:
    """y = a + b x through the buckets (b >= 0), refitted once without the buckets more than 50 % off it
    (prefix-cache hits, queueing): (a, b, the buckets dropped)."""
    def solve(pts: list[tuple[float, float]]) -> tuple[float, float]:
        xs, ys = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        b, a = np.polyfit(xs, ys, 1)
        if b < 0:  # flat: the mean
            return float(ys.mean()), 0.0
        return float(a), float(b)

    a, b = solve(buckets)
    kept = [(x, y) for x, y in buckets if y > 0 and abs(a + b * x - y) / y <= 0.5]
    if 2 <= len(kept) < len(buckets):
        a, b = solve(kept)
        return a, b, [p for p in buckets if p not in kept]
    return a, b, []


def _dropped_note(dropped: list[tuple[float, float]], unit: str, why: str) -> str:
    if not dropped:
        return ""
    return f"left out as {why}: " + ", ".join(f"{x:,.0f} {unit} ({y:.1f} ms)" for x, y in dropped)


def _first_leg(info: traces.TraceInfo) -> EngineSpan | None:
    return info.engine.get("prefill")


def fit_prefill(infos: list[traces.TraceInfo], preset: Preset) -> Fit:
    pts = [(e.prompt_tokens, e.prefill) for i in infos if (e := _first_leg(i)) is not None
           and e.prompt_tokens and e.prefill is not None]
    step1 = PiecewiseLinear(preset.decode_step_ms)(1)
    if not pts:
        return Fit("prefill", list(preset.prefill_extra_ms), [], 0, "no prefill spans: the preset's curve kept")
    xs, ys = np.array([p[0] for p in pts], float), np.array([p[1] * 1e3 for p in pts], float)
    buckets = _buckets(xs, ys, PROMPT_EDGES, 50)
    if len(buckets) < 2:
        return Fit("prefill", list(preset.prefill_extra_ms), [], len(pts),
                   "prompts of one size only: the preset's curve kept")
    a, b, dropped = _line(buckets)
    top = max(x for x, _ in buckets)
    points = [(0.0, 0.0)] + [(float(x), round(max(0.0, a + b * x - step1), 3)) for x in (128.0, top)]
    return Fit("prefill", points, [(x, y, a + b * x) for x, y in buckets], len(pts),
               f"compute = {a:.1f} ms + {b * 1e3:.2f} ms per 1k tokens (median per size); "
               + _dropped_note(dropped, "tokens", "likely prefix-cache hits or queued"))


def _mean_concurrency(spans: list[EngineSpan]) -> list[tuple[EngineSpan, float]]:
    """Per decode span: the mean number of decodes of the same process running during its decode window."""
    by_proc: dict[str, list[tuple[float, float, EngineSpan]]] = {}
    for e in spans:
        ft = e.first_token
        if ft is None or e.decode is None or e.decode <= 0:
            continue
        by_proc.setdefault(e.instance, []).append((ft, ft + e.decode, e))
    out = []
    for windows in by_proc.values():
        for a, b, e in windows:
            overlap = sum(max(0.0, min(b, b2) - max(a, a2)) for a2, b2, _ in windows)
            out.append((e, overlap / (b - a)))
    return out


def fit_decode(infos: list[traces.TraceInfo], preset: Preset) -> Fit:
    pd = [e for i in infos if str(i.attrs.get("pd.mode")) == "pd" and (e := i.engine.get("decode")) is not None]
    spans = pd or [e for i in infos if (e := _first_leg(i)) is not None]
    note = "" if pd else "no P/D decodes: fitted on single instances, whose steps also carry prompts; "
    rows = [(c, e.decode / (e.completion_tokens - 1)) for e, c in _mean_concurrency(spans)
            if e.completion_tokens and e.completion_tokens > 2 and e.decode]
    if not rows:
        return Fit("decode step", list(preset.decode_step_ms), [], 0, "no decode spans: the preset's curve kept")
    xs, ys = np.array([r[0] for r in rows], float), np.array([r[1] * 1e3 for r in rows], float)
    buckets = _buckets(xs, ys, BATCH_EDGES, 50)
    if len(buckets) < 2:  # one load level: shift the preset's curve through it
        if not buckets:
            return Fit("decode step", list(preset.decode_step_ms), [], len(rows), "too few decodes: preset kept")
        x, y = buckets[0]
        scale = y / PiecewiseLinear(preset.decode_step_ms)(x)
        points = [(bx, round(by * scale, 3)) for bx, by in preset.decode_step_ms]
        return Fit("decode step", points, [(x, y, PiecewiseLinear(tuple(points))(x))], len(rows),
                   note + f"one load level (~{x:.0f} decoding): the preset's curve scaled by {scale:.2f}")
    a, b, dropped = _line(buckets)
    top = max(max(x for x, _ in buckets), 2.0)
    points = [(1.0, round(a + b, 3)), (top, round(a + b * top, 3))]
    return Fit("decode step", points, [(x, y, a + b * x) for x, y in buckets], len(rows),
               note + f"step = {a:.2f} ms + {b:.3f} ms per decoding sequence (median per load level); "
               + _dropped_note(dropped, "decoding", "outliers"))


def fit_kv(infos: list[traces.TraceInfo], preset: Preset) -> tuple[Fit, float | None, float | None]:
    rows = [(e.prompt_tokens * preset.kv_bytes_per_token, e.queue) for i in infos
            if str(i.attrs.get("pd.mode")) == "pd" and (e := i.engine.get("decode")) is not None
            and e.prompt_tokens and e.queue is not None]
    if not rows:
        return Fit("KV transfer", [], [], 0, "no P/D decode spans: the preset's link kept"), None, None
    xs = np.array([r[0] for r in rows], float)
    ys = np.array([r[1] * 1e3 - preset.kv_pull_overhead_ms for r in rows], float)
    edges = tuple(e * preset.kv_bytes_per_token for e in PROMPT_EDGES)
    buckets = _buckets(xs, ys, edges, 10)
    if len(buckets) < 2:
        return Fit("KV transfer", [], [], len(rows), "transfers of one size only: the preset's link kept"), None, None
    latency, slope, dropped = _line(buckets)  # ms, ms per byte
    latency = max(latency, 0.0)
    if slope <= 0:
        return Fit("KV transfer", [], [(x, y, latency) for x, y in buckets], len(rows),
                   "the KV wait does not grow with its size: the preset's link kept"), None, None
    gbps = 1e3 / slope / 1e9
    fit = Fit("KV transfer", [(round(latency, 3), round(gbps, 4))], [(x, y, latency + slope * x) for x, y in buckets],
              len(rows), f"link = {latency:.1f} ms + bytes / {gbps:.3f} GB/s (10th percentile per size, after the "
              f"{preset.kv_pull_overhead_ms:g} ms pull overhead); "
              + _dropped_note(dropped, "bytes", "queued behind others"))
    return fit, gbps, latency


def fit(infos: list[traces.TraceInfo], preset: Preset) -> Calibration:
    prefill, decode = fit_prefill(infos, preset), fit_decode(infos, preset)
    kv, gbps, latency = fit_kv(infos, preset)
    new = replace(preset, name=f"{preset.name}+calibrated", prefill_extra_ms=tuple(prefill.points),
                  decode_step_ms=tuple(decode.points))
    if gbps is not None and latency is not None:
        new = replace(new, kv_bandwidth_gbps=gbps, kv_latency_ms=latency)
    return Calibration(new, [prefill, decode, kv])


PROXY_NOTE = ("no vLLM llm_request spans: fitted on pdproxy's own stage spans, which also hold HTTP and vLLM's "
              "API server (the preset's front-end time and one loopback taken off), so less precise; start vLLM with "
              "--otlp-traces-endpoint for vLLM's own timings")


def _from_proxy(info: traces.TraceInfo, preset: Preset) -> traces.TraceInfo | None:
    """The request's engine intervals estimated from pdproxy's stages, as `EngineSpan`s the fits read."""
    a, st, times = info.attrs, info.stages, info.stage_times
    prompt, out = a.get("gen_ai.usage.input_tokens"), a.get("gen_ai.usage.output_tokens")
    if not isinstance(prompt, int) or "prefill" not in st or "prefill" not in times or "decode" not in st:
        return None
    fixed = (preset.frontend_overhead_ms + SIM_LOOPBACK_MS) / 1e3
    step = PiecewiseLinear(preset.decode_step_ms)(1) / 1e3
    pd = str(a.get("pd.mode")) == "pd" and "kv_transfer" in st and "kv_transfer" in times
    decode_at = str(a.get("pd.decode.instance") or "")

    def span(instance: str, start: float, ttft: float, queue: float | None, compute: float,
             decode: float | None) -> EngineSpan:
        return EngineSpan("pdproxy", instance, start, start + ttft + (decode or 0.0), info.request_id, queue,
                          max(compute, 0.0), decode, ttft, None, prompt, out if isinstance(out, int) else None)

    engine = {"prefill": span(str(a.get("pd.prefill.instance") or decode_at), times["prefill"][0], st["prefill"],
                              0.0, st["prefill"] - fixed, None if pd else st["decode"])}
    if pd:
        kv = st["kv_transfer"]
        engine["decode"] = span(decode_at, times["kv_transfer"][0], kv, max(kv - fixed - step, 0.0), step,
                                st["decode"])
    return replace(info, engine=engine)


def fit_files(paths: list[str], preset: Preset) -> Calibration:
    """Fit on vLLM's spans when the files hold them, else on pdproxy's stage spans (and say so)."""
    if not paths:
        raise ValueError("--calibrate fits the recorded spans: give the trace files (--traces), best with vLLM's "
                         "llm_request spans (vLLM started with --otlp-traces-endpoint)")
    idx = traces.read_traces(paths)
    infos = [i for i in idx.by_request.values() if i.engine]
    if infos:
        return fit(infos, preset)
    estimated = [e for i in idx.by_request.values() if (e := _from_proxy(i, preset)) is not None]
    if not estimated:
        raise ValueError("--calibrate: the --traces files hold no request with its stages and token counts "
                         "(pdproxy's pd.prefill / pd.decode spans and gen_ai.usage.*)")
    cal = fit(estimated, preset)
    cal.notes.append(PROXY_NOTE)
    return cal


def render(cal: Calibration) -> str:
    lines = [f"Calibration from the recorded spans (model preset {cal.preset.name}):", *(f"  note: {n}" for n in cal.notes)]
    for f in cal.fits:
        head = f"  {f.name}: {f.spans} spans" + (f"; {f.note}" if f.note else "")
        lines.append(head)
        for x, m, y in f.residuals:
            unit = "bytes" if f.name == "KV transfer" else ("tokens" if f.name == "prefill" else "decoding")
            lines.append(f"    at {x:,.0f} {unit}: measured {m:.2f} ms, fitted {y:.2f} ms, residual "
                         f"{(y - m) / m:+.1%}" if m else f"    at {x:,.0f} {unit}: measured 0")
    return "\n".join(lines)
