"""`pdproxy report` on live traffic, honest breakdowns and readable output, on the recorded real traces.

Live traffic (issue 55): `pdproxy report --traces FILE` with no bench records reports what the proxy traced:
the slowest requests, each instance (its role's own columns), stall time by cause and the errors. The
recordings are tests/fixtures/real-xpyd-2026-12-01b (four real vLLM 0.23 single instances behind pdproxy,
pd.stall events on its spans) and tests/fixtures/xpyd (2P2D with a decode killed: failed attempts), read
independently of pdproxy to check the figures. Output fits a 100-column terminal, file or pipe; no part of a
stage's split is negative (an overlap is shown as one); `--definitions` works alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from real_traces import REAL_TRACES, otlp_spans

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DP = FIXTURES / "real-xpyd-2026-12-01b" / "pd-dp.jsonl.gz"  # 4 single instances, 150 requests, 30 stalls
KILL = FIXTURES / "xpyd" / "run-b.otlp.jsonl.gz"  # 2P2D, 127.0.0.1:8201 killed: 10 attempts moved away


def pdproxy(*args: str, columns: int | None = None) -> subprocess.CompletedProcess:
    """A pdproxy command whose output is a pipe (as to a file); COLUMNS only when given."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "pdproxy", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def roots(path: Path) -> list[dict]:
    """The proxy's root spans of a trace file (read without pdproxy): attributes as a dict."""
    out = []
    for _, _, sp in otlp_spans(path):
        a = {x["key"]: next(iter(x["value"].values())) for x in sp.get("attributes", [])}
        if "pd.request_id" in a and not sp["name"].startswith("pd."):
            out.append({**sp, "a": a})
    return out


