"""CPU per request, side by side and interleaved: pdproxy against vllm-router and the floor of its design.

benchmarks/overhead.py measures one target after another, minutes apart; on a shared machine whose
speed drifts by a fifth between minutes, ratios of CPU per request across targets then say as much
about the machine as about the proxies. Here every round runs each target once, for a few seconds,
in turn, and the report gives each target's median over the rounds and its ratio to vllm-router.

Targets (overhead.py's, same upstreams, pinning and OTLP receiver), plus
  floor        benchmarks/floor_proxy.py: aiohttp's server and pdproxy's upstream client, nothing else
  floor-lean   the same legs behind a bare httptools protocol instead of aiohttp: the server's share

Run:  python benchmarks/cpu_per_request.py [--rounds 6] [--targets pdproxy pdproxy-off vllm-router floor floor-lean]
      [--baseline-path TREE (adds pdproxy-before, pdproxy-off-before)] [--baseline-label pure]
      [--tokens 8] [--concurrency 32]
Compiled against pure Python (issue 32): build this tree with `PDPROXY_COMPILE=1 pip install -e .`, pass
a pure copy of the same commit (`git archive HEAD | tar -x -C DIR`) as --baseline-path, and
--baseline-label pure to name its rows pdproxy-pure / pdproxy-off-pure. Each pdproxy logs its form
at start-up (pdproxy/compiled.py); the table's first rows say which form ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", default=["pdproxy", "pdproxy-off", "vllm-router", "floor", "floor-lean"])
    p.add_argument("--baseline-path")
    p.add_argument("--pdproxy-path", help="run pdproxy from this tree (e.g. a copy of a compiled build, so "
                                          "that edits during the run do not reach it)")
    p.add_argument("--baseline-label", default="before", help="what the --baseline-path rows are called")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--duration", type=float, default=4.0, help="seconds measured per target and round")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--no-pin", dest="pin", action="store_false")
    p.add_argument("--work-dir", default="/tmp/pdproxy-cpu-per-request")
    args = p.parse_args()
    targets = harness.with_baseline(args.targets, args.baseline_path)
    bench = harness.Bench(args.work_dir, pin=args.pin, pdproxy_path=args.pdproxy_path,
                          baseline_path=args.baseline_path)
    bench.start_upstreams()
    cpu: dict[str, list[float]] = {t: [] for t in targets}
    rps: dict[str, list[float]] = {t: [] for t in targets}
    try:
        for r, name in harness.interleaved(targets, args.rounds):
            with bench.running(name) as (url, proc):
                bench.load(url, proc, concurrency=args.concurrency, tokens=args.tokens, duration=1.0, warmup=0.5)
                res = bench.load(url, proc, concurrency=args.concurrency, tokens=args.tokens,
                                 duration=args.duration, warmup=0.5)
            if res.errors or not res.requests:
                raise RuntimeError(f"{name}: {res.errors} errors in {res.requests} requests")
            cpu[name].append(res.proxy_cpu / res.requests * 1000)
            rps[name].append(res.rps)
            print(f"round {r + 1} {name:20s} {rps[name][-1]:7.0f} req/s {cpu[name][-1]:.3f} ms CPU/req", flush=True)
    finally:
        bench.stop_all()
    bench.say_forms(targets)
    router = statistics.median(cpu["vllm-router"]) if cpu.get("vllm-router") else None
    print(f"\nCPU per request, {args.tokens}-token streams at concurrency {args.concurrency}, median of "
          f"{args.rounds} interleaved rounds ({'proxy pinned to CPU 1' if args.pin else 'unpinned'}):")
    print(f"| target | req/s | CPU ms / req (min-max) | / vllm-router |\n|---|---:|---:|---:|")
    for name in targets:
        med = statistics.median(cpu[name])
        ratio = f"{med / router:.2f}" if router else "-"
        label = name.replace("-before", f"-{args.baseline_label}")
        print(f"| {label} | {statistics.median(rps[name]):.0f} | {med:.3f} ({min(cpu[name]):.3f}-{max(cpu[name]):.3f}) "
              f"| {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
