"""Smoke run of the overhead benchmark's machinery (upstreams, load generator, OTLP sink, report):
tiny phases, direct and pdproxy only; the speed figures themselves live in benchmarks/RESULTS.md."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "overhead.py"


def test_overhead_benchmark_smoke(tmp_path):
    out = tmp_path / "raw.json"
    args = [sys.executable, str(BENCH), "--targets", "direct", "pdproxy", "--hold-targets", "pdproxy",
            "--duration", "0.5", "--latency-duration", "0.5", "--warmup", "0.3", "--rounds", "1",
            "--quiet-timeout", "0", "--concurrency", "1", "8", "--sat-concurrency", "16", "--sat-tokens", "64",
            "--latency-tokens", "8", "--hold-streams", "50", "--hold-ramp", "0.2", "--hold-tokens", "3",
            "--hold-itl-ms", "100", "--no-pin", "--work-dir", str(tmp_path), "--json", str(out)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "| pdproxy |" in run.stdout and "Ratios and targets:" in run.stdout
    raw = json.loads(out.read_text())
    for target in ("direct", "pdproxy"):
        for phase in ("sat_chunks", "sat_requests", "lat_1", "lat_8"):
            assert raw[target][phase]["errors"] == 0 and raw[target][phase]["requests"] > 0, (target, phase)
    assert raw["pdproxy"]["lat_8"]["ttft_us"] and raw["pdproxy"]["lat_8"]["gaps_us"]
    hold = raw["pdproxy"]["hold"]
    assert hold["max_open_streams"] == 50 and hold["requests"] == 50 and hold["errors"] == 0
    spans = raw["pdproxy"]["spans_received"]
    assert spans["bad"] == 0 and spans["spans"] >= 5 * raw["pdproxy"]["sat_requests"]["requests"]
