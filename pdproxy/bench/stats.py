"""The one place where numbers are defined. Everything the report shows is computed here.

* Percentiles: `numpy.percentile(values, p)` with the default (`linear`) method, as
  `vllm bench serve` does. An empty set has no percentile (shown as n/a, never as 0).
* Which requests count: all non-warm-up requests. Failed ones count in the request total, the
  error rate and the error reasons; latency distributions are over the successful ones (a failed
  request has no complete TTFT/ITL), and each distribution says how many requests it covers.
* TTFT: client start → first token-bearing message. E2E: start → last token-bearing message.
* ITL (pooled): every gap of every successful request in one distribution. Unit `chunk` = one
  sample per gap between token-bearing messages (vLLM's definition). Unit `token` = when the
  server streamed usage on every chunk, a gap followed by a chunk of k tokens counts as k gaps of
  gap/k (tokens that arrive in the first chunk are part of TTFT, not gaps). A run uses `token`
  only when every successful request has per-chunk token counts; the unit is always reported.
* Tail ITL: for each request, the p99 and the max of its own gaps; then p50/p90/p99 of those
  values across requests (requests with at least one gap).
* Bands: for TTFT, the per-request max ITL and the KV transfer, where the workload's true p50/p90/p99
  lies, 95 % of the time, given the requests measured (`percentile_band`): how far another run of the
  same workload may land, and why a p99 of a hundred requests decides nothing by a few percent.
* Stall share: requests with at least one gap above the threshold (default 100 ms).
* TPOT: (E2E − TTFT) / (output tokens − 1), requests with more than one output token.
* Throughput: over the measurement window = first measured start → last measured end;
  output tokens/s (successful requests' tokens), requests/s (successful requests).
* Error rate: failed / measured requests.

Requests built from the proxy's traces (`bench/deployments.py`) carry no gaps, only the proxy's
per-request summary (`itl_summary`: count, mean, p50, p99, max, unit). Their tail ITL, stalls and
TPOT come from that summary; their pooled ITL is unavailable (it needs every gap), and says so.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable, Sequence

import numpy as np

PERCENTILE_METHOD = "linear"
PERCENTILES = (50, 90, 99)
DEFAULT_STALL_THRESHOLD = 0.1
POOLED_UNAVAILABLE = "not in traces: the proxy records per-request ITL summaries, not every gap"
BAND_LEVEL = 0.95


def percentile(values: Sequence[float], p: float) -> float | None:
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), p, method=PERCENTILE_METHOD))


def percentile_band(values: Iterable[float], p: float,
                    level: float = BAND_LEVEL) -> tuple[float | None, float | None] | None:
    """Where the true p-th percentile of the workload that gave `values` lies, `level` of the time: between the
    order statistics that bracket it (how many of n requests fall below it is binomial(n, p/100), whatever the
    distribution). None for a side the recording does not bound (a p99 of 100 requests lies above all of them
    37 % of the time). A p99 of a hundred requests rests on its one or two largest, so a model (or another
    run) that misses it by 20 % may be inside what the run could not pin down. A lower bound on that noise:
    requests of one run are not independent (closed-loop clients in step share their delays)."""
    return _band(_ordered(values), p, level)


def _band(ordered: np.ndarray, p: float, level: float = BAND_LEVEL) -> tuple[float | None, float | None] | None:
    n, q, tail = ordered.size, p / 100.0, (1.0 - level) / 2.0
    if n < 2 or not 0.0 < q < 1.0:
        return None
    k = np.arange(1, n + 1)
    log_choose = np.concatenate(([0.0], np.cumsum(np.log(n - k + 1) - np.log(k))))  # log C(n, k), k = 0..n
    k = np.arange(n + 1)
    below = np.cumsum(np.exp(log_choose + k * math.log(q) + (n - k) * math.log1p(-q)))  # P(at most k below)
    low = int(np.searchsorted(below, tail, side="right"))  # P(fewer than `low` below) <= tail: x_(low), from 1
    high = int(np.searchsorted(below, 1.0 - tail, side="left")) + 1  # P(at least `high` below) <= tail
    return (float(ordered[low - 1]) if low >= 1 else None, float(ordered[high - 1]) if high <= n else None)


def in_band(value: float | None, band: Sequence[float | None] | None) -> bool:
    """`value` within a `percentile_band` (None for a side: unbounded there)."""
    if value is None or band is None:
        return False
    lo, hi = band
    return (lo is None or lo <= value) and (hi is None or value <= hi)


def bands(values: Iterable[float], ps: Sequence[int] = PERCENTILES) -> dict[str, list[float | None] | None]:
    """`percentile_band` of each percentile `describe` reports: p50 -> [low, high] (None where unbounded)."""
    ordered = _ordered(values)
    return {f"p{p}": list(band) if (band := _band(ordered, p)) else None for p in ps}


def _ordered(values: Iterable[float]) -> np.ndarray:
    return np.sort(np.asarray([float(v) for v in values if v is not None], dtype=float))


def describe(values: Iterable[float], ps: Sequence[int] = PERCENTILES) -> dict[str, Any]:
    """count, mean, min, max and the percentiles of a list of numbers (seconds or counts)."""
    vals = [float(v) for v in values if v is not None]
    out: dict[str, Any] = {"count": len(vals)}
    if not vals:
        out.update({"mean": None, "min": None, "max": None, **{f"p{p}": None for p in ps}})
        return out
    arr = np.asarray(vals, dtype=float)
    out.update({"mean": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max())})
    for p in ps:
        out[f"p{p}"] = float(np.percentile(arr, p, method=PERCENTILE_METHOD))
    return out


def token_gaps(chunk_gaps: Sequence[float], chunk_tokens: Sequence[int] | None) -> list[float] | None:
    """Split chunk gaps per token (see module doc); None when token counts are unknown."""
    if chunk_tokens is None or len(chunk_tokens) != len(chunk_gaps) + 1:
        return None
    out: list[float] = []
    carry = 0.0
    for gap, k in zip(chunk_gaps, chunk_tokens[1:]):
        if k <= 0:
            # A chunk without new tokens (e.g. an empty-text delta): its gap merges into the next.
            carry += gap
            continue
        total = carry + gap
        carry = 0.0
        out.extend([total / k] * k)
    return out


def request_gaps(rec: dict[str, Any], unit: str) -> list[float]:
    gaps = [float(g) for g in rec.get("itl") or []]
    if unit == "token":
        split = token_gaps(gaps, rec.get("chunk_tokens"))
        return split if split is not None else gaps
    return gaps


def choose_unit(ok: Sequence[dict[str, Any]], wanted: str = "auto") -> str:
    """`token` when every successful request streamed per-chunk token counts, else `chunk`.

    Requests with only a proxy summary keep the unit the proxy measured (it cannot be re-split).
    """
    summarized = {str(r["itl_summary"].get("unit")) for r in ok if r.get("itl_summary")}
    if summarized:
        return summarized.pop() if len(summarized) == 1 else "/".join(sorted(summarized))
    if wanted in ("chunk", "token"):
        if wanted == "token" and not _all_have_tokens(ok):
            return "chunk"
        return wanted
    return "token" if ok and _all_have_tokens(ok) else "chunk"


def _all_have_tokens(ok: Sequence[dict[str, Any]]) -> bool:
    return all(token_gaps(r.get("itl") or [], r.get("chunk_tokens")) is not None for r in ok)


def tpot(rec: dict[str, Any]) -> float | None:
    if "tpot" in rec:  # measured by the proxy (first → last token), kept as measured
        return rec["tpot"] if rec.get("ok") else None
    n = rec.get("output_tokens")
    if not rec.get("ok") or not n or n <= 1 or rec.get("e2e") is None or rec.get("ttft") is None:
        return None
    return (rec["e2e"] - rec["ttft"]) / (n - 1)


def tail(gaps: Sequence[float]) -> tuple[float, float] | None:
    """(p99, max) of one request's own gaps."""
    if not gaps:
        return None
    arr = np.asarray(gaps, dtype=float)
    return float(np.percentile(arr, 99, method=PERCENTILE_METHOD)), float(arr.max())