def test_live_traffic_from_a_trace_file_alone(tmp_path):
    out = tmp_path / "r.json"
    p = pdproxy("report", "--traces", str(DP), "--slowest", "2", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    assert rep["traffic"] is True and rep["verdict"] is None  # no SLOs, no candidate: nothing to decide
    (run,) = rep["runs"]
    mine = roots(DP)
    ttft = [r["a"]["gen_ai.response.time_to_first_chunk"] for r in mine]
    assert run["label"] == "dp-4" and run["stats"]["requests"]["measured"] == len(mine) == 150
    for q in (50, 90, 99):  # measured at the proxy: its roots' TTFT, recomputed here
        assert run["stats"]["ttft"][f"p{q}"] == pytest.approx(np.percentile(ttft, q))
    slowest = run["slowest"]["ttft"]
    assert [s["request_id"] for s in slowest] == [r["a"]["pd.request_id"] for r in
                                                  sorted(mine, key=lambda r: -r["a"]["gen_ai.response.time_to_first_chunk"])[:2]]
    # each instance: four single instances (not "decode"), their requests adding up
    rows = run["instances"]
    assert {i["role"] for i in rows} == {"single"} and len(rows) == 4
    assert sum(i["requests"] for i in rows) == 150
    # stalls by cause, from the proxy's pd.stall events: the long prompts' prefills on the same instance
    stalls = run["stall_attribution"]
    assert stalls["stalls"] == 30 and stalls["by_cause"]["prefill"]["stalls"] == 30
    text = p.stdout
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100  # a file or a pipe: 100 columns
    assert "Per single instance, dp-4" in text and "Per decode instance" not in text
    assert "30 stalls" in text and "prefill 100%" in text and "errors by reason" in text
    assert "records joined to traces" not in text and "Comparison:" not in text
    assert "prefill ?" not in text and "  single     127.0.0.1:" in text  # single mode: one leg, named so
    blocks = [x for x in lines if re.match(r"dp-4 · slowest (TTFT|tail ITL)", x)]
    assert len(blocks) == 4  # --slowest 2 per criterion, all shown for live traffic
    for s in slowest:  # ids whole on their lines, ready for `pdproxy trace ID`
        assert f"  trace id   {s['trace_id']}" in lines and f"  request id {s['request_id']}" in lines
    assert "549ms prefill (bench-cc978f0c-rag-3)" in text  # a stall with the request that caused it


def test_live_traffic_with_a_killed_decode_and_an_slo(tmp_path):
    out = tmp_path / "r.json"
    p = pdproxy("report", "--traces", str(KILL), "--slo-ttft-ms", "60000", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    (run,) = rep["runs"]
    dead = next(i for i in run["instances"] if i["address"] == "127.0.0.1:8201")
    assert dead["role"] == "decode" and dead["attempts"] == 14 and dead["attempts_failed"] == 10
    text = " ".join(p.stdout.split())
    assert "FLAG: pd-2p2d-kill: decode 127.0.0.1:8201: 10 of 14 attempts failed (stream_broken: 10)" in text
    assert rep["verdict"]["decision"] == "pass" and "Verdict: PASS" in text  # the traffic against its SLO alone
    prefill = p.stdout.split("Per prefill instance", 1)[1].split("Per decode instance", 1)[0]
    assert "127.0.0.1:8100" in prefill and "stalls" not in prefill and "KV wait" not in prefill


def test_no_runs_no_traces_and_definitions_alone():
    p = pdproxy("report")
    assert p.returncode == 2 and "--traces FILE" in p.stderr and "Traceback" not in p.stderr
    d = pdproxy("report", "--definitions")
    assert d.returncode == 0, d.stderr
    assert max(map(len, d.stdout.splitlines())) <= 100
    text = " ".join(d.stdout.split())
    for name in ("tail_itl:", "kv_transfer:", "engine_split:", "overlap:", "stall_attribution:", "bands:",
                 "measured_at:", "pairing:"):
        assert name in text, name


def test_every_row_fits_100_columns_and_no_part_is_negative():
    """The 2-GPU recording, every row: a pipe's 100 columns; vLLM's decode began before pd.decode for some
    requests (the first token reached the proxy later than the last did): an overlap row, no negative rest."""
    args = ["report", f"single={REAL_TRACES / 'bench-2gpu-single.jsonl.gz'}", f"pd={REAL_TRACES / 'bench-2gpu-pd.jsonl.gz'}",
            "--traces", str(REAL_TRACES / "vllm023-pd-2gpu.otlp.jsonl.gz")]
    every, decides = pdproxy(*args, "--all"), pdproxy(*args)
    assert every.returncode == decides.returncode == 0, every.stderr + decides.stderr
    for p in (every, decides):
        assert max(map(len, p.stdout.splitlines())) <= 100
        for line in p.stdout.splitlines():  # a table wider than the console is cut, border and all: never
            if line[:1] in "│┃┏┡└":
                assert line.rstrip()[-1] in "│┃┓┩┘", line
        assert "…" not in p.stdout
        assert not re.search(r"(?<![\w–])-\d", p.stdout), "a negative figure"
    rows = [x for x in every.stdout.splitlines() if x.startswith("│")]
    assert any("decode.overlap" in x for x in rows) and any("decode.relay" in x for x in rows)
    shown = re.search(r"(\d+) more rows .*: add --all", " ".join(decides.stdout.split()))
    assert shown and int(shown.group(1)) >= 15
    assert len([x for x in decides.stdout.splitlines() if x.startswith("│")]) < len(rows)
    assert "vLLM split:" not in decides.stdout and "TTFT p50 / p99: 95 % band" in " ".join(decides.stdout.split())
    drill = decides.stdout.split("Slowest requests", 1)[1]
    assert "  single     127.0.0.1:8200" in drill and "prefill ?" not in drill
    assert re.search(r"decode [\d,]+ compute − \d overlap ms", " ".join(drill.split()))


def test_the_waterfall_shows_the_failed_attempt_and_wraps_at_the_width():
    rid = "bench-3081828a-talk-18"  # moved off the killed decode before its first token, then re-prefilled
    for width in (80, 100):
        p = pdproxy("trace", rid, "--traces", str(KILL), columns=width)
        assert p.returncode == 0, p.stderr
        lines = p.stdout.splitlines()
        assert max(map(len, lines)) <= width
        failed = next(x for x in lines if x.startswith("  ✗ decode #1"))
        assert failed.rstrip().endswith("4,755.0") and "✗" in failed[22:]  # its bar ends in ✗ at the failure
        text = " ".join(p.stdout.split())
        assert ("attempt failed: decode #1 on 127.0.0.1:8201 at +4,807.6 ms: stream_broken (before its first "
                "token, its KV hand-off abandoned, moved to another decode)") in text  # wrapped, never cut
        assert "prefill run again on 127.0.0.1:8100, answered at +4,957.2 ms" in text
        assert sum(1 for x in lines if x.startswith("  vllm-prefill-")) == 2  # the first prefill and the re-prefill
        assert "decode 1,302.9 = compute 1,303.1 − overlap 0.2" in text
        assert not re.search(r"(?<![\w–])-\d", p.stdout)
