"""Issue 32's targets, every one measured with the targets interleaved round by round.

benchmarks/overhead.py measures one target after another, minutes apart: on a shared machine the
ratios then say as much about the machine's minute as about the proxies. cpu_per_request.py
interleaves, but only CPU per request. This runs each target once per round through every phase
the targets name, in turn (the order reversed every other round), and reports each target's
median over the rounds beside vllm-router's:

  cpu      8-token streams at concurrency 32: CPU ms per request, req/s
  chunks   256-token streams at concurrency 128: chunks/s (one pdproxy worker, pinned like the router)
  warm     back-to-back single requests of 2 tokens: added TTFT p50 at concurrency 1
  c256     32 tokens paced at 10 ms, 256 streams: added TTFT p50
"Added" = the target's percentile minus `direct`'s in the same round.

Run:  python benchmarks/targets_interleaved.py [--rounds 4] [--pdproxy-path TREE]
      [--baseline-path TREE --baseline-label pure]   (pure against compiled: see cpu_per_request.py)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

ITL_MS = 10.0
LAT_TOKENS = 32


def phases(bench: harness.Bench, url: str, proc: harness.Proc | None) -> dict[str, float]:
    """One round of one target: the figures issue 32 names."""
    out: dict[str, float] = {}
    bench.load(url, proc, concurrency=16, tokens=16, duration=0.5, warmup=0.5)  # pools and caches exist
    r = bench.load(url, proc, concurrency=32, tokens=8, duration=3.0, warmup=0.5)
    _check(url, r)
    out["rps"] = r.rps
    if proc is not None:
        out["cpu_ms"] = r.proxy_cpu / r.requests * 1000
    r = bench.load(url, proc, concurrency=128, tokens=256, duration=3.0, warmup=0.5)
    _check(url, r)
    out["cps"] = r.cps
    r = bench.load(url, proc, concurrency=1, tokens=2, duration=2.0, warmup=0.5, timings=True)
    _check(url, r)
    out["ttft_warm"] = harness.pct(r.ttft_us, 50) / 1000
    spread = LAT_TOKENS * ITL_MS / 1000
    r = bench.load(url, proc, concurrency=256, tokens=LAT_TOKENS, duration=3.0, warmup=spread + 0.5,
                   itl_ms=ITL_MS, timings=True, ramp=spread)
    _check(url, r)
    out["ttft_256"] = harness.pct(r.ttft_us, 50) / 1000
    return out


def _check(url: str, r: harness.PhaseResult) -> None:
    if r.errors or not r.requests:
        raise RuntimeError(f"{url}: {r.errors} errors in {r.requests} requests")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", default=["direct", "pdproxy", "pdproxy-off", "vllm-router"])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--pdproxy-path")
    p.add_argument("--baseline-path")
    p.add_argument("--baseline-label", default="before")
    p.add_argument("--work-dir", default="/tmp/pdproxy-targets-interleaved")
    args = p.parse_args()
    targets = harness.with_baseline(args.targets, args.baseline_path)
    bench = harness.Bench(args.work_dir, pdproxy_path=args.pdproxy_path, baseline_path=args.baseline_path)
    bench.start_upstreams()
    rounds: list[dict[str, dict[str, float]]] = [{} for _ in range(args.rounds)]
    try:
        for r, name in harness.interleaved(targets, args.rounds):
            with bench.running(name) as (url, proc):
                got = rounds[r][name] = phases(bench, url, proc)
            print(f"round {r + 1} {name:20s} " + " ".join(f"{k}={v:.3f}" for k, v in got.items()), flush=True)
    finally:
        bench.stop_all()
    bench.say_forms(targets)

    def med(name: str, key: str, added: bool = False) -> float:
        return statistics.median(g[name][key] - (g["direct"][key] if added else 0) for g in rounds)

    print(f"\nMedians of {args.rounds} interleaved rounds (proxy pinned to CPU 1, one pdproxy worker):")
    print("| target | CPU ms/req | / router | req/s | chunks/s | / router | +TTFT p50 c=1 warm ms | "
          "+TTFT p50 c=256 ms |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in targets:
        label = name.replace("-before", f"-{args.baseline_label}")
        cpu = f"{med(name, 'cpu_ms'):.3f} | {med(name, 'cpu_ms') / med('vllm-router', 'cpu_ms'):.2f}" \
            if name != "direct" else "- | -"
        added = (f"{med(name, 'ttft_warm', True):+.3f} | {med(name, 'ttft_256', True):+.1f}" if name != "direct"
                 else f"({med(name, 'ttft_warm'):.3f}) | ({med(name, 'ttft_256'):.1f})")
        print(f"| {label} | {cpu} | {med(name, 'rps'):.0f} | {med(name, 'cps'):.0f} | "
              f"{med(name, 'cps') / med('vllm-router', 'cps'):.2f} | {added} |")
    for on, off in (("pdproxy", "pdproxy-off"), ("pdproxy-before", "pdproxy-off-before")):
        if on in targets and off in targets:
            print(f"tracing on / off, {on.replace('-before', '-' + args.baseline_label)}: req/s "
                  f"{statistics.median(g[on]['rps'] / g[off]['rps'] for g in rounds):.2f}, chunks/s "
                  f"{statistics.median(g[on]['cps'] / g[off]['cps'] for g in rounds):.2f} (median of per-round ratios)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
