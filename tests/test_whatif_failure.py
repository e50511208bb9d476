"""An instance that dies mid-run, in the what-if: its requests' connections break and the proxy does what pdproxy
does (a decode that fails before its first token is retried on another decode with a new prefill elsewhere; a
stream that breaks after it fails, or goes on elsewhere with --migrate-mid-stream; later requests go to the
instances left). Run B (tests/fixtures/xpyd: 2P2D on one H200, vllm-decode-1 killed 17 s in) is read and replayed
with its failure."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pdproxy.bench import traces
from pdproxy.config import Settings
from pdproxy.sim.presets import PRESETS
from pdproxy.whatif import failures, predict, recorded, setups
from pdproxy.whatif.model import Death, ModelParams, simulate
from pdproxy.whatif.workload import ClassPlan, Request, Workload, from_bench

pytestmark = pytest.mark.timeout(120)

FIX = Path(__file__).parent / "fixtures" / "xpyd"
B_BENCH, B_TRACES = FIX / "run-b-bench.jsonl.gz", FIX / "run-b.otlp.jsonl.gz"
DIES_AT = 1.0


def steady(n: int = 30, gap: float = 0.1, output: int = 40) -> Workload:
    """Open-loop requests every `gap` s: some are streaming on a decode when it dies, some still waiting for it."""
    reqs = [Request(f"r{i}", "all", i, i * gap, 600, output, stream=i) for i in range(n)]  # prompts of their own
    return Workload("test", [ClassPlan("all", None, reqs)])


def run(migrate: bool = False, deaths: tuple[Death, ...] = (Death("decode", 1, DIES_AT),)) -> list:
    # each instance its own GPU (the failure handling, not the shared GPU's KV path, is what these check)
    params = ModelParams(replace(PRESETS["h200-llama8b"], gpu_share=0.0, shared_gpu=False), prefill_policy="round_robin",
                         decode_policy="round_robin", proxy=Settings(migrate_mid_stream=migrate))
    return simulate(steady(), setups.parse_setup("2P2D"), params, deaths)


def test_a_dead_decode_serves_nothing_after_its_death_and_its_waiting_requests_move():
    healthy = {o.request.request_id: o for o in run(deaths=())}
    outs = run()
    on_dead = [o for o in outs if healthy[o.request.request_id].decode_instance == "decode-1"]
    # round robin: every other request was bound for decode-1; those it had not started streaming when it died moved
    moved = [o for o in on_dead if o.start < DIES_AT and healthy[o.request.request_id].first_token > DIES_AT]
    assert moved, "no request was waiting on decode-1 when it died: the workload does not test the move"
    for o in moved:
        assert o.error is None and o.decode_instance == "decode-0" and o.first_token > DIES_AT
    # no token from decode-1 after its death, and nothing sent to it after the proxy knew
    for o in outs:
        if o.decode_instance == "decode-1":
            assert o.end is not None and o.end <= DIES_AT
    assert all(o.decode_instance == "decode-0" for o in outs if o.start > DIES_AT and o.error is None)
    assert all(o.error is None for o in outs if o.start > DIES_AT)


def test_a_stream_that_breaks_mid_way_fails_unless_the_proxy_migrates_it():
    healthy = {o.request.request_id: o for o in run(deaths=())}
    streaming = {rid for rid, o in healthy.items()
                 if o.decode_instance == "decode-1" and o.first_token < DIES_AT < o.end}
    assert streaming, "no stream on decode-1 when it died"
    failed = {o.request.request_id for o in run() if o.error is not None}
    assert failed == streaming  # pdproxy's default: the client gets an error event
    for o in run(migrate=True):
        if o.request.request_id in streaming:  # continued on decode-0 after a prefill of prompt + tokens delivered
            assert o.error is None and o.decode_instance == "decode-0"
            assert len(o.token_times) == o.request.output_tokens
            gaps = [b - a for a, b in zip(o.token_times, o.token_times[1:])]
            assert max(gaps) > 10 * sorted(gaps)[len(gaps) // 2]  # the migration's gap


def test_run_b_death_and_routing_read_from_the_proxy_traces():
    wl = from_bench(B_BENCH)
    idx = traces.read_traces([str(B_TRACES)])
    deaths, notes = failures.read(idx, wl, "pd")
    assert len(deaths) == 1
    d = deaths[0]
    assert (d.role, d.index) == ("decode", 1) and 16.9 < d.at < 17.2, d  # vllm-decode-1, killed 17.06 s in
    assert "127.0.0.1:8201" in notes[0] and "10 attempt(s)" in notes[0]
    assert recorded.routing(idx) == {"prefill": "round_robin", "decode": "round_robin"}
    # run A lost nothing (its traces hold no failed attempt)
    a = Path(__file__).parent / "fixtures" / "real-xpyd-2026-12-01b"
    assert failures.read(traces.read_traces([str(a / "pd-a.jsonl.gz")]), from_bench(a / "bench-pd-88412b25.jsonl.gz"),
                         "pd") == ([], [])


def test_run_b_self_replay_replays_its_dead_decode():
    wl = from_bench(B_BENCH)
    idx = traces.read_traces([str(B_TRACES)])
    deaths = tuple(failures.read(idx, wl, "pd")[0])
    setup = setups.parse_setup("2P2D")
    # the pre-issue-56 model of this run (a link per prefill, an intake per decode): what is checked is the death
    params = ModelParams(replace(PRESETS["h200-llama8b"], num_gpu_blocks=4096, gpu_share=0.7, kv_bandwidth_gbps=0.2,
                                 kv_intake_gbps=0.2, shared_gpu=False), **recorded.policies(recorded.routing(idx), "pd"))
    with_death = predict.prediction_figures(predict.run_setup(wl, setup, params, deaths))
    without = predict.prediction_figures(predict.run_setup(wl, setup, params))
    outs = simulate(wl, setup, params, deaths)
    assert not [o for o in outs if o.decode_instance == "decode-1" and o.end > deaths[0].at]
    # half the capacity gone for the run's last 23 s: the recorded TTFT p99 (42 s, requests moved off the dead
    # decode) is a replay with the death's, not a healthy run's
    assert with_death["TTFT p99"] > 1.2 * without["TTFT p99"]


def test_cli_says_what_the_recording_lost_and_predicts_the_set_ups_without_it(tmp_path):
    out = tmp_path / "w.json"
    r = subprocess.run([sys.executable, "-m", "pdproxy", "whatif", "--records", str(B_BENCH), "--traces", str(B_TRACES),
                        "--num-gpu-blocks", "4096", "--no-fit-run", "--setup", "2P2D", "--setup", "1P3D", "--json",
                        str(out), "--no-table"], capture_output=True, text=True, timeout=100,
                       env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert r.returncode == 0, r.stderr
    assert "lost decode instance 127.0.0.1:8201 at 17.1 s" in r.stdout
    assert "routing as the recorded proxy's spans name it" in r.stdout and "round_robin" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["whatif"]["self_replay"]["setup"] == "2P2D (recorded, its failures replayed)"
    assert [e["label"] for e in rep["runs"]] == ["2P2D (recorded)", "1P3D"]


def test_the_last_decode_dying_fails_what_follows_and_the_replay_ends():
    """1P1D losing its decode: every request after fails (no healthy decode, as pdproxy answers 503), and a
    closed loop of such requests still runs out its recorded duration instead of spinning at one instant."""
    reqs = [Request(f"c{i}", "loop", i, 0.0, 600, 20) for i in range(4)]
    wl = Workload("test", [ClassPlan("loop", 2, reqs)], duration=7.0)  # the health check at 5 s finds it down
    params = ModelParams(replace(PRESETS["h200-llama8b"], gpu_share=0.0, shared_gpu=False))
    outs = simulate(wl, setups.parse_setup("1P1D"), params, (Death("decode", 0, 1.0),))
    before = [o for o in outs if o.end is not None and o.end <= 1.0]
    after = [o for o in outs if o.start > 1.0]
    assert before and all(o.error is None for o in before)
    assert after and all(o.error is not None for o in after)
    assert any("no healthy decode instance" in (o.error or "") for o in after)  # once the health check found it
    assert max(o.start for o in outs) < 7.0 + 0.01


def test_a_dead_prefill_is_retried_on_the_other_one():
    """A prefill that dies: its legs are retried on the other prefill (--prefill-retries), and nothing fails."""
    outs = run(deaths=(Death("prefill", 0, DIES_AT),))
    assert all(o.error is None for o in outs)
    late = [o for o in outs if o.start > DIES_AT]
    assert late and all(o.prefill_instance == "prefill-1" for o in late)


def test_an_instance_that_serves_again_after_a_failure_did_not_die():
    from pdproxy.bench.engine_spans import SpanEvent
    from pdproxy.telemetry import names

    def info(rid: str, start: float, decode: str, failed_on: str | None = None) -> traces.TraceInfo:
        host, port = (failed_on or ":").split(":")
        events = [SpanEvent(1000.0 + start + 0.5, names.ATTEMPT_EVENT, {
            "server.address": host, "server.port": int(port), "vllm.request_phase": "decode",
            names.MIGRATION_REASON: "stream_broken"})] if failed_on else []
        return traces.TraceInfo(trace_id=rid, request_id=rid, root_name="x", attrs={"pd.decode.instance": decode},
                                resource={}, start=1000.0 + start, stage_times={"decode": (1000.0 + start, 0.0)},
                                stage_events={"decode": events})

    wl = Workload("t", [ClassPlan("c", None, [Request(f"r{i}", "c", i, float(i), 100, 10) for i in range(3)])])
    idx = traces.TraceIndex()
    idx.by_request = {"r0": info("r0", 0.0, "h:1"), "r1": info("r1", 1.0, "h:1", failed_on="h:2"),
                      "r2": info("r2", 2.0, "h:2")}
    assert failures.read(idx, wl, "pd") == ([], [])  # h:2 served r2 after r1's broken stream: a blip
    del idx.by_request["r2"]
    deaths, _ = failures.read(idx, wl, "pd")
    assert deaths == [Death("decode", 1, 1.5)]  # h:2, first used by r1 after h:1, died at r1's failure
