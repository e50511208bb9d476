"""The what-if's front end (pdproxy/sim/timing.py `FrontEnd`) on the recorded vLLM 0.23 single instances.

* The virtual-time model takes a request in later the more streams its instance serves, as the simulator's
  server does (tests/test_sim_frontend.py) and as vLLM's API server did (11 ms beside 4 streams, 23 ms
  beside 16, tests/fixtures/vllm023).
* Fitted to the run (`--fit-run`: the time per stream), the 1-GPU single's self-replay (4 closed-loop
  streams, warm from the P/D run before it) lands within ±20 % on TTFT p50, TTFT p99 and tail ITL p99 (a
  fixed front end, which the fit could not move, missed it by +21 % and -24 %).
* `--fit-run` moves the time per stream until the 2-GPU single's (16 streams) TTFT p50 is reproduced.
* Streams that end in one engine step are finished one after another (`frontend_finish_ms`), as vLLM's API
  server delivered them (1.0-1.3 ms apart) and as the simulator's server does (tests/test_sim_frontend_finish.py).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from pdproxy.sim.presets import PRESETS
from pdproxy.whatif import fitrun, model, predict, setups, workload
from pdproxy.whatif.model import ModelParams
from pdproxy.whatif.workload import ClassPlan, Request, Workload

pytestmark = pytest.mark.timeout(300)
V = Path(__file__).parent / "fixtures" / "vllm023"
GOAL_1GPU = 0.20


def _single(gpus: str) -> tuple[workload.Workload, setups.Setup]:
    wl = workload.from_bench(str(V / f"bench-{gpus}-single.jsonl.gz"))
    workload.warm_from(wl, str(V / f"bench-{gpus}-pd.jsonl.gz"))
    own = setups.recorded(wl.conditions)
    assert own is not None and own.mode == "single"
    return wl, own


def _recorded(gpus: str) -> dict:
    return predict.figures(_entry(gpus))


def _entry(gpus: str) -> dict:
    from pdproxy.whatif import validate

    return validate.recorded_entry(str(V / f"bench-{gpus}-single.jsonl.gz"), ())


def test_intake_grows_with_the_streams_an_instance_serves():
    wl, own = _single("2gpu")
    preset = PRESETS["h200-llama8b-2gpu"]
    front = {}
    for per_stream in (0.0, 2.0):
        outs = model.simulate(wl, own, ModelParams(replace(preset, frontend_stream_ms=per_stream)))
        front[per_stream] = sorted(o.frontend for o in outs if o.first_token is not None)
    fixed, loaded = front[0.0], front[2.0]
    # 16 closed-loop clients, 2 ms per stream in flight: clients that finish in one step come back together
    # (and do not count each other), the others find up to 15 streams decoding
    assert statistics.median(loaded) - statistics.median(fixed) >= 3 * 0.002, (fixed[::50], loaded[::50])
    assert loaded[int(0.9 * len(loaded))] - fixed[int(0.9 * len(fixed))] >= 10 * 0.002, (fixed[::50], loaded[::50])


def test_the_1gpu_single_replays_within_the_bound():
    wl, own = _single("1gpu")
    fit = fitrun.fit_run(wl, own, ModelParams(PRESETS["h200-llama8b"]), _entry("1gpu"))
    pred = fit.figures("recorded")
    rec = _recorded("1gpu")
    errors = {n: (pred[n] - rec[n]) / rec[n] for n in fitrun.GOAL}
    assert all(abs(e) <= GOAL_1GPU for e in errors.values()), errors


def test_the_fit_moves_the_front_end_to_the_2gpu_singles_ttft():
    wl, own = _single("2gpu")
    rec = _recorded("2gpu")
    fit = fitrun.fit_run(wl, own, ModelParams(PRESETS["h200-llama8b-2gpu"]), _entry("2gpu"))
    p50 = [(r["frontend_stream_ms"], r["figures"]["recorded"]["TTFT p50"]) for r in fit.rounds]
    assert abs(p50[0][1] - rec["TTFT p50"]) / rec["TTFT p50"] > 0.25, p50  # the preset's front end is short
    closest = min(p50, key=lambda r: abs(r[1] - rec["TTFT p50"]))
    assert abs(closest[1] - rec["TTFT p50"]) / rec["TTFT p50"] <= 0.05, p50
    assert closest[0] > PRESETS["h200-llama8b-2gpu"].frontend_stream_ms, p50


@pytest.mark.parametrize("finish_ms", [5.0, 0.0])
def test_streams_ending_in_one_step_reach_their_clients_one_after_another(finish_ms):
    # four prompts arriving together, no intake work: prefilled in one step, ending in one step
    reqs = [Request(f"s{i}", "stream", i, 0.0, 64, 20, stream=i) for i in range(4)]
    wl = Workload("test", [ClassPlan("stream", None, reqs)])
    preset = replace(PRESETS["h200-llama8b"], frontend_request_ms=0.0, frontend_stream_ms=0.0,
                     frontend_finish_ms=finish_ms)
    outs = model.simulate(wl, setups.parse_setup("1xsingle"), ModelParams(preset))
    ends = sorted(o.end for o in outs)
    last = sorted(o.token_times[-1] for o in outs)
    before_last = {round(o.token_times[-2], 9) for o in outs}
    assert len(before_last) == 1, before_last  # the same step's tokens until the last one
    for times in (ends, last):
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert all(abs(g - finish_ms / 1e3) < 1e-6 for g in gaps), gaps
