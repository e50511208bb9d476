"""Primary vs shadow from the proxy's traces alone: `pdproxy report --traces F --by-deployment`.

Real processes on loopback: a simulated P/D pair behind `pdproxy serve`, which mirrors a sampled
share of the requests to a simulated single instance (`--shadow-url`) whose first answers are
injected 500s, and writes its traces to a file; `pdproxy bench` drives the load. The report is
built from the trace file only, and every number it gives is recomputed here from the file with
plain JSON parsing and numpy (linear percentiles).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from pdproxy.bench import table
from procs import start_proxy, start_sim
from waits import scaled

REQUESTS = 30
SHADOW_FAULTS = 3


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.split()[-1])
    return total


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("shadow")
    trace = d / "traces.jsonl"
    procs = []
    try:
        prefill, purl = start_sim("prefill", "--time-scale", "0.5")
        decode, durl = start_sim("decode", "--time-scale", "0.5")
        single, surl = start_sim("single", "--time-scale", "0.5")
        procs += [prefill, decode, single]
        r = httpx.post(surl + "/sim/faults", json={"faults": [{"kind": "error", "status": 500,
                                                               "times": SHADOW_FAULTS}]})
        assert r.status_code == 200, r.text
        # no decode retry, so each injected 500 fails exactly one shadow request
        proxy, url = start_proxy("--prefill", purl, "--decode", durl, "--shadow-url", surl,
                                 "--shadow-sample-rate", "0.7", "--trace-file", str(trace),
                                 "--resource-attr", "gpu.count=2", "--decode-retries", "0",
                                 "--eject-after-failures", "0", "--health-check-interval", "0")
        procs.append(proxy)
        rec = d / "bench.jsonl"
        p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", url, "--requests", str(REQUESTS),
                            "--concurrency", "3", "--prompt-len", "40-400", "--output-len", "6-16", "--seed", "5",
                            "--out", str(rec), "--no-progress", "--quiet"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        deadline = time.monotonic() + scaled(10)  # mirrored copies finish in the background
        while time.monotonic() < deadline:
            sent = metric(url, "pdproxy_shadow_requests_total", outcome="sent")
            if metric(url, "pdproxy_requests_total", deployment="shadow") == sent:
                break
            time.sleep(0.05)
        counts = {k: metric(url, "pdproxy_shadow_requests_total", outcome=k) for k in ("sent", "sampled_out")}
    finally:
        for proc in reversed(procs):
            proc.stop()  # the proxy flushes its trace file when it stops
    bench_ids = [json.loads(x)["request_id"] for x in rec.read_text().splitlines()
                 if json.loads(x)["type"] == "request"]
    return {"dir": d, "trace": trace, "bench_ids": bench_ids, "shadow_counts": counts}


def report(served: dict, *extra: str) -> tuple[dict, str]:
    out = served["dir"] / f"report-{len(extra)}.json"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", "--traces", str(served["trace"]), "--by-deployment",
                        "--shadow-condition", "gpu.count=1", "--json", str(out), *extra],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(out.read_text()), p.stdout


def roots_and_stages(path: Path) -> tuple[dict[str, dict[str, dict]], dict[str, dict[str, dict]]]:
    """Root spans by deployment and request id, and their stage spans by name (read independently)."""
    spans = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    a = {x["key"]: next(iter(x["value"].values())) for x in sp.get("attributes", [])}
                    spans.append({**sp, "a": a, "start": int(sp["startTimeUnixNano"]) / 1e9,
                                  "dur": (int(sp["endTimeUnixNano"]) - int(sp["startTimeUnixNano"])) / 1e9})
    roots: dict[str, dict[str, dict]] = {"primary": {}, "shadow": {}}
    by_id = {}
    for s in spans:
        if "pd.request_id" in s["a"] and not s["name"].startswith("pd."):
            roots[s["a"]["pd.deployment"]][s["a"]["pd.request_id"]] = s
            by_id[s["spanId"]] = s
    stages: dict[str, dict[str, dict]] = {"primary": {}, "shadow": {}}
    for s in spans:
        parent = by_id.get(s.get("parentSpanId"))
        if s["name"].startswith("pd.") and parent is not None:
            key = (parent["a"]["pd.deployment"], parent["a"]["pd.request_id"])
            stages[key[0]].setdefault(key[1], {})[s["name"][3:]] = s
    return roots, stages


def f(x: object) -> float:
    return float(x)  # OTLP-JSON carries int64 as strings


def test_pairing_counts(served: dict) -> None:
    rep, out = report(served)
    roots, _ = roots_and_stages(served["trace"])
    primary, shadow = set(roots["primary"]), set(roots["shadow"])
    assert primary == set(served["bench_ids"])  # every request the client sent has its primary root
    assert rep["pairing"]["paired"] == len(primary & shadow) == served["shadow_counts"]["sent"]
    assert rep["pairing"]["primary_only"] == len(primary - shadow) == served["shadow_counts"]["sampled_out"]
    assert rep["pairing"]["shadow_only"] == len(shadow - primary) == 0
    assert 0 < rep["pairing"]["primary_only"] < REQUESTS
    assert f"unpaired, left out: {len(primary - shadow)} primary only, 0 shadow only" in " ".join(out.split())
    assert [e["label"] for e in rep["runs"]] == ["primary", "shadow"]
    for e in rep["runs"]:
        assert e["traces"]["joined"] == e["traces"]["records"] == len(primary & shadow)
        assert e["measured_at"] == "proxy" and "proxy-side" in e["tool"]


def test_numbers_match_an_independent_recomputation(served: dict) -> None:
    rep, out = report(served, "--all")
    roots, stages = roots_and_stages(served["trace"])
    paired = set(roots["primary"]) & set(roots["shadow"])
    by = {e["label"]: e for e in rep["runs"]}
    for dep in ("primary", "shadow"):
        st = by[dep]["stats"]
        mine = [roots[dep][rid] for rid in paired]
        ok = [s for s in mine if "error.type" not in s["a"]]
        failed = [s for s in mine if "error.type" in s["a"]]
        assert st["requests"]["measured"] == len(paired)
        assert st["requests"]["failed"] == len(failed)
        assert st["requests"]["error_rate"] == pytest.approx(len(failed) / len(paired))
        reasons: dict[str, int] = {}
        for s in failed:
            reasons[s["a"]["error.type"]] = reasons.get(s["a"]["error.type"], 0) + 1
        assert st["requests"]["errors"] == reasons
        assert st["itl"]["unit"] == "token" and st["itl"]["count"] == 0 and st["itl"]["available"] is False
        ttft = [s["a"]["gen_ai.response.time_to_first_chunk"] for s in ok]
        maxes = [s["a"]["pd.itl.max"] for s in ok if "pd.itl.max" in s["a"]]
        p99s = [s["a"]["pd.itl.p99"] for s in ok if "pd.itl.p99" in s["a"]]
        e2e = [s["a"]["pd.e2e"] for s in ok]
        tpot = [s["a"]["pd.tpot"] for s in ok if "pd.tpot" in s["a"]]
        assert len(maxes) == len(ok) > 0
        for p in (50, 90, 99):
            assert st["ttft"][f"p{p}"] == pytest.approx(np.percentile(ttft, p)), dep
            assert st["tail_itl"]["per_request_max"][f"p{p}"] == pytest.approx(np.percentile(maxes, p)), dep
            assert st["tail_itl"]["per_request_p99"][f"p{p}"] == pytest.approx(np.percentile(p99s, p)), dep
            assert st["e2e"][f"p{p}"] == pytest.approx(np.percentile(e2e, p)), dep
            assert st["tpot"][f"p{p}"] == pytest.approx(np.percentile(tpot, p)), dep
        assert st["stalls"]["requests"] == sum(m > 0.1 for m in maxes)
        window = max(s["start"] + s["dur"] for s in mine) - min(s["start"] for s in mine)
        tokens = sum(int(s["a"]["gen_ai.usage.output_tokens"]) for s in ok)
        assert st["throughput"]["output_tokens_per_s"] == pytest.approx(tokens / window)
        prefill = [stages[dep][s["a"]["pd.request_id"]]["prefill"]["dur"] for s in ok]
        assert by[dep]["stages"]["prefill"]["p50"] == pytest.approx(np.percentile(prefill, 50))
    kv = [stages["primary"][rid]["kv_transfer"] for rid in paired if "error.type" not in roots["primary"][rid]["a"]]
    got = by["primary"]["kv_transfer"]
    assert "upper bound" in got["definition"] and by["shadow"]["kv_transfer"] is None
    for p in (50, 90, 99):
        assert got["upper_bound"][f"p{p}"] == pytest.approx(np.percentile([s["dur"] for s in kv], p))
        assert got["estimated"][f"p{p}"] == pytest.approx(
            np.percentile([s["a"]["pd.kv_transfer.estimated"] for s in kv], p))
    assert "n/a: not in traces" in out  # pooled ITL is said to be missing, not invented


def test_failed_shadow_requests_are_counted(served: dict) -> None:
    rep, _ = report(served)
    shadow = next(e for e in rep["runs"] if e["label"] == "shadow")
    primary = next(e for e in rep["runs"] if e["label"] == "primary")
    assert shadow["stats"]["requests"]["failed"] == SHADOW_FAULTS  # the injected 500s, one shadow request each
    assert shadow["stats"]["requests"]["errors"] == {"upstream_5xx": SHADOW_FAULTS}
    # the shadow's failures never reach the primary (nor does a client closing right after [DONE] count)
    assert primary["stats"]["requests"]["errors"] == {}, primary["failed"]
    assert len(shadow["failed"]) == SHADOW_FAULTS
    assert all(x["failed_stage"] == "prefill" and x["trace_id"] for x in shadow["failed"])  # single: one leg
    v = rep["verdict"]
    assert v["candidate"] == "primary" and v["baselines"] == ["shadow"]
    assert v["criteria"][0]["criterion"] == "error rate"
    assert v["criteria"][0]["value"] == primary["stats"]["requests"]["error_rate"]  # the candidate's, not the shadow's


def test_conditions_warmup_and_candidate(served: dict) -> None:
    rep, _ = report(served, "--warmup-requests", "4", "--candidate", "shadow", "--html",
                    str(served["dir"] / "r.html"))
    roots, _ = roots_and_stages(served["trace"])
    paired = sorted(set(roots["primary"]) & set(roots["shadow"]), key=lambda r: roots["primary"][r]["start"])
    measured = paired[4:]
    by = {e["label"]: e for e in rep["runs"]}
    for dep in ("primary", "shadow"):
        ok = [roots[dep][r] for r in measured if "error.type" not in roots[dep][r]["a"]]
        st = by[dep]["stats"]
        assert st["requests"]["warmup"] == 4 and st["requests"]["measured"] == len(measured)
        assert st["ttft"]["p50"] == pytest.approx(
            np.percentile([s["a"]["gen_ai.response.time_to_first_chunk"] for s in ok], 50))
    assert rep["pairing"]["warmup"] == 4
    assert rep["verdict"]["candidate"] == "shadow" and rep["verdict"]["baselines"] == ["primary"]
    # fixed conditions: the primary's from the proxy's resource, the shadow's from its roots and the flag
    assert by["primary"]["conditions"]["pd.mode"] == "pd" and str(by["primary"]["conditions"]["gpu.count"]) == "2"
    assert by["primary"]["condition_sources"]["gpu.count"] == "trace"
    sc = by["shadow"]["conditions"]
    assert sc["pd.mode"] == "single" and sc["gpu.count"] == "1" and sc["pd.decode.count"] == 1
    assert sc["pd.prefill.count"] == 0 and by["shadow"]["condition_sources"]["gpu.count"] == "--shadow-condition"
    assert rep["comparison"]["resources"] == "capacity"
    page = (served["dir"] / "r.html").read_text()
    assert "measured at the proxy" in page and "Paired by request id" in page


def test_by_deployment_needs_traces_only(served: dict) -> None:
    for args, msg in ((["--by-deployment"], "needs --traces"),
                      (["x.jsonl", "--traces", str(served["trace"]), "--by-deployment"], "give no record files"),
                      ([], "--by-deployment")):
        p = subprocess.run([sys.executable, "-m", "pdproxy", "report", *args], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2 and msg in " ".join(p.stderr.split()), (args, p.stderr)  # rich wraps lines


def test_each_deployments_throughput_is_over_its_own_requests(served: dict) -> None:
    """The primary served every request and the shadow the sampled ones: each one's throughput is over its own
    (not only the paired ones), with how many it served and how many were paired."""
    rep, out = report(served)
    roots, _ = roots_and_stages(served["trace"])
    paired = len(set(roots["primary"]) & set(roots["shadow"]))
    cells = dict(zip([e["label"] for e in rep["runs"]], dict(table.metric_rows(rep))["throughput, output tokens/s"]))
    for e in rep["runs"]:
        mine = list(roots[e["deployment"]].values())
        ok = [s for s in mine if "error.type" not in s["a"]]
        tokens = sum(int(s["a"]["gen_ai.usage.output_tokens"]) for s in ok)
        window = max(s["start"] + s["dur"] for s in mine) - min(s["start"] for s in mine)
        own = e["own_throughput"]
        assert own["requests"] == len(mine) and own["ok"] == len(ok), e["label"]
        assert own["output_tokens_per_s"] == pytest.approx(tokens / window, rel=1e-6), e["label"]
        assert f"{own['output_tokens_per_s']:.1f} ({len(mine)} req)" in cells[e["label"]]
    assert rep["runs"][0]["own_throughput"]["requests"] == REQUESTS > paired  # primary: every request
    assert rep["runs"][1]["own_throughput"]["requests"] == paired  # the shadow's failures served too
    text = " ".join(out.split())
    assert f"Paired by request id: {paired} requests traced by both deployments" in text
    assert "throughput, output tokens/s" in text



def test_live_traffic_report_of_both_deployments_with_their_errors(served: dict) -> None:
    """Without --by-deployment: each deployment over all its own requests, unpaired, with its errors listed."""
    out = served["dir"] / "traffic.json"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", "--traces", str(served["trace"]), "--json",
                        str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    roots, _ = roots_and_stages(served["trace"])
    by = {e["deployment"]: e for e in rep["runs"]}
    assert [e["label"] for e in rep["runs"]] == ["primary", "shadow"] and rep["verdict"] is None
    for dep in ("primary", "shadow"):
        assert by[dep]["stats"]["requests"]["measured"] == len(roots[dep])
    shadow = by["shadow"]
    assert shadow["stats"]["requests"]["errors"] == {"upstream_5xx": SHADOW_FAULTS}
    assert len(shadow["failed"]) == SHADOW_FAULTS and all(f["trace_id"] for f in shadow["failed"])
    text = " ".join(p.stdout.split())
    assert "upstream_5xx: 3" in text and "shadow · failed" in text and "injected fault" in text
    assert "Paired by request id" not in text
