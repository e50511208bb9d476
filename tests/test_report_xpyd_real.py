"""The report on two recorded 2P2D vLLM 0.23 runs (tests/fixtures/xpyd, provenance in its README).

Run A: what the report called the proxy's hand-off (the part of pd.kv_transfer vLLM's queue and first
step do not cover, 6.5 s at the median) was the decode's intake before its engine queue; the proxy's
own measured hand-off is ~0. Run B: a decode killed mid-run, every request saved by migration; the
per-instance view must still show the dead instance and what failed on it.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdproxy.bench import engine_spans, report, traces
from pdproxy.bench.records import read_run

XPYD = Path(__file__).resolve().parent / "fixtures" / "xpyd"
DEAD = "127.0.0.1:8201"


def build(run: str) -> dict:
    idx = traces.read_traces([str(XPYD / f"run-{run}.otlp.jsonl.gz")])
    return report.build([read_run(XPYD / f"run-{run}-bench.jsonl.gz")], idx, verdict=False)["runs"][0]


@pytest.fixture(scope="module")
def run_a() -> dict:
    return build("a")


@pytest.fixture(scope="module")
def run_b() -> dict:
    return build("b")


def test_run_a_the_proxy_hand_off_is_near_zero_and_the_rest_is_on_the_decode(run_a):
    parts = run_a["engine_split"]["parts"]
    assert parts["kv_transfer.handoff"]["count"] == 10
    assert parts["kv_transfer.handoff"]["p99"] < 0.001  # the proxy's measured pd.handoff.gap
    assert run_a["kv_transfer"]["handoff_gap"]["p99"] < 0.001
    intake = parts["kv_transfer.decode_intake"]  # on the decode: API server arrival -> engine-core QUEUED
    assert 6.0 < intake["p50"] < 7.0 and intake["p99"] > 11.0, intake
    assert parts["kv_transfer.http"]["p99"] < 0.05  # HTTP both ways between proxy and decode
    assert "kv_transfer.failed_attempts" not in {k for k, v in parts.items() if v["count"]}


def test_run_a_parts_add_up_to_the_proxys_kv_transfer_span():
    idx = traces.read_traces([str(XPYD / "run-a.otlp.jsonl.gz")])
    checked = 0
    for info in idx.by_request.values():
        s = engine_spans.split(info)
        kv = [v for k, v in s.items() if k.startswith("kv_transfer.")]
        if "kv_transfer.http" in s:
            assert sum(kv) == pytest.approx(info.stages["kv_transfer"], abs=1e-9)
            checked += 1
    assert checked >= 20


def test_run_b_the_hand_off_is_the_proxys_and_the_failed_attempts_are_apart(run_b):
    parts = run_b["engine_split"]["parts"]
    lost = parts["kv_transfer.failed_attempts"]
    assert lost["count"] == 9 and lost["p50"] > 1.0  # seconds on the killed decode (10th moved: a warm-up)
    assert parts["kv_transfer.handoff"]["p50"] < 0.001  # the proxy's own, without those
    assert parts["kv_transfer.handoff"]["p99"] < 1.0  # after a failure: backoff and a re-prefill


def test_run_a_table_and_json_name_the_decode_side(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", f"pd={XPYD / 'run-a-bench.jsonl.gz'}",
                        "--traces", str(XPYD / "run-a.otlp.jsonl.gz"), "--json", str(out), "--definitions", "--all"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "vLLM split: kv_transfer.decode_intake" in p.stdout
    assert "decode's intake before its engine queue" in " ".join(p.stdout.split())  # the definition below
    parts = json.loads(out.read_text())["runs"][0]["engine_split"]["parts"]
    assert parts["kv_transfer.decode_intake"]["p50"] > 1000 * parts["kv_transfer.handoff"]["p50"]


def test_run_b_the_killed_decode_has_a_row_with_its_failed_attempts(run_b):
    rows = {(i["role"], i["address"]): i for i in run_b["instances"]}
    dead = rows[("decode", DEAD)]
    assert dead["requests"] == 0  # migration saved every request it had: none finished there
    assert dead["attempts_failed"] == 10 and dead["attempt_failures"] == {"stream_broken": 10}
    assert dead["moved_away"] == 10 and dead["abandoned_handoffs"] == 10
    assert dead["attempts"] == 14  # 4 warm-up requests finished there before the kill
    alive = rows[("decode", "127.0.0.1:8200")]
    assert alive["attempts_failed"] == 0 and alive["requests"] == 28
    assert run_b["stats"]["requests"]["failed"] == 0  # nothing else in the report says anything failed
    assert [f for f in run_b["instance_flags"] if DEAD in f] == [
        f"decode {DEAD}: 10 of 14 attempts failed (stream_broken: 10); 10 moved to another instance, "
        "10 KV hand-offs abandoned; 0 requests finished there"]


def test_run_b_table_and_page_show_the_killed_decode(tmp_path):
    page = tmp_path / "r.html"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", f"pd={XPYD / 'run-b-bench.jsonl.gz'}",
                        "--traces", str(XPYD / "run-b.otlp.jsonl.gz"), "--html", str(page)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    assert f"FLAG: pd: decode {DEAD}: 10 of 14 attempts failed" in text
    html = page.read_text()
    assert html.count("<table class=instances") == 2 and "127.0.0.1:8201" in html  # one per role
    prefill = html.split("data-role='prefill'>", 1)[1].split("</table>", 1)[0]
    decode = html.split("data-role='decode'>", 1)[1].split("</table>", 1)[0]
    assert "127.0.0.1:8201" in decode and "KV wait" in decode and "stalls" in decode
    assert "127.0.0.1:8100" in prefill and "KV wait" not in prefill and "stalls" not in prefill  # decode-side
    assert f"decode {DEAD}: 10 of 14 attempts failed" in html


RECORDING = XPYD.parent / "real-xpyd-2026-12-01b"  # the recording's own files (provenance in its README)


def rows(run: dict) -> list[tuple]:
    return [(x["role"], x["address"], x["requests"], x["attempts"], x["attempts_failed"], x["moved_away"],
             x["abandoned_handoffs"]) for x in run["instances"]]


def test_run_b_engine_spans_add_to_the_proxys_attempts_never_replace_them(tmp_path):
    """The proxy's trace file alone, then with every vLLM span of both runs as a collector's file held
    them (with an event-less copy of the proxy's spans): the killed decode keeps its 14 attempts, 10
    failed and moved; the engine spans add their split; run A's traces (not in the records) change
    nothing. Before: the event-less copies replaced the proxy's, and the row read 4 attempts, 0 failed."""
    bench = read_run(XPYD / "run-b-bench.jsonl.gz")
    alone = report.build([bench], traces.read_traces([str(RECORDING / "pd-b.jsonl.gz")]), verdict=False)["runs"][0]
    spans = RECORDING / "vllm-spans.otlp.jsonl.gz"
    both = report.build([read_run(XPYD / "run-b-bench.jsonl.gz")],
                        traces.read_traces([str(RECORDING / "pd-b.jsonl.gz"), str(spans)]), verdict=False)["runs"][0]
    dead = next(r for r in rows(alone) if r[1] == DEAD)
    assert dead == ("decode", DEAD, 0, 14, 10, 10, 10)
    assert rows(both) == rows(alone)
    assert alone["engine_split"] is None and both["engine_split"]["requests"] == 28  # what the spans add
    # the same spans restricted to run B's traces give the same report: the other run's are ignored
    ids = {i.trace_id for i in traces.read_traces([str(RECORDING / "pd-b.jsonl.gz")]).by_request.values()}
    own = tmp_path / "run-b-vllm.jsonl"
    with open(own, "w") as out:
        for line in gzip.open(spans, "rt"):
            doc = json.loads(line)
            for rs in doc["resourceSpans"]:
                for ss in rs.get("scopeSpans") or []:
                    ss["spans"] = [sp for sp in ss.get("spans") or [] if sp["traceId"].lower() in ids]
            out.write(json.dumps(doc) + "\n")
    only = report.build([read_run(XPYD / "run-b-bench.jsonl.gz")],
                        traces.read_traces([str(RECORDING / "pd-b.jsonl.gz"), str(own)]), verdict=False)["runs"][0]
    for key in ("instances", "stats", "stages", "kv_transfer", "engine_split", "stall_attribution"):
        assert only[key] == both[key], key
