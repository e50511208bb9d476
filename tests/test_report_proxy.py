"""Bench through pdproxy in three set-ups (single, chunked prefill, P/D) and check the report.

Everything is a real process on loopback: simulated instances, the proxy writing OTLP-JSON trace
files, `pdproxy bench` and `pdproxy report` as commands. Every number the report prints for these
runs is recomputed here from the record and trace files with plain numpy, and the join is checked
against the trace files read independently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from procs import start_proxy, start_sim

WORKLOAD = """
requests: 34
warmup_requests: 4
seed: 2
classes:
  - {name: stream, prompt: 40-80, output: 10-16, concurrency: 3}
  - {name: long, prompt: 1500, output: 4, rate: 5}
"""
SETUPS = {
    "single": {"sims": [("single", ["--max-num-batched-tokens", "16384"])], "gpus": 1},
    "chunked": {"sims": [("single", ["--max-num-batched-tokens", "512", "--enable-chunked-prefill"])], "gpus": 1},
    # some prefill failures, not retried, so the P/D run has errors with a failed stage in its traces
    "pd": {"sims": [("prefill", ["--error-rate", "0.12", "--error-status", "503", "--seed", "11"]), ("decode", [])],
           "gpus": 2},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    d = tmp_path_factory.mktemp("runs")
    (d / "w.yaml").write_text(WORKLOAD)
    out: dict[str, dict[str, Path]] = {}
    for name, setup in SETUPS.items():
        procs = []
        try:
            urls = {}
            for role, flags in setup["sims"]:
                proc, url = start_sim(role, "--time-scale", "0.5", *flags)
                procs.append(proc)
                urls[role] = url
            trace = d / f"traces-{name}.jsonl"
            args = ["--trace-file", str(trace), "--run-label", name, "--gpu-count", str(setup["gpus"]),
                    "--prefill-retries", "0", "--eject-after-failures", "1000"]
            if "prefill" in urls:
                args += ["--prefill", urls["prefill"], "--decode", urls["decode"]]
            else:
                args += ["--decode", urls["single"]]
            proxy, purl = start_proxy(*args)
            procs.append(proxy)
            rec = d / f"{name}.jsonl"
            p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", purl, "--workload", str(d / "w.yaml"),
                                "--label", name, "--out", str(rec), "--no-progress", "--quiet"],
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, p.stderr
        finally:
            for proc in reversed(procs):
                proc.stop()  # the proxy flushes its trace file when it stops
        out[name] = {"records": rec, "traces": trace}
    return out


def records(path: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return lines[0], [x for x in lines if x["type"] == "request"]


def trace_spans(path: Path) -> list[dict]:
    """All spans of an OTLP-JSON lines file, with attributes flattened (written independently of the report)."""
    spans = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            res = {a["key"]: next(iter(a["value"].values())) for a in rs["resource"].get("attributes", [])}
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    attrs = {a["key"]: next(iter(a["value"].values())) for a in sp.get("attributes", [])}
                    spans.append({**sp, "attrs": attrs, "res": res,
                                  "dur": (int(sp["endTimeUnixNano"]) - int(sp["startTimeUnixNano"])) / 1e9})
    return spans


def token_gaps(r: dict) -> list[float]:
    out = []
    for gap, k in zip(r["itl"], r["chunk_tokens"][1:]):
        out += [gap / k] * k
    return out


@pytest.fixture(scope="module")
def rep(runs: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("rep")
    args = [str(runs[n]["records"]) for n in SETUPS]
    for n in SETUPS:
        args += ["--traces", str(runs[n]["traces"])]
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", *args, "--json", str(d / "r.json"),
                        "--html", str(d / "r.html")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Verdict:" in p.stdout and "Slowest requests" in p.stdout  # the terminal table was printed
    return json.loads((d / "r.json").read_text())


def test_numbers_match_an_independent_recomputation(runs: dict, rep: dict) -> None:
    assert [e["label"] for e in rep["runs"]] == list(SETUPS)
    for e in rep["runs"]:
        _, reqs = records(runs[e["label"]]["records"])
        measured = [r for r in reqs if not r["warmup"]]
        ok = [r for r in measured if r["ok"]]
        st = e["stats"]
        assert st["requests"]["measured"] == len(measured) == 30
        assert st["requests"]["failed"] == len(measured) - len(ok)
        assert st["requests"]["error_rate"] == pytest.approx((len(measured) - len(ok)) / len(measured))
        assert st["itl"]["unit"] == "token"
        ttft = [r["ttft"] for r in ok]
        gaps = [g for r in ok for g in token_gaps(r)]
        maxes = [max(token_gaps(r)) for r in ok if r["itl"]]
        p99s = [np.percentile(token_gaps(r), 99) for r in ok if r["itl"]]
        for p in (50, 90, 99):
            assert st["ttft"][f"p{p}"] == pytest.approx(np.percentile(ttft, p)), e["label"]
            assert st["itl"][f"p{p}"] == pytest.approx(np.percentile(gaps, p)), e["label"]
            assert st["tail_itl"]["per_request_max"][f"p{p}"] == pytest.approx(np.percentile(maxes, p))
            assert st["tail_itl"]["per_request_p99"][f"p{p}"] == pytest.approx(np.percentile(p99s, p))
        long_ttft = [r["ttft"] for r in ok if r["class"] == "long"]
        assert st["classes"]["long"]["ttft"]["p50"] == pytest.approx(np.percentile(long_ttft, 50))
        assert st["stalls"]["requests"] == sum(m > 0.1 for m in maxes)
        window = max(r["start_time"] + r["end"] for r in measured) - min(r["start_time"] for r in measured)
        assert st["throughput"]["output_tokens_per_s"] == pytest.approx(sum(r["output_tokens"] for r in ok) / window)
        assert st["throughput"]["requests_per_s"] == pytest.approx(len(ok) / window)
        top = sorted(ok, key=lambda r: r["ttft"], reverse=True)[:5]
        assert [x["request_id"] for x in e["slowest"]["ttft"]] == [r["request_id"] for r in top]


def test_join_by_request_id_and_trace_contents(runs: dict, rep: dict) -> None:
    for e in rep["runs"]:
        _, reqs = records(runs[e["label"]]["records"])
        spans = trace_spans(runs[e["label"]]["traces"])
        roots = {s["attrs"]["pd.request_id"]: s for s in spans if "pd.request_id" in s["attrs"]}
        assert e["traces"] == {"records": len(reqs), "joined": len(reqs), "records_without_trace": 0,
                               "trace_id_mismatch": 0}
        assert set(roots) == {r["request_id"] for r in reqs}
        for r in reqs:
            root = roots[r["request_id"]]
            assert root["traceId"] == r["trace_id"]  # the bench's traceparent was continued
            if r["ok"]:  # the client sees the first token after the proxy does, and not much later
                proxy_ttft = root["attrs"]["gen_ai.response.time_to_first_chunk"]
                assert proxy_ttft - 0.002 <= r["ttft"] <= proxy_ttft + 0.1, r["request_id"]
        for x in e["slowest"]["ttft"] + e["slowest"]["tail_itl"]:
            assert x["trace_id"] == roots[x["request_id"]]["traceId"] and x["stages"]
        # conditions completed from the trace resource attributes
        assert str(e["conditions"]["gpu.count"]) == str(SETUPS[e["label"]]["gpus"])
        assert e["condition_sources"]["gpu.count"] == "trace"
        assert e["mode"] == ("pd" if e["label"] == "pd" else "single")


def test_kv_transfer_and_stages_from_the_traces(runs: dict, rep: dict) -> None:
    by = {e["label"]: e for e in rep["runs"]}
    assert by["single"]["kv_transfer"] is None and by["chunked"]["kv_transfer"] is None
    _, reqs = records(runs["pd"]["records"])
    ok_ids = {r["request_id"] for r in reqs if r["ok"] and not r["warmup"]}
    spans = trace_spans(runs["pd"]["traces"])
    root_of = {s["spanId"]: s["attrs"]["pd.request_id"] for s in spans if "pd.request_id" in s["attrs"]}
    kv = [s for s in spans if s["name"] == "pd.kv_transfer" and root_of.get(s.get("parentSpanId")) in ok_ids]
    assert len(kv) == len(ok_ids)
    got = by["pd"]["kv_transfer"]
    assert "upper bound" in got["definition"]
    for p in (50, 90, 99):
        assert got["upper_bound"][f"p{p}"] == pytest.approx(np.percentile([s["dur"] for s in kv], p))
    est = [s["attrs"]["pd.kv_transfer.estimated"] for s in kv if "pd.kv_transfer.estimated" in s["attrs"]]
    assert got["estimated"]["count"] == len(est)
    if est:
        assert got["estimated"]["p50"] == pytest.approx(np.percentile(est, 50))
    prefill = [s["dur"] for s in spans if s["name"] == "pd.prefill" and root_of.get(s.get("parentSpanId")) in ok_ids]
    assert by["pd"]["stages"]["prefill"]["p50"] == pytest.approx(np.percentile(prefill, 50))


def test_errors_through_the_proxy_are_counted_with_the_failed_stage(runs: dict, rep: dict) -> None:
    e = next(x for x in rep["runs"] if x["label"] == "pd")
    _, reqs = records(runs["pd"]["records"])
    failed = [r for r in reqs if not r["warmup"] and not r["ok"]]
    assert failed, "the prefill instance injects 503s: some requests must fail"
    reasons: dict[str, int] = {}
    for r in failed:
        reasons[r["error"]] = reasons.get(r["error"], 0) + 1
    assert e["stats"]["requests"]["errors"] == reasons
    assert {x["request_id"] for x in e["failed"]} <= {r["request_id"] for r in failed}
    assert all(x["failed_stage"] == "prefill" and x["trace_id"] for x in e["failed"])


def test_verdict_on_real_runs(runs: dict, rep: dict) -> None:
    v = rep["verdict"]
    assert v["candidate"] == "pd" and v["baselines"] == ["single", "chunked"]
    er = rep["runs"][2]["stats"]["requests"]["error_rate"]
    assert er > 0.01
    # recomputed: the injected prefill errors exceed the default 1 % bound, which decides first
    assert v["decision"] == "don't adopt" and v["decided_by"] == "error rate"
    assert rep["comparison"]["resources"] == "capacity"
    assert any("GPU totals differ" in f for f in rep["comparison"]["flags"])
    assert rep["comparison"]["axes_differing"] == ["set-up"]
