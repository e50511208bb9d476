"""Several recordings of one cluster, one fitted model, and the leave-one-out error it states (issue 56).

* `--records` repeated: one parameter set is fitted to every recording, each recording's self-replay is printed,
  and each is predicted by the model fitted to the others; the largest of those misses, per figure, is the error the
  prediction states (not the in-sample fit, which saw every run).
* Each parameter is fitted on the recordings that show its mechanism, and named unfitted where none does.
* vLLM's own spread, which a replay's miss is judged against, is the three repeats' (real-repeats-2026-12-07).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pdproxy.bench import records, report as bench_report
from pdproxy.sim.presets import PRESETS
from pdproxy.whatif import fitrun, loo, predict, setups
from pdproxy.whatif.workload import ClassPlan, Request, Workload

pytestmark = pytest.mark.timeout(200)

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
V = FIX / "vllm023"
REPEATS = FIX / "real-repeats-2026-12-07"


def test_two_records_one_fit_each_replayed_and_each_predicted_from_the_other(tmp_path):
    """vllm023 on one H200: its 1P1D and its decode alone (warm from the 1P1D before it)."""
    out = tmp_path / "w.json"
    r = subprocess.run([sys.executable, "-m", "pdproxy", "whatif", "--records", str(V / "bench-1gpu-pd.jsonl.gz"),
                        "--records", str(V / "bench-1gpu-single.jsonl.gz"),
                        "--warm-from", f"bench-1gpu-single.jsonl.gz={V / 'bench-1gpu-pd.jsonl.gz'}",
                        "--traces", str(V / "vllm023-pd-1gpu.otlp.jsonl.gz"), "--setup", "1P1D", "--no-table",
                        "--json", str(out)], capture_output=True, text=True, timeout=180,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    text = r.stdout + r.stderr
    assert "Fitted to 2 recordings of the cluster (pd, single" in " ".join(text.split())
    rep = json.loads(out.read_text())
    w = rep["whatif"]
    assert w["fit_run"]["recordings"] == ["pd", "single"]
    # each recording's self-replay: the first's in the report, the other's beside it
    assert w["self_replay"]["setup"] == "1P1D (recorded)"
    assert [s["setup"] for s in w["self_replays"]] == ["1xsingle (single, recorded)"]
    assert "Self-replay: the recorded set-up 1xsingle (single, recorded)" in text
    # the leave-one-out table, and the error stated from it
    rows = [loo.Row(**{k: v for k, v in x.items() if k in ("left_out", "setup", "figure", "recorded", "predicted",
                                                           "in_sample", "band")}) for x in w["leave_one_out"]["rows"]]
    assert {x.left_out for x in rows} == {"pd", "single"}
    assert "Leave-one-out: each recording predicted by the model fitted to the others" in text
    assert w["error_source"] == "leave-one-out"
    assert w["expected_error"] == loo.stated_errors(rows) == w["leave_one_out"]["stated_error"]
    # the 1P1D predicted from the single alone: no KV moved there, so its link is the preset's, and it says so
    assert "kv_pair_gbps" in w["leave_one_out"]["fits"]["pd"]["unfitted"]
    ttft = next(x for x in rows if x.left_out == "pd" and x.figure == "TTFT p50")
    assert abs(ttft.error) > abs(ttft.in_sample_error)  # out of sample is further off than in sample
    assert f"±{w['expected_error']['TTFT p50']:.0%}" in text


def test_the_stated_error_is_the_largest_leave_one_out_miss_rounded_up():
    """(the rows: left out, set-up, figure, recorded, predicted by the others, in-sample)"""
    rows = [loo.Row("a", "2P2D", "TTFT p50", 1.0, 1.31, 1.0), loo.Row("b", "1P3D", "TTFT p50", 2.0, 1.0, 2.0),
            loo.Row("b", "1P3D", "tail ITL p99", 0.010, 0.0101, 0.010)]
    stated = loo.stated_errors(rows)
    assert stated["TTFT p50"] == 0.5 and stated["tail ITL p99"] == 0.05  # -50 %; +1 % floored at 5 %
    assert stated["KV wait p50"] == predict.EXPECTED_ERROR["KV wait p50"]  # no left-out run measured it
    # never below the fit's own miss: two runs may predict each other closer than the model reproduces either
    assert loo.stated_errors([loo.Row("a", "2P2D", "TTFT p99", 1.0, 1.02, 1.38)])["TTFT p99"] == 0.4


def _target(name: str, setup: str) -> fitrun.Target:
    wl = Workload("t", [ClassPlan("c", None, [Request("r", "c", 0, 0.0, 100, 10)])])
    return fitrun.Target(name, wl, setups.parse_setup(setup), {})


@pytest.mark.parametrize("recorded, fitted, unfitted", [
    (["4xsingle"], {"gpu_share", "frontend_stream_ms"}, {"kv_pair_gbps", "kv_together_gbps"}),
    (["3P1D"], {"kv_pair_gbps"}, {"gpu_share", "kv_together_gbps"}),  # one decode reads
    (["2P2D"], {"kv_together_gbps"}, {"gpu_share", "kv_pair_gbps"}),  # several decodes read at once
    (["2P2D", "3P1D", "4xsingle"], {"gpu_share", "kv_pair_gbps", "kv_together_gbps", "frontend_stream_ms"},
     set()),
])
def test_each_parameter_is_fitted_on_the_recordings_that_show_it(recorded, fitted, unfitted):
    got, missing = fitrun.active_knobs([_target(s, s) for s in recorded], PRESETS["h200-llama8b"])
    assert set(got) == fitted and set(missing) == unfitted


def test_on_gpus_of_their_own_nothing_is_shared():
    got, missing = fitrun.active_knobs([_target("pd", "1P1D"), _target("s", "1xsingle")], PRESETS["h200-llama8b-2gpu"])
    assert set(got) == {"kv_bandwidth_gbps", "frontend_stream_ms"} and missing == []


def test_vllm_spread_is_the_repeats():
    """Three repeats of one workload on one H100, P/D and single: the largest over the smallest, less one, per
    figure, the wider of the two set-ups (rounded to the percent), is `VLLM_SPREAD`."""
    spread: dict[str, float] = {}
    for kind in ("pd", "single"):
        runs = [records.read_run(p) for p in sorted(REPEATS.glob(f"{kind}-r*.jsonl.gz"))]
        assert len(runs) == 3
        figs = [predict.figures(e) for e in bench_report.build(runs, verdict=False)["runs"]]
        for name in predict.VLLM_SPREAD:
            values = [f[name] for f in figs]
            spread[name] = max(spread.get(name, 0.0), max(values) / min(values) - 1)
    for name, value in predict.VLLM_SPREAD.items():
        assert math.isclose(value, spread[name], abs_tol=0.006), (name, spread)


def test_a_replay_inside_vllms_own_spread_is_within():
    """Tail ITL p99 ±35 % is the goal, but vLLM's own repeats ran 2.18 times apart: half the recorded is within."""
    assert predict.within("tail ITL p99", 0.5, 1.0, 0.35) and not predict.within("tail ITL p99", 0.4, 1.0, 0.35)
    assert predict.within("TTFT p50", 1.25, 1.0, 0.25) and not predict.within("TTFT p50", 1.3, 1.0, 0.25)


