"""Drill-down of live traffic read from a trace store: the real Jaeger v2 of .tools/ (tools/build-jaeger.sh).

Two recordings of real vLLM 0.23 behind pdproxy (tests/fixtures: a 2P2D run with a decode killed, and four single
instances with stalls) are sent to Jaeger's OTLP receiver as they are, then `pdproxy report --jaeger URL` reads a
window of them back (Jaeger's api/v3 search, spans as stored) and `pdproxy trace ID --jaeger URL` one request
and its neighbours (api/v3 by trace id, api/traces by request id and by decode instance). Both must say what
the same commands say from the files.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from jaeger import Jaeger
from real_traces import otlp_spans
from waits import scaled

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FILES = [FIXTURES / "xpyd" / "run-b.otlp.jsonl.gz", FIXTURES / "real-xpyd-2026-12-01b" / "pd-dp.jsonl.gz"]
WINDOW = ("--start", "2026-12-01T00:00:00Z", "--end", "2026-12-02T00:00:00Z")  # the recordings' day
TRACES = len({sp["traceId"] for path in FILES for res, _, sp in otlp_spans(path)
              if res["service.name"]["stringValue"] == "pdproxy"})  # with a span of the proxy: what a search finds


def pdproxy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdproxy", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def store():
    """A Jaeger holding both recordings, sent over OTLP/HTTP as the collector's file exporter wrote them."""
    jaeger = Jaeger("jaeger-report")
    try:
        otlp = f"http://{jaeger.env['JAEGER_OTLP_HTTP_ENDPOINT']}/v1/traces"
        for path in FILES:
            with gzip.open(path, "rb") as f:
                for line in f:
                    req = urllib.request.Request(otlp, data=line, headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=10) as r:
                        assert r.status == 200
        query = (f"{jaeger.url}/api/v3/traces?query.service_name=pdproxy&query.start_time_min=2026-12-01T00:00:00Z"
                 f"&query.start_time_max=2026-12-02T00:00:00Z&query.num_traces=1000")
        deadline = time.monotonic() + scaled(15)
        while True:  # stored once its batch processor flushed (until then api/v3 says 404: no trace found)
            try:
                with urllib.request.urlopen(query, timeout=10) as r:
                    doc = json.loads(r.read())
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise
                doc = {}
            found = {sp["traceId"] for rs in doc.get("result", {}).get("resourceSpans", [])
                     for ss in rs["scopeSpans"] for sp in ss["spans"]}
            if len(found) >= TRACES or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(found) == TRACES
        yield jaeger
    finally:
        jaeger.stop()


def figures(rep: dict) -> list[tuple]:
    """What a live-traffic report says, run by run, without where it was read from."""
    out = []
    for e in rep["runs"]:
        st = e["stats"]
        out.append((e["label"], st["requests"], st["ttft"], st["tail_itl"], st["throughput"], e["stall_attribution"],
                    [(i["role"], i["address"], i["requests"], i["attempts"], i["attempts_failed"], i["stalls"])
                     for i in e["instances"]],
                    [[s["request_id"] for s in e["slowest"][k]] for k in ("ttft", "tail_itl")]))
    return out


def test_report_of_a_window_in_jaeger_is_the_report_of_the_files(store, tmp_path):
    from_store, from_files = tmp_path / "store.json", tmp_path / "files.json"
    p = pdproxy("report", "--jaeger", store.url, *WINDOW, "--json", str(from_store))
    f = pdproxy("report", *[x for path in FILES for x in ("--traces", str(path))], "--json", str(from_files),
                "--no-table")
    assert p.returncode == f.returncode == 0, p.stderr + f.stderr
    rep, ref = json.loads(from_store.read_text()), json.loads(from_files.read_text())
    assert [e["label"] for e in rep["runs"]] == ["dp-4", "pd-2p2d-kill"]
    assert figures(rep) == figures(ref)
    assert rep["traces"]["traces"] == TRACES and rep["traces"]["engine_spans"] == ref["traces"]["engine_spans"] > 0
    text = " ".join(p.stdout.split())
    assert "30 stalls" in text and "FLAG: pd-2p2d-kill: decode 127.0.0.1:8201: 10 of 14 attempts failed" in text
    assert max(map(len, p.stdout.splitlines())) <= 100


@pytest.mark.parametrize("request_id", ["bench-3081828a-talk-18", "bench-cc978f0c-agent-35"])
def test_trace_from_jaeger_is_the_trace_from_the_files(store, request_id):
    """A migrated request (its failed attempt and re-prefill) and a stalled one (the prefill that caused it,
    found among the other requests the store holds for the same instance)."""
    ref = pdproxy("trace", request_id, *[x for path in FILES for x in ("--traces", str(path))])
    by_id = pdproxy("trace", request_id, "--jaeger", store.url, *WINDOW[:2])
    assert ref.returncode == by_id.returncode == 0, ref.stderr + by_id.stderr
    trace_id = ref.stdout.split()[1]
    by_trace = pdproxy("trace", trace_id, "--jaeger", store.url)  # a trace id needs no window
    assert by_trace.returncode == 0, by_trace.stderr
    assert by_id.stdout == by_trace.stdout == ref.stdout
    assert "✗ decode #1" in ref.stdout or "549.5 ms prefill with bench-cc978f0c-rag-3" in ref.stdout


def test_a_window_too_small_or_empty_says_so(store, tmp_path):
    out = tmp_path / "r.json"
    p = pdproxy("report", "--jaeger", store.url, *WINDOW, "--limit", "5", "--json", str(out), "--no-table")
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    assert rep["traces"]["traces"] == 5 and "the first 5 traces only" in rep["traces"]["files"][0]
    empty = pdproxy("report", "--jaeger", store.url, "--start", "2020-01-01T00:00:00Z", "--since", "1h")
    assert empty.returncode == 2 and "--since or --start, not both" in empty.stderr
    empty = pdproxy("report", "--jaeger", store.url, "--start", "2020-01-01T00:00:00Z", "--end", "2020-01-01T01:00:00Z")
    assert empty.returncode == 2 and "no request traces" in empty.stderr and "Traceback" not in empty.stderr
    gone = pdproxy("trace", "bench-nothing", "--jaeger", store.url, "--since", "1h")
    assert gone.returncode == 1 and "no request trace" in gone.stderr
