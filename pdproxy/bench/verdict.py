"""Adopt or don't adopt: a candidate set-up against its baselines, as an SRE decides. One rule for `pdproxy report`
(bench records, or the proxy's traces by deployment: primary against shadow) and `pdproxy whatif`.

Gates, checked on the candidate first (the first that fails decides "don't adopt"):

1. error rate ≤ `max_error_rate`;
2. KV transfer p<P> ≤ `max_kv_transfer` (the `pd.kv_transfer` span, an upper bound, unless `kv_metric="estimated"`),
   when a bound is given (a bound the candidate has no data for fails).

Then, with SLOs given (TTFT p<P> ≤ `ttft`, tail ITL p<P> ≤ `tail_itl`):

3. a set-up that meets every SLO beats one that does not: against each baseline, the candidate meets them and the
   baseline does not (adopt), or the other way round (don't adopt);
4. where both meet them (or neither), goodput per GPU decides: the requests per second that met every SLO, each
   request by its own TTFT and its own largest token gap, divided by the set-up's GPU total.

Without SLOs, strict dominance:

5. TTFT p<P> and tail ITL p<P> (per-request max gap, P-th percentile across requests) against each baseline: better
   on one and worse on none adopts; worse on one and better on none does not; better on one and worse on another
   is a trade-off no rule without SLOs can decide (give SLOs).

A difference inside either run's band is "no measurable difference" and decides nothing: the 95 % band of each
percentile (`stats.percentile_band`), a Poisson band on the goodput count; for predictions (`errors`, `pdproxy
whatif`) the stated error of the figure instead, and an SLO inside a prediction's error is "cannot tell". When
nothing separates the candidate from a baseline the verdict is "no measurable difference". Throughput alone is
never a criterion (P/D is not expected to raise it); goodput is, because it counts only requests that met the SLOs.
The seed's two framings stay with the caller: the same resources first, then capacity (report.resource_groups).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from pdproxy.bench.stats import in_band

BAND_Z = 1.96  # the goodput count's band: Poisson, ±1.96 √n


@dataclass
class Slo:
    ttft: float | None = None  # seconds
    tail_itl: float | None = None  # seconds
    percentile: int = 99
    max_kv_transfer: float | None = None  # seconds
    kv_metric: str = "upper_bound"  # or "estimated"
    max_error_rate: float = 0.01
    min_improvement: float = 0.0  # fraction, e.g. 0.05 = at least 5 % lower

    @property
    def targets(self) -> bool:
        """Whether a latency or KV target was given: one run alone can then pass or fail."""
        return any(v is not None for v in (self.ttft, self.tail_itl, self.max_kv_transfer))

    @property
    def latency(self) -> bool:
        """Whether an SLO on latency was given: set-ups are then compared by it and by goodput."""
        return self.ttft is not None or self.tail_itl is not None


def _pct(stats: dict[str, Any] | None, p: int) -> float | None:
    return None if not stats else stats.get(f"p{p}")


FIGURE = {"ttft": "TTFT", "tail_itl": "tail ITL (per-request max)"}


def decide(candidate: dict[str, Any], baselines: list[dict[str, Any]], slo: Slo,
           errors: dict[str, float] | None = None) -> dict[str, Any]:
    """`candidate`/`baselines` are report run entries (label, stats, kv_transfer, gpu_total, slo_points); `errors`:
    the stated relative error of each predicted figure ("TTFT p99", "tail ITL p99", "completed"), which replaces the
    runs' sampling bands (a prediction's)."""
    p = slo.percentile
    crit: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float | None, passed: bool | None, detail: str,
            margin: float | None = None, baseline: str | None = None) -> dict[str, Any]:
        c = {"criterion": name, "baseline": baseline, "value": value, "limit": limit, "passed": passed,
             "detail": detail, "margin": margin}
        crit.append(c)
        return c

    cs = candidate["stats"]
    er = cs["requests"]["error_rate"]
    if er is None:
        add("error rate", None, slo.max_error_rate, False, "no measured requests")
    else:
        add("error rate", er, slo.max_error_rate, er <= slo.max_error_rate,
            f"{er:.2%} of {cs['requests']['measured']} requests failed (bound {slo.max_error_rate:.2%})",
            _rel_margin(slo.max_error_rate, er) if slo.max_error_rate > 0 else None)

    kv_key = "estimated" if slo.kv_metric == "estimated" else "upper_bound"
    kv = _pct((candidate.get("kv_transfer") or {}).get(kv_key), p)
    if slo.max_kv_transfer is None:
        add(f"KV transfer p{p}", kv, None, None, "no bound given: not a criterion")
    elif kv is None:
        add(f"KV transfer p{p}", None, slo.max_kv_transfer, False,
            "bound given but the candidate has no KV-transfer data (pass the proxy's traces)")
    else:
        add(f"KV transfer p{p}", kv, slo.max_kv_transfer, kv <= slo.max_kv_transfer,
            f"{kv_key.replace('_', ' ')} {kv * 1e3:.1f} ms vs bound {slo.max_kv_transfer * 1e3:.1f} ms",
            _rel_margin(slo.max_kv_transfer, kv))

    gates = [c for c in crit if c["passed"] is False]  # error rate and KV bound: the candidate's own
    cand_slo = _slo_criteria(candidate, slo, errors, add)
    outcomes: list[tuple[str, dict[str, Any] | None]] = []  # per baseline: won / lost / even / trade-off
    for b in baselines:
        if slo.latency:
            outcomes.append(_by_slos(candidate, b, slo, cand_slo, errors, add))
        else:
            outcomes.append(_by_dominance(candidate, b, slo, errors, add))
    decision, decided, reason = _conclude(gates, outcomes, crit, bool(baselines), cand_slo)
    notes = []
    cg = candidate.get("gpu_total")
    for b in baselines:
        bg = b.get("gpu_total")
        if cg is not None and bg is not None and cg != bg:
            notes.append(f"capacity comparison: {candidate['label']} uses {cg} GPUs, {b['label']} {bg}")
    if not slo.latency and any(o == "trade-off" for o, _ in outcomes):
        notes.append("better on one figure and worse on another: without SLOs no rule can weigh the two; give "
                     "--slo-ttft-ms / --slo-tail-itl-ms to decide by the SLOs and then goodput per GPU")
    return {
        "candidate": candidate["label"],
        "baselines": [b["label"] for b in baselines],
        "decision": decision,
        "decided_by": _name(decided) if decided else None,
        "reason": reason,
        "criteria": crit,
        "slo": asdict(slo),
        "rule": "SLOs first, then goodput per GPU" if slo.latency else "strict dominance (no SLO given)",
        "notes": notes,
    }


def _slo_criteria(entry: dict[str, Any], slo: Slo, errors: dict[str, float] | None, add: Any,
                  baseline: str | None = None) -> bool | None:
    """The entry's latency SLOs as criteria (the candidate's, or a baseline's named so): True every one met, False
    one missed, None one cannot be told (a prediction within its error of the SLO); None without SLOs."""
    if not slo.latency:
        return None
    p = slo.percentile
    met: bool | None = True
    for metric, target in (("ttft", slo.ttft), ("tail_itl", slo.tail_itl)):
        if target is None:
            continue
        value = _pct(_metric(entry["stats"], metric), p)
        name = f"{FIGURE[metric]} p{p} SLO" + (" (baseline)" if baseline else "")
        if value is None:
            add(name, None, target, False, "no successful requests to measure", baseline=baseline)
            met = False
            continue
        passed: bool | None = value <= target
        detail = f"{value * 1e3:.1f} ms vs SLO {target * 1e3:.1f} ms"
        err = (errors or {}).get(f"{'TTFT' if metric == 'ttft' else 'tail ITL'} p{p}")
        if err is not None and value * (1 - err) <= target <= value * (1 + err):
            passed = None
            detail += f"; cannot tell (the SLO lies within the prediction's ±{err:.0%})"
        add(name, value, target, passed, detail, _rel_margin(target, value), baseline=baseline)
        if passed is False:
            met = False
        elif passed is None and met is True:
            met = None
    return met


def _by_slos(cand: dict[str, Any], base: dict[str, Any], slo: Slo, cand_met: bool | None,
             errors: dict[str, float] | None, add: Any) -> tuple[str, dict[str, Any] | None]:
    """SLOs first (a set-up that meets them all beats one that does not), then goodput per GPU."""
    label = base["label"]
    base_met = _slo_criteria(base, slo, errors, add, baseline=label)
    if cand_met is None or base_met is None:
        c = add("meets every SLO", None, None, None, "cannot tell whether both set-ups meet every SLO (a prediction "
                                                     "within its error of an SLO)", baseline=label)
        return "unknown", c
    if cand_met != base_met:
        c = add("meets every SLO", float(cand_met), float(base_met), cand_met,
                f"{cand['label']} {'meets' if cand_met else 'misses'} them, {label} "
                f"{'meets' if base_met else 'misses'} them", baseline=label)
        return ("won" if cand_met else "lost"), c
    cg, cband = goodput(cand, slo)
    bg, bband = goodput(base, slo)
    both = "both meet every SLO" if cand_met else "neither meets every SLO"
    if cg is None or bg is None:
        c = add("goodput per GPU", cg, bg, None, f"{both}; goodput unknown (no request-level data)", baseline=label)
        return "unknown", c
    err = (errors or {}).get("completed")
    if err is not None:
        inside = abs(cg - bg) <= err * max(abs(bg), 1e-12)
        band_text = f"inside the ±{err:.0%} stated error"
    else:
        inside = in_band(cg, bband) or in_band(bg, cband)
        band_text = "inside either run's band"
    detail = (f"{both}; {cg:.3g} vs {bg:.3g} requests/s per GPU meeting every SLO on {label}"
              + (f" ({(cg - bg) / bg:+.1%})" if bg else ""))
    if inside:
        c = add("goodput per GPU", cg, bg, None, f"{detail}; no measurable difference ({band_text})", baseline=label)
        return "even", c
    c = add("goodput per GPU", cg, bg, cg > bg, detail, _rel_margin(cg, bg) if cg > bg else _rel_margin(bg, cg),
            baseline=label)
    return ("won" if cg > bg else "lost"), c


def _by_dominance(cand: dict[str, Any], base: dict[str, Any], slo: Slo, errors: dict[str, float] | None,
                  add: Any) -> tuple[str, dict[str, Any] | None]:
    """Without SLOs: better on a figure and worse on none wins; worse and better on none loses."""
    p = slo.percentile
    cs, bs = cand["stats"], base["stats"]
    better, worse = [], []
    for metric in ("ttft", "tail_itl"):
        name = f"{FIGURE[metric]} p{p} improved"
        value, bv = _pct(_metric(cs, metric), p), _pct(_metric(bs, metric), p)
        if value is None or bv is None:
            worse.append(add(name, value, bv, False, f"no data to compare with {base['label']}", baseline=base["label"]))
            continue
        need = bv * (1 - slo.min_improvement)
        change = (value - bv) / bv if bv else 0.0
        detail = f"{value * 1e3:.1f} ms vs {bv * 1e3:.1f} ms on {base['label']} ({change:+.1%})"
        err = (errors or {}).get(f"{'TTFT' if metric == 'ttft' else 'tail ITL'} p{p}")
        if err is not None:
            inside, why = abs(value - bv) <= err * abs(bv), f"inside the ±{err:.0%} stated error"
        else:
            inside = in_band(value, _band(bs, metric, p)) or in_band(bv, _band(cs, metric, p))
            why = "inside either run's 95 % band"
        if inside:
            add(name, value, need, None, f"{detail}; no measurable difference ({why})", baseline=base["label"])
            continue
        c = add(name, value, need, value < need, detail, _rel_margin(need, value), baseline=base["label"])
        (better if c["passed"] else worse).append(c)
    if better and worse:
        return "trade-off", worse[0]
    if worse:
        return "lost", worse[0]
    if better:
        return "won", min(better, key=lambda c: c["margin"] if c["margin"] is not None else math.inf)
    return "even", None


def _conclude(gates: list[dict[str, Any]], outcomes: list[tuple[str, dict[str, Any] | None]],
              crit: list[dict[str, Any]], has_baselines: bool, cand_met: bool | None
              ) -> tuple[str, dict[str, Any] | None, str]:
    if gates:
        decided = gates[0]
        return ("don't adopt" if has_baselines else "fail"), decided, f"{_name(decided)} failed: {decided['detail']}"
    if not has_baselines:
        failed = [c for c in crit if c["passed"] is False]
        if failed or cand_met is False:
            decided = failed[0]
            return "fail", decided, f"{_name(decided)} failed: {decided['detail']}"
        if cand_met is None and any(c["passed"] is None and c["limit"] is not None for c in crit):
            decided = next(c for c in crit if c["passed"] is None and c["limit"] is not None)
            return "cannot tell", decided, f"{_name(decided)}: {decided['detail']}"
        scored = [c for c in crit if c["passed"] and c["margin"] is not None]
        decided = min(scored, key=lambda c: c["margin"]) if scored else None
        return "pass", decided, ("all criteria met; closest: " + f"{_name(decided)}: {decided['detail']}") \
            if decided else "all criteria met"
    kinds = [o for o, _ in outcomes]
    for kind, decision, verb in (("lost", "don't adopt", "failed"), ("unknown", "cannot tell", "cannot tell"),
                                 ("trade-off", "trade-off", "failed while another figure improved")):
        if kind in kinds:
            decided = next(c for o, c in outcomes if o == kind)
            if kind == "unknown":
                return decision, decided, f"{decided['detail']} ({_name(decided)})" if decided else "cannot tell"
            return decision, decided, f"{_name(decided)} {verb}: {decided['detail'] if decided else ''}"
    won = [c for o, c in outcomes if o == "won" and c is not None]
    if won:
        decided = min(won, key=lambda c: c["margin"] if c["margin"] is not None else math.inf)
        return "adopt", decided, f"better on every baseline; closest: {_name(decided)}: {decided['detail']}"
    return "no measurable difference", None, "every compared figure is inside the runs' bands (or the stated error)"


def goodput(entry: dict[str, Any], slo: Slo) -> tuple[float | None, list[float | None] | None]:
    """Requests per second per GPU that met every latency SLO (each request by its own TTFT and largest gap), and
    its Poisson band; None without request-level data (`slo_points`) or a measurement window."""
    points = entry.get("slo_points")
    window = ((entry["stats"].get("throughput") or {}).get("window_s") or 0.0)
    if points is None or window <= 0:
        return None, None
    n = sum(1 for ttft, tail in points
            if (slo.ttft is None or (ttft is not None and ttft <= slo.ttft))
            and (slo.tail_itl is None or (tail is not None and tail <= slo.tail_itl)))
    scale = window * max(entry.get("gpu_total") or 1, 1)
    half = BAND_Z * math.sqrt(n)
    return n / scale, [max(n - half, 0.0) / scale, (n + half) / scale]


def _metric(stats: dict[str, Any], metric: str) -> dict[str, Any] | None:
    if metric == "tail_itl":
        return stats["tail_itl"]["per_request_max"]
    return stats[metric]


def _band(stats: dict[str, Any], metric: str, p: int) -> list[float | None] | None:
    return ((stats.get("bands") or {}).get(metric) or {}).get(f"p{p}")


def _name(c: dict[str, Any] | None) -> str:
    if not c:
        return ""
    return c["criterion"] + (f" vs {c['baseline']}" if c.get("baseline") else "")


def _rel_margin(limit: float | None, value: float | None) -> float | None:
    if limit is None or value is None or limit == 0:
        return None
    return (limit - value) / abs(limit)
