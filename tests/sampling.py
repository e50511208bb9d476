"""What tail sampling should keep, computed independently of the collector.

The truth is what was sent: the proxy's own trace file (`--trace-file`, every span it exported)
plus the vLLM-like spans the test itself exported (tests/otlp.py VllmSpans). The policies are
read from the collector configuration under test and evaluated here the way the
tailsamplingprocessor documents them, so a wrong field or threshold in the configuration shows
up as a mismatch with what Jaeger stored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from otlp import attrs

STATUS_ERROR = 2


@dataclass
class Policies:
    """The thresholds of collector/otelcol.yaml's tail_sampling policies (names as in the file)."""

    ttft_above: float          # slow-ttft: gen_ai.response.time_to_first_chunk > this
    stalls_min: int            # stalls: pd.stalls >= this
    latency_ms: int            # slow-requests: whole trace longer than this
    baseline_percent: float    # baseline: probabilistic share of everything

    @classmethod
    def of(cls, tail_sampling: dict) -> Policies:
        by_name = {p["name"]: p for p in tail_sampling["policies"]}
        assert set(by_name) == {"errors", "slow-ttft", "stalls", "slow-requests", "baseline"}, set(by_name)
        assert by_name["errors"]["status_code"]["status_codes"] == ["ERROR"]
        (condition,) = by_name["slow-ttft"]["ottl_condition"]["span"]
        ttft = re.fullmatch(r'(?:span\.)?attributes\["gen_ai\.response\.time_to_first_chunk"\] > ([\d.]+)', condition)
        assert ttft, condition
        stalls = by_name["stalls"]["numeric_attribute"]
        assert stalls["key"] == "pd.stalls" and "max_value" not in stalls
        return cls(float(ttft.group(1)), int(stalls["min_value"]), int(by_name["slow-requests"]["latency"]["threshold_ms"]),
                   float(by_name["baseline"]["probabilistic"]["sampling_percentage"]))

    def matching(self, spans: list[dict]) -> set[str]:
        """The deterministic policies that keep this trace (the baseline one is a hash draw)."""
        out = set()
        if any(s.get("status", {}).get("code") == STATUS_ERROR for s in spans):
            out.add("errors")
        values = [attrs(s) for s in spans]
        if any(float(a.get("gen_ai.response.time_to_first_chunk", 0)) > self.ttft_above for a in values):
            out.add("slow-ttft")
        if any(int(a.get("pd.stalls", 0)) >= self.stalls_min for a in values):
            out.add("stalls")
        start = min(int(s["startTimeUnixNano"]) for s in spans)
        end = max(int(s["endTimeUnixNano"]) for s in spans)
        if (end - start) // 1_000_000 > self.latency_ms:  # Go's Duration.Milliseconds() truncates
            out.add("slow-requests")
        return out


def read_trace_file(path: Path, torn_ok: bool = False) -> dict[str, list[dict]]:
    """Spans by trace id from OTLP-JSON lines (hex ids), each with its `service`.

    `torn_ok`: the writer may have been killed mid-line and a restarted one appended to the
    same line; the torn fragment's spans count as never written, the message after it is read."""
    traces: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            if not torn_ok:
                raise
            start = line.rfind('{"resourceSpans"')
            message = json.loads(line[start:]) if start > 0 else {}
        for rs in message.get("resourceSpans", []):
            resource = attrs(rs.get("resource", {}))
            for ss in rs.get("scopeSpans", []):
                for span in ss.get("spans", []):
                    traces.setdefault(span["traceId"], []).append({**span, "service": resource.get("service.name")})
    return traces


def binomial_interval(n: int, p: float, alpha: float = 1e-4) -> tuple[int, int]:
    """The central interval holding a Binomial(n, p) count with probability >= 1 - alpha."""
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    lo, tail = 0, 0.0
    while tail + pmf[lo] <= alpha / 2:
        tail += pmf[lo]
        lo += 1
    hi, tail = n, 0.0
    while tail + pmf[hi] <= alpha / 2:
        tail += pmf[hi]
        hi -= 1
    return lo, hi
