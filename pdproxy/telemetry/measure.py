"""From a request's timestamps to the numbers both outputs (spans and metrics) report.

Definitions (the same as the bench's, see docs/reference/telemetry.md):
* TTFT: request received → first token-bearing event from the decode (or single) instance.
* gaps: time between consecutive token-bearing events; when every event reported its token count
  (streamed `usage`), a gap of k tokens counts as k gaps of gap/k (`unit=token`), else one gap
  per event (`unit=chunk`).
* per-request ITL statistics: over that request's own gaps; percentiles are numpy's default
  linear interpolation, computed here without numpy because the lists are short.
* TPOT: (last token − first token) / (output tokens − 1), for streams with more than one token.
"""

from __future__ import annotations

import math
from bisect import bisect_right

from pdproxy.telemetry.clock import seconds

STAGES = ("queue", "prefill", "kv_transfer", "decode")


class Timeline:
    """Monotonic-ns stamps of one request; absent stamps are stages never reached.

    Timeline and Measurement are plain classes, not dataclasses: compiled, a dataclass's generated
    `__init__` runs interpreted, and each request makes one of each."""

    def __init__(self, received: int, admitted: int | None = None, prefill_done: int | None = None,
                 decode_sent: int | None = None, decode_headers: int | None = None, first_token: int | None = None,
                 end: int | None = None) -> None:
        self.received = received
        self.admitted = admitted  # instances chosen; the first leg goes out now
        self.prefill_done = prefill_done  # prefill response read (P/D only)
        self.decode_sent = decode_sent
        self.decode_headers = decode_headers
        self.first_token = first_token
        self.end = end

    def stage_bounds(self, pd_mode: bool) -> dict[str, tuple[int, int]]:
        """Start/end of each stage span reached; the last one reached ends with the request."""
        end = self.end if self.end is not None else self.received
        bounds: dict[str, tuple[int, int]] = {}
        points = [("queue", self.received), ("prefill", self.admitted)]
        if pd_mode:
            points.append(("kv_transfer", self.prefill_done))
        points.append(("decode", self.first_token))
        reached = [(name, t) for name, t in points if t is not None]
        for (name, start), nxt in zip(reached, reached[1:] + [(None, end)]):
            bounds[name] = (start, nxt[1])
        return bounds


class Measurement:
    """What `measure` makes of a request: every figure its spans and metrics report."""

    def __init__(self, ok: bool, status: int, failed_stage: str | None, error_type: str | None,
                 stages: dict[str, float], e2e: float = 0.0, bounds: dict[str, tuple[int, int]] | None = None) -> None:
        self.ok = ok
        self.status = status
        self.failed_stage = failed_stage
        self.error_type = error_type
        self.stages = stages
        self.ttft: float | None = None
        self.e2e = e2e
        self.tpot: float | None = None
        self.gaps: list[float] = []  # sorted: only their distribution is reported
        self.itl_unit = "chunk"
        self.itl_mean: float | None = None
        self.itl_p50: float | None = None
        self.itl_p99: float | None = None
        self.itl_max: float | None = None
        self.stalls = 0
        self.chunks = 0
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.handoff_gap: float | None = None
        self.decode_headers_wait: float | None = None
        self.decode_queue_time: float | None = None
        self.kv_estimated: float | None = None
        self.bounds = bounds if bounds is not None else {}  # each stage's (start, end) monotonic ns


def percentile(ordered: list[float], q: float) -> float:
    """numpy.percentile(values, q) with the default 'linear' method, on an already sorted list."""
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def token_gaps(chunk_times: list[int], chunk_tokens: list[int]) -> tuple[list[float], str]:
    """Gaps between token-bearing events, split per token when every event said how many it carried."""
    per_token = bool(chunk_tokens) and all(k > 0 for k in chunk_tokens)
    if not per_token or max(chunk_tokens) == 1:  # one gap per event: no splitting to do
        return [(b - a) / 1e9 for a, b in zip(chunk_times, chunk_times[1:])], "token" if per_token else "chunk"
    gaps: list[float] = []
    for i in range(1, len(chunk_times)):
        gap = (chunk_times[i] - chunk_times[i - 1]) / 1e9
        if per_token and chunk_tokens[i] > 1:
            k = chunk_tokens[i]
            gaps.extend([gap / k] * k)
        else:
            gaps.append(gap)
    return gaps, "token" if per_token else "chunk"


def stall_gaps(chunk_times: list[int], chunk_tokens: list[int], threshold: float,
               limit: int) -> list[tuple[int, float, int]]:
    """The longest `limit` stalls as (gap start ns, gap s, tokens after it), in time order.

    A stall is a gap whose per-unit value (per token when every event said its token count, as
    for `token_gaps`) is above the threshold; its length is the whole gap between the two events.
    """
    per_token = bool(chunk_tokens) and len(chunk_tokens) == len(chunk_times) and all(k > 0 for k in chunk_tokens)
    found = []
    for i in range(1, len(chunk_times)):
        gap = (chunk_times[i] - chunk_times[i - 1]) / 1e9
        k = chunk_tokens[i] if per_token else 1
        if gap / k > threshold:
            found.append((chunk_times[i - 1], gap, k))
    if len(found) > limit:
        found = sorted(sorted(found, key=lambda s: -s[1])[:limit])
    return found


def measure(
    t: Timeline,
    *,
    pd_mode: bool,
    status: int,
    failed_stage: str | None,
    error_type: str | None,
    chunk_times: list[int],
    chunk_tokens: list[int],
    usage: dict | None,
    server_metrics: dict | None,
    stall_threshold: float,
) -> Measurement:
    end = t.end if t.end is not None else t.received
    bounds = t.stage_bounds(pd_mode)
    stages = {name: seconds(a, b) for name, (a, b) in bounds.items()}
    m = Measurement(ok=error_type is None, status=status, failed_stage=failed_stage, error_type=error_type,
                    stages=stages, e2e=seconds(t.received, end), bounds=bounds)
    if t.first_token is not None:
        m.ttft = seconds(t.received, t.first_token)
    m.chunks = len(chunk_times)
    gaps, m.itl_unit = token_gaps(chunk_times, chunk_tokens)
    if gaps:
        m.gaps = ordered = sorted(gaps)
        m.itl_mean = sum(ordered) / len(ordered)
        m.itl_p50 = percentile(ordered, 50)
        m.itl_p99 = percentile(ordered, 99)
        m.itl_max = ordered[-1]
        m.stalls = len(ordered) - bisect_right(ordered, stall_threshold)
    if isinstance(usage, dict):
        m.input_tokens = _int(usage.get("prompt_tokens"))
        m.output_tokens = _int(usage.get("completion_tokens"))
    out = m.output_tokens if m.output_tokens is not None else (sum(chunk_tokens) or len(chunk_times) or None)
    if out and out > 1 and len(chunk_times) > 1:
        m.tpot = seconds(chunk_times[0], chunk_times[-1]) / (out - 1)
    if pd_mode and t.prefill_done is not None:
        if t.decode_sent is not None:
            m.handoff_gap = seconds(t.prefill_done, t.decode_sent)
        if t.decode_sent is not None and t.decode_headers is not None:
            m.decode_headers_wait = seconds(t.decode_sent, t.decode_headers)
        if "kv_transfer" in stages and t.first_token is not None:
            m.kv_estimated = max(0.0, stages["kv_transfer"] - (m.itl_p50 or 0.0))
    if isinstance(server_metrics, dict) and isinstance(server_metrics.get("queue_time_ms"), (int, float)):
        m.decode_queue_time = server_metrics["queue_time_ms"] / 1000.0
    return m


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
