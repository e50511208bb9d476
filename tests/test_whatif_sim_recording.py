"""A run recorded on default `pdproxy sim` instances replays on the simulator's own timings (issue 40).

The new user's path: 1P1D of default simulated instances behind the proxy, `pdproxy bench` as the
client, then `pdproxy whatif` on the recording. The sims name their preset on their spans, so the
what-if takes it (no preset mismatch), does not fit it (the timings are the preset's), and its
self-replay of the recorded 1P1D lands within the stated error on TTFT, which the output says.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from procs import run, start_proxy, start_sim

pytestmark = pytest.mark.timeout(300)


def test_a_sim_recording_replays_on_the_preset_it_names(tmp_path: Path):
    procs = []
    try:
        pre, pre_url = start_sim("prefill", "--otlp-traces-file", str(tmp_path / "p.jsonl"))
        dec, dec_url = start_sim("decode", "--otlp-traces-file", str(tmp_path / "d.jsonl"))
        procs += [pre, dec]
        proxy, url = start_proxy("--prefill", pre_url, "--decode", dec_url, "--trace-file", str(tmp_path / "px.jsonl"))
        procs.append(proxy)
        b = run([sys.executable, "-m", "pdproxy", "bench", "--url", url, "--out", str(tmp_path / "r.jsonl"),
                 "--no-progress", "--concurrency", "6", "--duration", "8", "--prompt-len", "long", "--output-len",
                 "48", "--mode", "pd", "--prefill-count", "1", "--decode-count", "1", "--gpu-count", "2"], timeout=120)
        assert b.returncode == 0, b.stderr
    finally:
        for p in reversed(procs):
            p.stop()  # flushes the sims' spans and the proxy's trace file
    w = run([sys.executable, "-m", "pdproxy", "whatif", "--records", str(tmp_path / "r.jsonl"),
             *(f"--traces={tmp_path / f}" for f in ("px.jsonl", "p.jsonl", "d.jsonl")), "--setup", "1P1D",
             "--jobs", "1", "--json", str(tmp_path / "w.json")], timeout=180)
    assert w.returncode == 0, w.stderr
    out = w.stdout + w.stderr
    assert "preset h200-llama8b: the one the recording names" in out
    assert "not fitted to the run: the recording names the simulator's preset" in out
    replay = json.loads((tmp_path / "w.json").read_text())["whatif"]["self_replay"]
    rows = {r["figure"]: r for r in replay["rows"]}
    assert rows["completed"]["recorded"] >= 10, rows["completed"]
    for fig in ("TTFT p50", "TTFT p99"):
        assert rows[fig]["fits"] is True, rows[fig]
