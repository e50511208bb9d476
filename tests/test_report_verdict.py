"""Verdict and comparison flags of `pdproxy report`, on record files written here with known numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def write_run(path: Path, label: str, ttfts: list[float], max_gap: float, *, failures: int = 0,
              conditions: dict | None = None, prompt: str = "200") -> Path:
    """A bench record file: each ok request has 10 gaps of 5 ms and one of `max_gap`."""
    lines = [{"type": "run", "run_id": label, "label": label, "conditions": conditions or {},
              "workload": {"model": "m", "endpoint": "completions", "seed": 0, "requests": len(ttfts) + failures,
                           "classes": [{"name": "default", "prompt": prompt, "output": "12", "concurrency": 4}]}}]
    t = 1000.0
    for i, ttft in enumerate(ttfts):
        gaps = [0.005] * 10 + [max_gap]
        lines.append({"type": "request", "request_id": f"{label}-{i}", "trace_id": None, "class": "default",
                      "warmup": False, "start_time": t + i * 0.1, "start_offset": i * 0.1, "ok": True,
                      "status": 200, "error": None, "ttft": ttft, "e2e": ttft + sum(gaps),
                      "end": ttft + sum(gaps) + 0.001, "itl": gaps, "chunk_tokens": [1] * 12, "output_tokens": 12})
    for j in range(failures):
        lines.append({"type": "request", "request_id": f"{label}-f{j}", "trace_id": None, "class": "default",
                      "warmup": False, "start_time": t + j * 0.1, "start_offset": j * 0.1, "ok": False,
                      "status": 500, "error": "http_500", "ttft": None, "e2e": None, "end": 0.01, "itl": [],
                      "chunk_tokens": None, "output_tokens": None})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def report(*args: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", "--no-table", "--json", "-", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


SINGLE = {"pd.mode": "single", "gpu.count": "1", "pd.prefill.count": "0", "pd.decode.count": "1"}
CHUNKED = {**SINGLE, "vllm.enable_chunked_prefill": "true"}
PD = {"pd.mode": "pd", "gpu.count": "2", "pd.prefill.count": "1", "pd.decode.count": "1"}


@pytest.fixture()
def runs(tmp_path: Path) -> dict[str, Path]:
    return {
        "single": write_run(tmp_path / "single.jsonl", "single", [0.200 + 0.001 * i for i in range(50)], 0.150,
                            conditions=SINGLE),
        "chunked": write_run(tmp_path / "chunked.jsonl", "chunked", [0.180 + 0.001 * i for i in range(50)], 0.060,
                             conditions=CHUNKED),
        "pd_good": write_run(tmp_path / "pd.jsonl", "pd", [0.100 + 0.001 * i for i in range(50)], 0.040,
                             conditions=PD),
        "pd_slowtail": write_run(tmp_path / "pd2.jsonl", "pd", [0.100 + 0.001 * i for i in range(50)], 0.080,
                                 conditions=PD),
        "pd_errors": write_run(tmp_path / "pd3.jsonl", "pd", [0.100 + 0.001 * i for i in range(50)], 0.040,
                               failures=3, conditions=PD),
    }


def test_with_slos_a_set_up_meeting_them_beats_one_that_does_not(runs: dict[str, Path]) -> None:
    """SLOs first: pd meets the TTFT and tail ITL SLOs, single misses the tail one (150 ms > 100 ms): adopt, though
    pd holds two GPUs to single's one."""
    v = report(str(runs["single"]), str(runs["pd_good"]), "--slo-ttft-ms", "300", "--slo-tail-itl-ms", "100")["verdict"]
    assert v["candidate"] == "pd" and v["baselines"] == ["single"] and v["rule"] == "SLOs first, then goodput per GPU"
    assert v["decision"] == "adopt" and v["decided_by"] == "meets every SLO vs single"
    crit = {(c["criterion"], c["baseline"]): c["passed"] for c in v["criteria"]}
    assert crit[("TTFT p99 SLO", None)] is True and crit[("tail ITL (per-request max) p99 SLO (baseline)", "single")] \
        is False
    # TTFT p99: 0.1 + 0.001*49*0.99... recomputed by hand (linear): values 0.100..0.149, p99 = 0.14851
    ttft = next(c for c in v["criteria"] if c["criterion"] == "TTFT p99 SLO")
    assert ttft["value"] == pytest.approx(0.100 + 0.049 * 0.99 * 1.0, abs=1e-9)
    assert any("capacity" in n for n in v["notes"])


