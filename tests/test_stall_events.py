"""Each stall is a `pd.stall` event on `pd.decode` (time and length), and `pdproxy trace` names its cause.

A single simulated instance without chunked prefill: a long prompt's prefill holds up the step of
the streams that are decoding, so their gap above the threshold coincides with that prefill. The
events are checked against the bench client's own record of the gaps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from procs import start_proxy, start_sim
from real_traces import otlp_spans

from pdproxy.telemetry.measure import stall_gaps

WORKLOAD = """
requests: 14
seed: 5
classes:
  - {name: stream, prompt: 30, output: 60, concurrency: 2}
  - {name: long, prompt: 4000, output: 2, rate: 3}
"""


def test_stall_gaps_keeps_the_longest_in_time_order():
    ms = 1_000_000
    times = [0, 10 * ms, 200 * ms, 210 * ms, 500 * ms, 520 * ms, 900 * ms]
    assert stall_gaps(times, [1] * 7, 0.1, 16) == [(10 * ms, 0.19, 1), (210 * ms, 0.29, 1), (520 * ms, 0.38, 1)]
    assert stall_gaps(times, [1] * 7, 0.1, 2) == [(210 * ms, 0.29, 1), (520 * ms, 0.38, 1)]
    # per token when every event said its count: 190 ms for 2 tokens is two gaps of 95 ms, not a stall
    assert stall_gaps(times, [1, 1, 2, 1, 1, 1, 1], 0.1, 16) == [(210 * ms, 0.29, 1), (520 * ms, 0.38, 1)]
    assert stall_gaps(times, [0] * 7, 0.1, 16)[0] == (10 * ms, 0.19, 1)  # counts unknown: per event


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("stalls")
    (d / "w.yaml").write_text(WORKLOAD)
    procs = []
    try:
        sim, url = start_sim("single", "--no-enable-chunked-prefill", "--otlp-traces-file", str(d / "vllm.jsonl"))
        procs.append(sim)
        proxy, purl = start_proxy("--decode", url, "--trace-file", str(d / "proxy.jsonl"), "--stall-threshold", "0.05")
        procs.append(proxy)
        p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", purl, "--workload", str(d / "w.yaml"),
                            "--label", "single", "--out", str(d / "rec.jsonl"), "--no-progress", "--quiet"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
    finally:
        for proc in reversed(procs):
            proc.stop()
    return {"dir": d}


def _events(d: Path) -> dict[str, list[dict]]:
    """request id → pd.stall events of its pd.decode span."""
    spans = [sp for _, _, sp in otlp_spans(d / "proxy.jsonl")]
    roots = {sp["spanId"]: next(a["value"]["stringValue"] for a in sp["attributes"] if a["key"] == "pd.request_id")
             for sp in spans if any(a["key"] == "pd.request_id" for a in sp.get("attributes", []))}
    return {roots[sp["parentSpanId"]]: [e for e in sp.get("events", []) if e["name"] == "pd.stall"]
            for sp in spans if sp["name"] == "pd.decode" and sp.get("events")}


def test_stall_events_match_the_clients_gaps(run):
    d = run["dir"]
    events = _events(d)
    records = {r["request_id"]: r for r in map(json.loads, (d / "rec.jsonl").read_text().splitlines())
               if r.get("type") == "request"}
    assert events, "no stall recorded: the long prefills should hold up the streams"
    checked = 0
    for rid, evs in events.items():
        r = records[rid]
        starts, t = [], r["start_time"] + r["ttft"]
        for g in r["itl"]:
            starts.append((t, g))
            t += g
        for e in evs:
            dur = next(a["value"]["doubleValue"] for a in e["attributes"] if a["key"] == "pd.stall.duration")
            at = int(e["timeUnixNano"]) / 1e9
            assert dur > 0.05
            # the client saw the same gap, at the same moment (one host, one clock)
            assert any(abs(g - dur) < 0.015 and abs(s - at) < 0.02 for s, g in starts), (rid, dur, at)
            checked += 1
    assert checked >= 1


def test_trace_names_the_prefill_behind_a_stall(run):
    d = run["dir"]
    rid = next(r for r, evs in _events(d).items() if "-stream-" in r and evs)
    p = subprocess.run([sys.executable, "-m", "pdproxy", "trace", rid, "--traces", str(d / "proxy.jsonl"),
                        "--traces", str(d / "vllm.jsonl"), "--stall-threshold-ms", "50"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert all(len(line) <= 100 for line in lines)  # a pipe: 100 columns
    decode_row = next(line for line in lines if line.startswith(" pd.decode"))
    assert "!" in decode_row
    stalls = [line for line in lines if line.startswith("  +")]
    assert stalls and all(" prefill with " in line and "-long-" in line for line in stalls), p.stdout


def test_a_gap_the_proxy_did_not_see_is_put_on_the_client_side():
    from pdproxy.bench import attribution
    from pdproxy.bench.traces import TraceInfo

    record = {"request_id": "r1", "start_time": 100.0, "ttft": 0.05, "itl": [0.01, 0.3, 0.01],
              "chunk_tokens": [1, 1, 1, 1]}
    other = TraceInfo("t2", "r2", "root", {"pd.mode": "single", "pd.decode.instance": "h:1"}, {},
                      stage_times={"prefill": (100.05, 100.4)})
    timeline = attribution.Timeline([other])
    for seen, cause in ((0.02, "client"), (0.305, "prefill")):
        info = TraceInfo("t1", "r1", "root", {"pd.mode": "single", "pd.decode.instance": "h:1", "pd.itl.max": seen},
                         {})
        (stall,) = attribution.request_stalls(info, record, 0.1, timeline)
        assert stall["duration"] == 0.3 and stall["cause"] == cause
        assert stall["with"] == ([{"request_id": "r2", "tokens": 0}] if cause == "prefill" else [])
