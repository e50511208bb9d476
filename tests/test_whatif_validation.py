"""The what-if model's stated error holds on a recorded real run it claims to cover.

vllm023, two H200s (tests/fixtures/vllm023): the single run's workload is replayed on the P/D set-up it
was compared with, and every figure of the prediction (TTFT, per-request max ITL, KV wait; p50 and p99)
must land within `EXPECTED_ERROR` of the recorded P/D run. The same table for every recorded pair is in
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


def test_two_gpu_pd_predicted_from_the_single_runs_workload_within_the_stated_error():
    case = Case("2gpu single -> pd", str(V / "bench-2gpu-single.jsonl.gz"), str(V / "bench-2gpu-pd.jsonl.gz"),
                (str(V / "vllm023-pd-2gpu.otlp.jsonl.gz"),), "h200-llama8b-2gpu", setup="1P1D")
    rows = run_case(case)
    assert {r.figure for r in rows} == set(EXPECTED_ERROR)
    for r in rows:
        assert r.recorded and r.predicted, r
        assert abs(r.error) <= EXPECTED_ERROR[r.figure], (
            f"{r.figure}: predicted {r.predicted * 1e3:.1f} ms vs recorded {r.recorded * 1e3:.1f} ms "
            f"({r.error:+.0%}) is past the stated ±{EXPECTED_ERROR[r.figure]:.0%}")