def test_where_both_meet_the_slos_goodput_per_gpu_decides(runs: dict[str, Path]) -> None:
    """pd and chunked both meet the SLOs: the same 50 requests in about the same time, on two GPUs against one, so
    chunked's goodput per GPU is about twice pd's: don't adopt (a capacity comparison, named so)."""
    r = report(str(runs["single"]), str(runs["chunked"]), str(runs["pd_good"]), "--slo-ttft-ms", "300",
               "--slo-tail-itl-ms", "100")
    v = r["verdict"]
    assert v["candidate"] == "pd" and v["baselines"] == ["single", "chunked"]
    assert v["decision"] == "don't adopt" and v["decided_by"] == "goodput per GPU vs chunked"
    good = next(c for c in v["criteria"] if c["criterion"] == "goodput per GPU")
    assert good["value"] == pytest.approx(good["limit"] / 2, rel=0.1) and "both meet every SLO" in good["detail"]
    assert r["comparison"]["resources"] == "capacity"


def test_without_slos_strict_dominance_decides(runs: dict[str, Path]) -> None:
    """At the median (50 requests do not bound a p99 from above: any larger figure lies in its band)."""
    p50 = ("--slo-percentile", "50")
    # better than single on both figures: adopt
    v = report(str(runs["single"]), str(runs["pd_slowtail"]), *p50)["verdict"]
    assert v["rule"] == "strict dominance (no SLO given)" and v["decision"] == "adopt"
    # against chunked: TTFT better (124 vs 204 ms) but tail ITL worse (80 vs 60 ms): a trade-off, not a verdict
    v = report(str(runs["single"]), str(runs["chunked"]), str(runs["pd_slowtail"]), *p50)["verdict"]
    assert v["decision"] == "trade-off"
    assert v["decided_by"] == "tail ITL (per-request max) p50 improved vs chunked"
    crit = {(c["criterion"], c["baseline"]): c["passed"] for c in v["criteria"]}
    assert crit[("tail ITL (per-request max) p50 improved", "single")] is True
    assert crit[("tail ITL (per-request max) p50 improved", "chunked")] is False
    assert crit[("TTFT p50 improved", "chunked")] is True
    assert any("give --slo-ttft-ms" in n for n in v["notes"])
    # at the p99 of 50 requests nothing is measurable: single's 249 ms lies in the band of pd's 149 ms ("≥ 148 ms")
    v = report(str(runs["single"]), str(runs["pd_slowtail"]))["verdict"]
    assert v["decision"] == "no measurable difference" and v["decided_by"] is None


def test_gates_decide_first(runs: dict[str, Path]) -> None:
    v = report(str(runs["single"]), str(runs["pd_errors"]), "--max-error-rate", "0.05")["verdict"]
    assert v["decision"] == "don't adopt" and v["decided_by"] == "error rate"
    er = v["criteria"][0]
    assert er["value"] == pytest.approx(3 / 53)
    # a KV bound without traces cannot be checked, so it cannot pass
    v = report(str(runs["single"]), str(runs["pd_good"]), "--max-kv-transfer-ms", "50")["verdict"]
    assert v["decision"] == "don't adopt" and v["decided_by"] == "KV transfer p99"
    # neither meets the TTFT SLO of 120 ms (pd's p99 148 ms, single's 249 ms): goodput per GPU decides, and pd's
    # requests under 120 ms (21 of 50, on two GPUs) beat single's none
    v = report(str(runs["single"]), str(runs["pd_good"]), "--slo-ttft-ms", "120")["verdict"]
    assert v["decision"] == "adopt" and v["decided_by"] == "goodput per GPU vs single"
    assert "neither meets every SLO" in v["reason"]


