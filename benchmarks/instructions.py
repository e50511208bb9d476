"""Instructions per request, counted by callgrind: the hot path's cost without this machine's noise.

Why: on the 2-core machine the same build's CPU time per request moves by up to 30 % from one round
to the next (steal time, neighbours), more than a change of a few microseconds is worth, so
benchmarks/cpu_per_request.py cannot resolve one. Valgrind's callgrind counts the instructions a
process executes in user space, exactly, whatever else runs on the machine. Each target is started
under it with instrumentation off (start-up at a few times native speed), instrumentation is
switched on, a closed loop of 8-token streams runs (benchmarks/loadgen.py, as cpu_per_request.py,
fewer users: the proxy runs some 50 times slower), and the count is dumped at the load's
measure-start and measure-end marks (callgrind zeroes its counters at each dump): instructions per
request are the second dump's over the requests the load generator completed in that window.

What it does not see: the kernel's part (the sockets; with tracing on, the posts to the collector:
perf put that at 5-10 us a request), cache misses, and instructions of different cost (Rust's
against CPython's). It ranks changes of the same code, tracing on against off exactly; against
vllm-router it is a second opinion, not issue 32's CPU target itself.

Run: python benchmarks/instructions.py [--pdproxy-path TREE] [--baseline-path TREE]
         [--targets pdproxy pdproxy-off vllm-router] [--rounds 2] [--duration 12] [--keep DIR]
(needs valgrind: `apt-get install valgrind`). Its work directory (logs, callgrind dumps) is removed
after a run that succeeds and kept, its path printed, after one that fails; `--keep DIR` keeps it at DIR
for `callgrind_annotate` (each target's count between the marks is DIR/<target>.cg.2, of its last round).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

TOTALS = re.compile(rb"^(?:summary|totals): (\d+)", re.MULTILINE)


class Counted:
    """One target under callgrind: its instruction count dumped at the load's marks."""

    def __init__(self, pid: int, out: Path) -> None:
        self.pid = pid
        self.out = out
        self.dumps = 0

    def control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.pid)], check=True, capture_output=True, timeout=60)

    def dump(self, mark: str) -> None:
        self.control(f"--dump={mark}")
        self.dumps += 1

    def last(self) -> int:
        """Instructions counted between the last two dumps."""
        text = Path(f"{self.out}.{self.dumps}").read_bytes()
        return int(TOTALS.search(text).group(1))


def measure(bench: harness.Bench, name: str, args: argparse.Namespace) -> tuple[float, int]:
    """(instructions per request, requests counted) of one run of `name`."""
    out = bench.work / f"{name}.cg"
    for old in bench.work.glob(f"{name}.cg*"):
        old.unlink()
    bench.wrap = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    with bench.running(name) as (url, proc):
        counted = Counted(proc.popen.pid, out)
        counted.control("--instr=on")
        r = bench.load(url, proc, concurrency=args.concurrency, tokens=8, duration=args.duration,
                       warmup=args.warmup, on_mark=counted.dump)
        if r.errors or counted.dumps != 2:
            raise RuntimeError(f"{name}: {r.errors} errors {r.error_kinds}, {counted.dumps} dumps")
        return counted.last() / r.requests, r.requests


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", default=["pdproxy", "pdproxy-off", "vllm-router"])
    p.add_argument("--pdproxy-path")
    p.add_argument("--baseline-path", help="also count pdproxy from this tree (pdproxy-before, pdproxy-off-before)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=12.0, help="seconds counted per run")
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--min-requests", type=int, default=200, help="fewer counted requests than this fails the run")
    p.add_argument("--keep", metavar="DIR", help="keep the logs and callgrind dumps in DIR (else removed unless the "
                   "run fails)")
    args = p.parse_args()
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    targets = harness.with_baseline(args.targets, args.baseline_path)
    work = args.keep or tempfile.mkdtemp(prefix="pdproxy-instr-")
    bench = harness.Bench(work, pdproxy_path=args.pdproxy_path, baseline_path=args.baseline_path)
    counts: dict[str, list[float]] = {name: [] for name in targets}
    try:
        bench.start_upstreams()
        for round_, name in harness.interleaved(targets, args.rounds):
            per_request, requests = measure(bench, name, args)
            if requests < args.min_requests:
                raise RuntimeError(f"{name}: only {requests} requests counted (at least {args.min_requests})")
            counts[name].append(per_request)
            print(f"round {round_ + 1} {name:20s} {per_request / 1e3:8.1f} k instructions/request "
                  f"({requests} requests)", flush=True)
    except BaseException:
        print(f"the run failed: its logs and dumps are kept in {work}", file=sys.stderr)
        raise
    finally:
        bench.stop_all()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nInstructions per request (user space, callgrind), 8-token streams at concurrency {args.concurrency}, "
          f"median of {args.rounds} runs:")
    print("| target | k instructions / request (runs) | / vllm-router |\n|---|---:|---:|")
    router = statistics.median(counts["vllm-router"]) if counts.get("vllm-router") else None
    for name, values in counts.items():
        median = statistics.median(values)
        ratio = f"{median / router:.2f}" if router else "-"
        runs = ", ".join(f"{v / 1e3:.1f}" for v in values)
        print(f"| {name} | {median / 1e3:.1f} ({runs}) | {ratio} |")
    for on, off in (("pdproxy", "pdproxy-off"), ("pdproxy-before", "pdproxy-off-before")):
        if counts.get(on) and counts.get(off):
            extra = statistics.median(counts[on]) - statistics.median(counts[off])
            print(f"tracing on - off, {on}: {extra / 1e3:+.1f} k instructions/request "
                  f"(on/off {statistics.median(counts[on]) / statistics.median(counts[off]):.3f})")
    if counts.get("pdproxy") and counts.get("pdproxy-before"):
        for on, before in (("pdproxy", "pdproxy-before"), ("pdproxy-off", "pdproxy-off-before")):
            print(f"{on} after/before: {statistics.median(counts[on]) / statistics.median(counts[before]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
