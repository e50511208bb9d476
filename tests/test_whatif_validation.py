"""The what-if model's stated error holds on a recorded real run it claims to cover.

vllm023, two H200s (tests/fixtures/vllm023): the P/D run's workload is replayed on its own set-up with the
model fitted to the run (`--fit-run`), and every figure of the prediction (TTFT, per-request max ITL, KV
wait; p50 and p99; completed requests) must land within `EXPECTED_ERROR` of the recording. The same table for every recorded pair is in
docs/whatif.md (benchmarks/whatif_validation.py); a model change that moves a figure past what the
output claims fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdproxy.whatif.predict import EXPECTED_ERROR
from pdproxy.whatif.validate import Case, run_case

pytestmark = pytest.mark.timeout(120)

V = Path(__file__).parent / "fixtures" / "vllm023"


def test_two_gpu_pd_self_replay_fitted_to_the_run_within_the_stated_error():
    tr = (str(V / "vllm023-pd-2gpu.otlp.jsonl.gz"),)
    case = Case("2gpu pd -> pd", str(V / "bench-2gpu-pd.jsonl.gz"), str(V / "bench-2gpu-pd.jsonl.gz"), tr,
                "h200-llama8b-2gpu", setup="1P1D", source_traces=tr)
    rows = run_case(case, fit=True)
    assert {r.figure for r in rows} == set(EXPECTED_ERROR)
    for r in rows:
        assert r.recorded and r.predicted, r
        assert abs(r.error) <= EXPECTED_ERROR[r.figure], (
            f"{r.figure}: predicted {r.predicted * 1e3:.1f} ms vs recorded {r.recorded * 1e3:.1f} ms "
            f"({r.error:+.0%}) is past the stated ±{EXPECTED_ERROR[r.figure]:.0%}")
