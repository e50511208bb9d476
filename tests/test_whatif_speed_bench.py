"""Smoke run of benchmarks/whatif_speed.py's machinery (stretching a record, timing the command): one minute of
traffic on two set-ups; the speed figures themselves are in docs/explanation/whatif.md."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(240)


def test_speed_benchmark_smoke():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "whatif_speed.py"), "--minutes", "1",
                          "--setup", "2P2D", "--setup", "4xsingle"], capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "wall time, all set-ups (s)" in out and "CPU time / 2 cores (s)" in out and "virtual s per wall s" in out
    rows = {line.split()[0]: int(line.split()[-1]) for line in out.splitlines()
            if line.startswith(("2P2D", "4xsingle"))}
    # 60 s of the recorded 40 s workload: more requests than the recording's 150 (the closed loop ran on, the
    # open-loop arrivals repeated)
    assert rows["4xsingle"] > 150 and rows["2P2D"] > 20, out
