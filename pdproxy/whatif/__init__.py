"""What-if: replay a recorded workload on candidate set-ups in virtual time and predict the report.

Public face: `load_workload` (bench records or trace files), `parse_setup` / `candidates` (set-ups at a
GPU total), `ModelParams`, `Death` (an instance dying mid-replay), `predict` (the report dict `pdproxy report` renders, plus the prediction's
error and suggested real runs). The model is the simulator's engine itself on a virtual clock
(pdproxy/whatif/virtual.py), so it and `pdproxy sim` share one implementation of the timings.
"""

from __future__ import annotations

from pdproxy.whatif.model import Death, ModelParams, simulate
from pdproxy.whatif.predict import EXPECTED_ERROR, PREDICTION, build_report, run_setup
from pdproxy.whatif.setups import Setup, SetupError, candidates, parse_setup
from pdproxy.whatif.workload import Workload, WorkloadError, load as load_workload

__all__ = ["EXPECTED_ERROR", "PREDICTION", "Death", "ModelParams", "Setup", "SetupError", "Workload", "WorkloadError",
           "build_report", "candidates", "load_workload", "parse_setup", "run_setup", "simulate"]
