"""Adopt or don't adopt P/D: the candidate against every baseline, criterion by criterion.

The criteria (evaluation plan in DESIGN.md), checked in this order; the first that fails decides:

1. error rate of the candidate ≤ `max_error_rate`;
2. KV transfer p<P> of the candidate ≤ `max_kv_transfer` (the `pd.kv_transfer` span duration,
   an upper bound, unless `kv_metric="estimated"`); skipped when no bound is given, failed when a
   bound is given but the candidate has no KV-transfer data;
3. TTFT p<P> ≤ `ttft` SLO (when given);
4. TTFT p<P> improved on each baseline (lower by at least `min_improvement`);
5. tail ITL p<P> (per-request max gap, P-th percentile across requests) ≤ `tail_itl` SLO;
6. tail ITL p<P> improved on each baseline.

When every criterion passes the verdict is "adopt" and the criterion with the smallest margin is
named (what would flip it first). Throughput is shown but is not a criterion: P/D is not expected
to raise it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdproxy.bench.stats import in_band


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


def _pct(stats: dict[str, Any] | None, p: int) -> float | None:
    return None if not stats else stats.get(f"p{p}")


def decide(candidate: dict[str, Any], baselines: list[dict[str, Any]], slo: Slo) -> dict[str, Any]:
    """`candidate`/`baselines` are report run entries (label, stats, kv_transfer, gpu_total)."""
    p = slo.percentile
    crit: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float | None, passed: bool | None, detail: str,
            margin: float | None = None, baseline: str | None = None) -> None:
        crit.append({"criterion": name, "baseline": baseline, "value": value, "limit": limit,
                     "passed": passed, "detail": detail, "margin": margin})

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

    for metric, name, target in (("ttft", "TTFT", slo.ttft),
                                 ("tail_itl", "tail ITL (per-request max)", slo.tail_itl)):
        value = _pct(_metric(cs, metric), p)
        if target is not None:
            if value is None:
                add(f"{name} p{p} SLO", None, target, False, "no successful requests to measure")
            else:
                add(f"{name} p{p} SLO", value, target, value <= target,
                    f"{value * 1e3:.1f} ms vs SLO {target * 1e3:.1f} ms", _rel_margin(target, value))
        for b in baselines:
            bv = _pct(_metric(b["stats"], metric), p)
            if value is None or bv is None:
                add(f"{name} p{p} improved", value, bv, False, f"no data to compare with {b['label']}",
                    baseline=b["label"])
                continue
            need = bv * (1 - slo.min_improvement)
            change = (value - bv) / bv if bv else 0.0
            add(f"{name} p{p} improved", value, need, value < need,
                f"{value * 1e3:.1f} ms vs {bv * 1e3:.1f} ms on {b['label']} ({change:+.1%})"
                + _unseparated(value, _band(cs, metric, p), bv, _band(b["stats"], metric, p)),
                _rel_margin(need, value), baseline=b["label"])

    failing = [c for c in crit if c["passed"] is False]
    if failing:
        decided = failing[0]
        decision = "don't adopt" if baselines else "fail"
        reason = f"{_name(decided)} failed: {decided['detail']}"
    else:
        scored = [c for c in crit if c["passed"] and c["margin"] is not None]
        decided = min(scored, key=lambda c: c["margin"]) if scored else None
        decision = "adopt" if baselines else "pass"
        reason = ("all criteria met; closest: " + f"{_name(decided)}: {decided['detail']}") if decided else \
            "all criteria met"
    notes = []
    cg = candidate.get("gpu_total")
    for b in baselines:
        bg = b.get("gpu_total")
        if cg is not None and bg is not None and cg != bg:
            notes.append(f"capacity comparison: {candidate['label']} uses {cg} GPUs, {b['label']} {bg}")
    return {
        "candidate": candidate["label"],
        "baselines": [b["label"] for b in baselines],
        "decision": decision,
        "decided_by": _name(decided) if decided else None,
        "reason": reason,
        "criteria": crit,
        "slo": asdict(slo),
        "notes": notes,
    }


def _metric(stats: dict[str, Any], metric: str) -> dict[str, Any] | None:
    if metric == "tail_itl":
        return stats["tail_itl"]["per_request_max"]
    return stats[metric]


def _band(stats: dict[str, Any], metric: str, p: int) -> list[float | None] | None:
    return ((stats.get("bands") or {}).get(metric) or {}).get(f"p{p}")


def _unseparated(value: float, a: list[float | None] | None, other: float, b: list[float | None] | None) -> str:
    """A note when each run's figure lies inside the other's 95 % band (stats.percentile_band): nothing in either
    run tells the two apart, so the difference may not reproduce."""
    return "; each inside the other's 95 % band: may not reproduce" if in_band(value, b) and in_band(other, a) else ""


def _name(c: dict[str, Any] | None) -> str:
    if not c:
        return ""
    return c["criterion"] + (f" vs {c['baseline']}" if c.get("baseline") else "")


def _rel_margin(limit: float | None, value: float | None) -> float | None:
    if limit is None or value is None or limit == 0:
        return None
    return (limit - value) / abs(limit)
