"""`pdproxy whatif --calibrate`: the model's curves fitted from recorded vLLM spans, printed with residuals, used."""

from __future__ import annotations

import json
from pathlib import Path

from pdproxy.sim.presets import PRESETS
from pdproxy.whatif import calibrate
from test_whatif_cli import FIX, PD_RECORDS, RUN_A, whatif

V = Path(__file__).parent / "fixtures" / "vllm023"


def test_fit_recovers_the_two_gpu_measurements():
    """The 2-GPU recording's spans give back what real-vllm-h200.md measured one request at a time: a ~4.8 ms
    decode step, ~100 ms of compute for a 4.5k-token prompt, and NIXL between GPUs at ~10 GB/s."""
    cal = calibrate.fit_files([str(V / "vllm023-pd-2gpu.otlp.jsonl.gz")], PRESETS["h200-llama8b"])
    p = cal.preset
    assert p.name == "h200-llama8b+calibrated"
    from pdproxy.sim.timing import PiecewiseLinear

    assert 4.3 < PiecewiseLinear(p.decode_step_ms)(1) < 5.3
    prefill_4k = PiecewiseLinear(p.prefill_extra_ms)(4096) + PiecewiseLinear(p.decode_step_ms)(1)
    assert 70 < prefill_4k < 110, prefill_4k  # the measured lone 4096-token TTFT is 110 ms, API server included
    assert 7 < p.kv_bandwidth_gbps < 15, p.kv_bandwidth_gbps  # the shipped 1-GPU preset's link: 0.341 GB/s
    kv = next(f for f in cal.fits if f.name == "KV transfer")
    assert kv.spans == 471 and len(kv.residuals) >= 3


def test_calibrate_prints_the_fit_and_predicts_with_it(tmp_path):
    out = tmp_path / "w.json"
    r = whatif("--records", str(PD_RECORDS), *RUN_A, "--setup", "2P2D", "--setup", "4xsingle", "--calibrate",
               "--traces", str(FIX / "pd-a.jsonl.gz"), "--traces", str(FIX / "vllm-spans.otlp.jsonl.gz"),
               "--json", str(out), "--no-table")
    assert r.returncode == 0, r.stderr
    assert "Calibration from the recorded spans" in r.stderr and "residual" in r.stderr
    rep = json.loads(out.read_text())
    cal = rep["whatif"]["calibration"]
    assert cal["preset"] == "h200-llama8b+calibrated"
    assert {f["name"] for f in cal["fits"]} == {"prefill", "decode step", "KV transfer"}
    # the shared H200's prefill is slower than the preset's own GPU: the calibrated model predicts a slower TTFT
    plain = json.loads(whatif("--records", str(PD_RECORDS), *RUN_A, "--setup", "4xsingle", "--json", "-",
                              "--no-table").stdout)
    ttft = {e["label"]: e["stats"]["ttft"]["p50"] for e in rep["runs"]}
    before = {e["label"]: e["stats"]["ttft"]["p50"] for e in plain["runs"]}
    # (1.29x since the clients keep their recorded phase: fewer prefills land in one step than when all start at 0)
    assert ttft["4xsingle"] > 1.2 * before["4xsingle"], (ttft, before)


def test_calibrate_without_spans_is_a_clear_error():
    r = whatif("--records", str(PD_RECORDS), *RUN_A, "--calibrate")
    assert r.returncode == 2 and "give the trace files" in r.stderr


def test_calibrate_on_proxy_spans_alone_says_so():
    """No vLLM spans: the fit falls back to pdproxy's stages and says it is the less precise one."""
    r = whatif("--records", str(PD_RECORDS), *RUN_A, "--setup", "4xsingle", "--calibrate", "--no-table",
               "--traces", str(FIX / "pd-a.jsonl.gz"), "--traces", str(FIX / "pd-dp.jsonl.gz"))
    assert r.returncode == 0, r.stderr
    err = r.stderr.replace("\n", " ")
    assert "no vLLM llm_request spans: fitted on pdproxy's own stage spans" in err
    assert "prefill:" in err and "decode step:" in err and "KV transfer:" in err and "residual" in err
