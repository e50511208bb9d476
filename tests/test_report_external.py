"""Reading another benchmark client's per-request records: aiperf 0.13.0's profile_export.jsonl.

The fixture is a real aiperf run (2 warm-up + 12 profiling requests, 2 of them answered 503),
captured against a fake OpenAI server; aiperf's own aggregate file from the same run is next to
it and serves as the independent check of our numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FIX = Path(__file__).parent / "fixtures" / "bench" / "aiperf"


def report(*args: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", "--no-table", "--json", "-", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_aiperf_records_match_aiperfs_own_aggregates() -> None:
    agg = json.loads((FIX / "profile_export_aiperf.json").read_text())
    r = report(str(FIX))  # the artifact directory
    run = r["runs"][0]
    st = run["stats"]
    assert run["tool"].startswith("aiperf 0.13")
    # aiperf counts profiling requests only: warm-up excluded, errors counted
    assert st["requests"]["warmup"] == 2
    assert st["requests"]["ok"] == agg["request_count"]["avg"] == 10
    assert st["requests"]["failed"] == agg["error_request_count"]["avg"] == 2
    assert st["requests"]["errors"] == {"http_503": 2}
    # aiperf's percentiles are numpy-linear too, so TTFT and pooled chunk gaps agree to rounding
    for ours, theirs in ((st["ttft"], agg["time_to_first_token"]), (st["itl"], agg["inter_chunk_latency"])):
        assert ours["count"] == theirs["count"]
        for p in ("p50", "p90", "p99"):
            assert ours[p] * 1e3 == pytest.approx(theirs[p], rel=1e-9), p
    assert st["itl"]["unit"] == "chunk"  # aiperf does not keep per-chunk token counts


def test_aiperf_records_recomputed_independently_and_joined_to_traces(tmp_path: Path) -> None:
    recs = [json.loads(x) for x in (FIX / "profile_export.jsonl").read_text().splitlines() if x.strip()]
    prof = [x for x in recs if x["metadata"]["benchmark_phase"] == "profiling"]
    ok = [x for x in prof if not x.get("error")]
    maxes = [max(x["metrics"]["inter_chunk_latency"]["value"]) / 1e3 for x in ok]
    # A trace file in the Collector file-exporter shape whose roots carry aiperf's X-Request-ID.
    spans = []
    for i, x in enumerate(ok[:6]):
        tid = f"{i + 1:032x}"
        spans.append({"traceId": tid, "spanId": f"{i + 1:016x}", "name": "text_completion sim-model", "kind": 2,
                      "startTimeUnixNano": "1000000000", "endTimeUnixNano": "1090000000",
                      "attributes": [{"key": "pd.request_id", "value": {"stringValue": x["metadata"]["x_request_id"]}},
                                     {"key": "pd.mode", "value": {"stringValue": "pd"}},
                                     {"key": "gen_ai.response.time_to_first_chunk", "value": {"doubleValue": 0.02}}]})
        spans.append({"traceId": tid, "spanId": f"{i + 101:016x}", "parentSpanId": f"{i + 1:016x}",
                      "name": "pd.kv_transfer", "kind": 1, "startTimeUnixNano": "1005000000",
                      "endTimeUnixNano": str(1005000000 + (i + 1) * 1000000),
                      "attributes": [{"key": "pd.kv_transfer.estimated", "value": {"doubleValue": i * 0.001}}]})
    res = {"resource": {"attributes": [{"key": "gpu.count", "value": {"intValue": "2"}}]},
           "scopeSpans": [{"scope": {"name": "pdproxy"}, "spans": spans}]}
    tf = tmp_path / "traces.jsonl"
    tf.write_text(json.dumps({"resourceSpans": [res]}) + "\n")
    r = report(f"theirs={FIX / 'profile_export.jsonl'}", "--traces", str(tf))
    run = r["runs"][0]
    assert run["label"] == "theirs"
    assert run["traces"]["joined"] == 6
    assert run["conditions"]["gpu.count"] == 2 and run["mode"] == "pd"
    kv = run["kv_transfer"]["upper_bound"]
    assert kv["count"] == 6 and kv["p50"] == pytest.approx(np.percentile([0.001 * k for k in range(1, 7)], 50))
    tail = run["stats"]["tail_itl"]["per_request_max"]
    for p in (50, 90, 99):
        assert tail[f"p{p}"] == pytest.approx(np.percentile(maxes, p))
    ttfts = [x["metrics"]["time_to_first_token"]["value"] / 1e3 for x in ok]
    assert run["slowest"]["ttft"][0]["ttft"] == pytest.approx(max(ttfts))


def test_trace_file_variants(tmp_path: Path) -> None:
    """Collector output as lines, as one pretty-printed document, and with a cut last line."""
    from pdproxy.bench import traces

    def batch(i: int) -> dict:
        root = {"traceId": f"{i:032x}", "spanId": f"{i:016x}", "name": "chat m", "startTimeUnixNano": "0",
                "endTimeUnixNano": "1000", "attributes": [{"key": "pd.request_id", "value": {"stringValue": f"r{i}"}}]}
        return {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": [root]}]}]}

    lines = [json.dumps(batch(i)) for i in range(1, 5)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "b.json").write_text(json.dumps([batch(i) for i in range(1, 5)], indent=2))
    (tmp_path / "c.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])
    assert sorted(traces.read_traces([str(tmp_path / "a.jsonl")]).by_request) == ["r1", "r2", "r3", "r4"]
    assert sorted(traces.read_traces([str(tmp_path / "b.json")]).by_request) == ["r1", "r2", "r3", "r4"]
    assert sorted(traces.read_traces([str(tmp_path / "c.jsonl")]).by_request) == ["r1", "r2", "r3"]
    (tmp_path / "d.jsonl").write_text('{"resourceSpans": [}\n' + lines[0] + "\n")
    with pytest.raises(traces.TraceError):
        traces.read_traces([str(tmp_path / "d.jsonl")])
