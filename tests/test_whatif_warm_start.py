"""What the replay starts with: the instances' prefix caches and the clients' phase, as the recording implies.

vllm023, one H200 (tests/fixtures/vllm023): the single-instance run was recorded right after the P/D run on
the same instance with the same seeded prompts. Its long prompts (4,478 tokens) came back in 31-43 ms (a
cold prefill takes ~110 ms), and every stream gap over 15 ms fell where new clients' prompts past the P/D
run's (cold ones) were prefilled while a client that had started one step later was decoding.
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest

from pdproxy.sim.presets import PRESETS
from pdproxy.whatif import predict, setups, workload
from pdproxy.whatif.model import ModelParams, simulate
from pdproxy.whatif.validate import recorded_entry

pytestmark = pytest.mark.timeout(120)

V = Path(__file__).parent / "fixtures" / "vllm023"
SINGLE, BEFORE = V / "bench-1gpu-single.jsonl.gz", V / "bench-1gpu-pd.jsonl.gz"


def _replay(warm: bool) -> list:
    wl = workload.from_bench(SINGLE)
    if warm:
        workload.warm_from(wl, BEFORE)
    return simulate(wl, setups.parse_setup("1xsingle"), ModelParams(PRESETS["h200-llama8b"]))


def _recorded_long_ttft() -> float:
    with gzip.open(SINGLE, "rt") as f:
        recs = [json.loads(line) for line in f]
    return statistics.median(r["ttft"] for r in recs if r.get("type") == "request" and r["class"] == "long")


def test_a_run_after_the_same_prompts_starts_with_them_cached():
    recorded = _recorded_long_ttft()

    def long_ttft(outs: list) -> float:
        return statistics.median(o.first_token - o.start for o in outs if o.request.cls == "long")

    warm, cold = long_ttft(_replay(True)), long_ttft(_replay(False))
    assert abs(warm - recorded) / recorded < 0.5, (warm, recorded)
    assert cold > 2 * recorded, (cold, recorded)  # what the replay missed without it


def test_warm_start_refuses_a_run_with_other_prompts(tmp_path):
    other = tmp_path / "other.jsonl"
    with gzip.open(BEFORE, "rt") as f:
        lines = [json.loads(line) for line in f]
    lines[0]["workload"]["seed"] = 8
    other.write_text("".join(json.dumps(x) + "\n" for x in lines))
    wl = workload.from_bench(SINGLE)
    with pytest.raises(workload.WorkloadError, match="not the same seeded prompts"):
        workload.warm_from(wl, other)
    assert wl.warm == {}


def test_closed_loop_clients_keep_their_recorded_phase():
    """The tail ITL comes from the client out of phase with the others: recorded 29 ms at p99, 5 ms in a replay
    whose clients all start together."""
    wl = workload.from_bench(SINGLE)
    workload.warm_from(wl, BEFORE)
    params = ModelParams(PRESETS["h200-llama8b"])
    pred = predict.prediction_figures(predict.run_setup(wl, setups.parse_setup("1xsingle"), params))
    rec = predict.figures(recorded_entry(str(SINGLE), ()))
    err = (pred["tail ITL p99"] - rec["tail ITL p99"]) / rec["tail ITL p99"]
    assert abs(err) <= 0.15, (pred["tail ITL p99"], rec["tail ITL p99"])