def test_one_run_alone_passes_or_fails_its_slos(runs: dict[str, Path]) -> None:
    """No baseline: the SLO flags still judge the run (before: `verdict: null`, no pass/fail)."""
    v = report(str(runs["pd_good"]), "--slo-ttft-ms", "300", "--slo-tail-itl-ms", "100")["verdict"]
    assert v["decision"] == "pass" and v["baselines"] == [] and v["resources"] == "slo"
    assert {c["criterion"]: c["passed"] for c in v["criteria"]} == {
        "error rate": True, "KV transfer p99": None, "TTFT p99 SLO": True, "tail ITL (per-request max) p99 SLO": True}
    v = report(str(runs["pd_good"]), "--slo-ttft-ms", "120")["verdict"]
    assert v["decision"] == "fail" and v["decided_by"] == "TTFT p99 SLO"
    assert report(str(runs["pd_good"]))["verdict"] is None  # nothing to judge it by
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", str(runs["pd_good"]), "--slo-ttft-ms", "120"],
                       capture_output=True, text=True, timeout=60, env={"COLUMNS": "120", "PATH": ""})
    assert p.returncode == 0 and "Verdict: FAIL  (pd) · against its SLOs, no baseline" in p.stdout, p.stdout


def test_flags_more_than_one_differing_condition(runs: dict[str, Path], tmp_path: Path) -> None:
    same = report(str(runs["single"]), str(runs["chunked"]))
    assert same["comparison"]["axes_differing"] == ["set-up"]
    assert same["comparison"]["flags"] == [] and same["comparison"]["resources"] == "same resources"
    other = write_run(tmp_path / "o.jsonl", "pd-long", [0.1] * 50, 0.04, conditions=PD, prompt="long")
    r = report(str(runs["single"]), str(other))
    assert set(r["comparison"]["axes_differing"]) == {"set-up", "prompt length"}
    assert any("differ in 2 conditions" in f for f in r["comparison"]["flags"])
    assert any("GPU totals differ" in f for f in r["comparison"]["flags"])


def test_failed_requests_are_counted_not_dropped(runs: dict[str, Path]) -> None:
    r = report(str(runs["pd_errors"]))
    req = r["runs"][0]["stats"]["requests"]
    assert (req["measured"], req["ok"], req["failed"]) == (53, 50, 3)
    assert req["errors"] == {"http_500": 3}
    assert r["runs"][0]["stats"]["ttft"]["count"] == 50
    assert [f["request_id"] for f in r["runs"][0]["failed"]] == ["pd-f0", "pd-f1", "pd-f2"]


def test_report_errors_are_clear(tmp_path: Path) -> None:
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"hello": 1}\n')
    for args in ([str(junk)], [str(tmp_path / "nope.jsonl")], [str(junk), "--traces", str(junk)]):
        p = subprocess.run([sys.executable, "-m", "pdproxy", "report", *args], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2 and "pdproxy report:" in p.stderr and "Traceback" not in p.stderr, p.stderr


DP = {"pd.mode": "single", "gpu.count": "2", "pd.prefill.count": "0", "pd.decode.count": "2"}


def test_same_resources_verdict_comes_first_and_capacity_separately(runs: dict[str, Path], tmp_path: Path) -> None:
    # two single instances behind the proxy on pd's 2 GPUs, against pd; then the 1-GPU set-ups
    dp = write_run(tmp_path / "dp.jsonl", "dp", [0.090 + 0.001 * i for i in range(50)], 0.050, conditions=DP)
    r = report(str(runs["single"]), str(runs["chunked"]), str(dp), str(runs["pd_good"]), "--slo-percentile", "50")
    same, capacity = r["verdicts"]
    assert r["verdict"] == same and same["resources"] == "same resources" and same["baselines"] == ["dp"]
    assert same["resources_text"] == "same resources: 2 GPUs each"
    # on the same 2 GPUs pd's TTFT is worse than dp's (124.5 against 114.5 ms, outside each other's band) and its
    # tail ITL better (40 against 50 ms): without SLOs, a trade-off
    assert same["decision"] == "trade-off" and same["decided_by"] == "TTFT p50 improved vs dp"
    # ... while against the 1-GPU set-ups, with added resources, it wins: a capacity comparison, named so
    assert capacity["resources"] == "capacity" and capacity["baselines"] == ["single", "chunked"]
    assert capacity["decision"] == "adopt" and capacity["resources_text"].startswith("capacity comparison")
    assert r["comparison"]["resources"] == "same resources and capacity"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", str(runs["single"]), str(dp), str(runs["pd_good"])],
                       capture_output=True, text=True, timeout=60, env={**__import__("os").environ, "COLUMNS": "200"})
    lines = [x for x in p.stdout.splitlines() if x.startswith("Verdict:")]
    assert len(lines) == 2 and "same resources" in lines[0] and "capacity comparison" in lines[1], p.stdout


