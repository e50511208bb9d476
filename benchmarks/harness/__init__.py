"""What the benchmark scripts share: processes, /proc accounting, the load loop and the targets.

`benchmarks/` is a folder of scripts, not an installed package: a script puts its own folder on
`sys.path` and imports this package (`import harness`). Each module has one concern:

  procs    child processes in their own process group (stopped with everything they started, and
           killed by the kernel if the script dies), free ports, waiting for readiness, CPU pinning
  stats    CPU seconds and memory of a process tree and of the whole machine, read from /proc
  load     one bounded phase of benchmarks/loadgen.py, with the proxy's CPU over exactly its window
  targets  the zero-delay upstreams (benchmarks/zero_upstream.py), the OTLP receiver and the proxies
           measured against them: pdproxy, vllm-router, vLLM's toy proxy, the floor proxies
"""

from __future__ import annotations

from .load import PhaseResult, pct, run_load
from .procs import HERE, HOST, REPO, Proc, Procs, free_port, free_ports, placed, python_in, start_pdproxy, wait_port
from .stats import machine, machine_busy, rss_bytes, wait_quiet
from .targets import FLOORS, TARGETS, TRACED, Bench, interleaved, with_baseline

__all__ = ["FLOORS", "HERE", "HOST", "REPO", "TARGETS", "TRACED", "Bench", "PhaseResult", "Proc", "Procs",
           "free_port", "free_ports", "interleaved", "machine", "machine_busy", "pct", "placed", "python_in",
           "rss_bytes", "run_load", "start_pdproxy", "wait_port", "wait_quiet", "with_baseline"]