def request_tail(rec: dict[str, Any], unit: str) -> tuple[float, float] | None:
    """(p99, max) of a request: from its gaps, or from the proxy's summary when it has no gaps."""
    summary = rec.get("itl_summary")
    if summary and not rec.get("itl"):
        if not summary.get("count") or summary.get("p99") is None or summary.get("max") is None:
            return None
        return float(summary["p99"]), float(summary["max"])
    return tail(request_gaps(rec, unit))


LENGTH_TOLERANCE = 0.05  # a class whose actual median length is further off than this is flagged


def lengths(ok: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per class: the median prompt and output length asked for and the one the server counted
    (`usage`), and how far off (a fraction; flagged beyond LENGTH_TOLERANCE)."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({str(r.get("class")) for r in ok}):
        rs = [r for r in ok if str(r.get("class")) == name]
        entry: dict[str, Any] = {}
        for what, asked_key, got_key in (("prompt", "prompt_tokens_requested", "prompt_tokens"),
                                         ("output", "max_tokens", "output_tokens")):
            asked = percentile([float(r[asked_key]) for r in rs if r.get(asked_key) is not None], 50)
            got = percentile([float(r[got_key]) for r in rs if r.get(got_key) is not None], 50)
            off = (got - asked) / asked if asked and got is not None else None
            entry[what] = {"requested": asked, "actual": got, "off": off,
                           "flagged": off is not None and abs(off) > LENGTH_TOLERANCE}
        out[name] = entry
    return out


def run_stats(
    requests: Sequence[dict[str, Any]],
    *,
    unit: str = "auto",
    stall_threshold: float = DEFAULT_STALL_THRESHOLD,
    by_class: bool = True,
) -> dict[str, Any]:
    """Statistics of the measured (non-warm-up) requests of one run."""
    measured = [r for r in requests if not r.get("warmup")]
    ok = [r for r in measured if r.get("ok")]
    failed = [r for r in measured if not r.get("ok")]
    u = choose_unit(ok, unit)
    pooled: list[float] = []
    p99s: list[float] = []
    maxes: list[float] = []
    stalled = 0
    for r in ok:
        pooled.extend(request_gaps(r, u))
        t = request_tail(r, u)
        if t:
            p99s.append(t[0])
            maxes.append(t[1])
            stalled += t[1] > stall_threshold
    starts = [r["start_time"] for r in measured]
    ends = [r["start_time"] + (r.get("end") or 0.0) for r in measured]
    window = (max(ends) - min(starts)) if measured else 0.0
    out_tokens = sum(int(r.get("output_tokens") or 0) for r in ok)
    in_tokens = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    reasons = Counter(str(r.get("error")) for r in failed)
    stats: dict[str, Any] = {
        "definitions": {
            "percentiles": f"numpy.percentile, method={PERCENTILE_METHOD}",
            "itl_unit": u,
            "stall_threshold_s": stall_threshold,
        },
        "requests": {
            "total": len(requests),
            "warmup": len(requests) - len(measured),
            "measured": len(measured),
            "ok": len(ok),
            "failed": len(failed),
            "error_rate": (len(failed) / len(measured)) if measured else None,
            "errors": dict(reasons.most_common()),
        },
        "ttft": describe(r["ttft"] for r in ok),
        "bands": {"ttft": bands(r["ttft"] for r in ok), "tail_itl": bands(maxes)},
        "e2e": describe(r["e2e"] for r in ok),
        "tpot": describe(t for t in (tpot(r) for r in ok) if t is not None),
        "itl": {"unit": u, **describe(pooled)},
        "tail_itl": {"per_request_p99": describe(p99s), "per_request_max": describe(maxes)},
        "stalls": {
            "threshold_s": stall_threshold,
            "requests": stalled,
            "share": (stalled / len(maxes)) if maxes else None,
        },
        "throughput": {
            "window_s": window,
            "output_tokens": out_tokens,
            "input_tokens": in_tokens,
            "output_tokens_per_s": (out_tokens / window) if window > 0 else None,
            "requests_per_s": (len(ok) / window) if window > 0 else None,
        },
    }
    if any(r.get("itl_summary") and not r.get("itl") for r in ok):
        stats["itl"]["available"] = False
        stats["itl"]["note"] = POOLED_UNAVAILABLE
    if by_class:
        stats["lengths"] = lengths(ok)
        names = sorted({str(r.get("class")) for r in measured})
        if len(names) > 1:
            stats["classes"] = {
                n: run_stats(
                    [r for r in measured if str(r.get("class")) == n],
                    unit=u,
                    stall_threshold=stall_threshold,
                    by_class=False,
                )
                for n in names
            }
    return stats