def test_one_recording_says_what_it_cannot_tell_and_a_verdict_across_an_slo_cannot_tell(tmp_path):
    """Run A's 2P2D alone: two decodes read at once, so nothing in it sizes one decode's link, which 3P1D depends
    on; predicted with the preset's link halved and doubled, 3P1D's TTFT p99 spans an SLO of 10 s, and its verdict
    says it cannot tell from this recording and names the run to record next."""
    a = FIX / "real-xpyd-2026-12-01b"
    out = tmp_path / "w.json"
    r = subprocess.run([sys.executable, "-m", "pdproxy", "whatif", "--records", str(a / "bench-pd-88412b25.jsonl.gz"),
                        "--traces", str(a / "pd-a.jsonl.gz"), "--recorded-gpus", "1", "--num-gpu-blocks", "4096",
                        "--setup", "2P2D", "--setup", "3P1D", "--slo-ttft-ms", "10000", "--no-table", "--json",
                        str(out)], capture_output=True, text=True, timeout=180,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    w = json.loads(out.read_text())["whatif"]
    assert w["unknowns"]["parameters"] == ["gpu_share", "kv_pair_gbps"]  # no singles, no lone decode
    lo, hi = w["unknowns"]["ranges"]["3P1D"]["TTFT p99"]
    assert lo < 10.0 < hi, (lo, hi)
    v = json.loads(out.read_text())["verdicts"][0]
    assert v["candidate"] == "3P1D" and v["decision"] == "cannot tell from this recording", v
    assert "record 3P1D (one decode reading KV)" in v["reason"]
    assert "This recording cannot tell GPU sharing (no recording of several single instances), KV link" in " ".join((r.stdout + r.stderr).split())