def test_requested_vs_actual_lengths_per_class_and_the_off_class_flagged(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r.jsonl", "pd", [0.1] * 20, 0.04, conditions=PD)
    lines = [json.loads(x) for x in run.read_text().splitlines()]
    for i, x in enumerate(lines[1:]):  # the server counted 8 % more prompt tokens than asked; outputs exact
        x.update(prompt_tokens_requested=1000, prompt_tokens=1080 + i % 3, max_tokens=12)
    run.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    r = report(str(run))
    lengths = r["runs"][0]["stats"]["lengths"]["default"]
    assert lengths["prompt"] == {"requested": 1000.0, "actual": 1081.0, "off": pytest.approx(0.081), "flagged": True}
    assert lengths["output"]["flagged"] is False and lengths["output"]["off"] == 0.0
    assert r["runs"][0]["length_flags"] == ["class default: prompt tokens 1081 at the median, 1000 asked (+8.1%)"]
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", str(run)], capture_output=True, text=True,
                       timeout=60)
    text = " ".join(p.stdout.split())
    assert "1000 → 1081 (off)" in text and "FLAG: pd: class default: prompt tokens 1081" in text


def test_a_difference_inside_either_runs_band_is_no_measurable_difference(tmp_path):
    """200 requests of one TTFT distribution against the same drawn again 3 % faster: the p50 lies inside the other
    run's 95 % band, so it is no measurable difference and decides nothing (the table shows the bands); against a
    run twice as fast, it is one."""
    import numpy as np

    rng = np.random.default_rng(5)
    base = rng.lognormal(np.log(0.2), 0.4, 200)
    single = write_run(tmp_path / "s.jsonl", "single", list(base), 0.05, conditions=SINGLE)
    near = write_run(tmp_path / "n.jsonl", "near", list(rng.lognormal(np.log(0.194), 0.4, 200)), 0.05,
                     conditions=SINGLE)
    far = write_run(tmp_path / "f.jsonl", "far", list(rng.lognormal(np.log(0.1), 0.4, 200)), 0.05, conditions=SINGLE)
    for cand, noted in (("near", True), ("far", False)):
        rep = report(str(single), str(near if cand == "near" else far), "--candidate", cand, "--baseline", "single",
                     "--slo-percentile", "50")
        ttft = next(c for c in rep["verdicts"][0]["criteria"] if c["criterion"] == "TTFT p50 improved")
        assert ttft["passed"] is (None if noted else True), ttft
        assert ("no measurable difference (inside either run's 95 % band)" in ttft["detail"]) is noted, ttft
        for e in rep["runs"]:
            lo, hi = e["stats"]["bands"]["ttft"]["p50"]
            assert lo < e["stats"]["ttft"]["p50"] < hi
            assert e["stats"]["bands"]["ttft"]["p99"][1] is None  # 200 requests do not bound a p99 from above
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", str(single), str(near)], capture_output=True,
                       text=True, timeout=60, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert "TTFT p50 / p99: 95 % band" in p.stdout and "per-request max p50 / p99: 95 % band" in p.stdout, p.stdout
