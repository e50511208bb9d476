"""Proxy overhead benchmark: pdproxy (tracing on and off) vs vllm-router vs vLLM's toy proxy vs direct.

One run, one machine, the same zero-delay upstreams and the same bounded load for every target,
one target at a time:

  direct        the load generator straight to the decode instance: the physical limit
  pdproxy       tracing on, exporting every span over OTLP/HTTP to a real receiver (benchmarks/otlp_sink.py)
  pdproxy-off   --no-tracing (metrics stay on)
  pdproxy-noattr  tracing on, --no-stall-attribution: the cost of the live stall attribution (per-instance
                record of KV arrivals / prefills, attribution of each stall) is pdproxy against this row
  vllm-router   PyPI vllm-router in P/D mode (round_robin), installed when missing
  toy-proxy     vLLM's toy_proxy_server.py, fetched from vLLM's sdist at run time (never committed)
  pdproxy-before, pdproxy-off-before
                the same two from another source tree (--baseline-path, e.g. a worktree of main), measured
                in the same run so that before/after ratios share one machine state
  pdproxy-2w    tracing on, --workers 2, on both CPUs (it shares CPU 0 with the load generator and the
                upstreams: only on a machine with cores to spare does this row show scaling)

Phases per target (`benchmarks/zero_upstream.py` upstreams, `benchmarks/loadgen.py` client):
  1. saturation, long streams: closed loop, zero-delay decode -> streamed chunks/s, CPU s per 1,000 chunks
  2. saturation, short streams: closed loop -> requests/s
  3. latency at concurrency 1, 64 and 256: the decode paces its tokens (one engine step every
     --itl-ms for all streams, as vLLM does) so the offered load is the same for every target and
     "added latency" means the proxy's own: TTFT and ITL percentiles at the client minus direct's
  4. hold: --hold-streams concurrent slow streams opened at once; errors and RSS growth per 1,000

CPU: on a 2-core machine the proxy under test is pinned to CPU 1 and everything else (load generator,
upstreams, OTLP receiver) to CPU 0, so each proxy gets one whole core (vllm-router's tokio runtime
sizes itself to that one core too). CPU seconds are read from /proc for the proxy's process tree.
The direct row shows the load generator's own ceiling against a trivial (zero-delay) endpoint.

Run (see README "Benchmarks"):  python benchmarks/overhead.py [--quick] [--targets ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
from harness import PhaseResult, pct  # noqa: E402
from recorder_cost import recorder_cost  # noqa: E402

TARGETS = harness.TARGETS
DEFAULT_TARGETS = TARGETS[:6]
TRACED = harness.TRACED


def run_target(bench: harness.Bench, name: str, a: argparse.Namespace) -> dict:
    print(f"== {name}", flush=True)
    result: dict = {"name": name}
    with bench.running(name) as (url, proxy):
        # a short warm-up so connection pools and caches exist before anything is measured
        bench.load(url, proxy, concurrency=16, tokens=16, duration=0.5, warmup=0.5)
        for key, tokens, label in (("sat_chunks", a.sat_tokens, "saturation (long streams)"),
                                   ("sat_requests", a.short_tokens, "saturation (short streams)")):
            for _ in range(a.rounds):  # best of N: other load on a shared machine only ever lowers it
                harness.wait_quiet(a.quiet_timeout)
                r = bench.load(url, proxy, concurrency=a.sat_concurrency, tokens=tokens, duration=a.duration,
                               warmup=a.warmup)
                _say(name, label, r)
                if key not in result or r.events > result[key].events:
                    result[key] = r
        # TTFT of back-to-back single requests (zero-delay, 2 tokens): the proxy's own critical path,
        # without the wake-up cost of processes that sat idle between paced tokens (large on a VM)
        harness.wait_quiet(a.quiet_timeout)
        result["ttft_warm"] = bench.load(url, proxy, concurrency=1, tokens=2, duration=a.latency_duration,
                                         warmup=a.warmup, timings=True)
        _say(name, "TTFT back-to-back c=1", result["ttft_warm"])
        for c in a.concurrency:
            # users start spread over one answer's length, so arrivals are spread, not in lock-step
            spread = a.latency_tokens * a.itl_ms / 1000
            harness.wait_quiet(a.quiet_timeout)
            r = bench.load(url, proxy, concurrency=c, tokens=a.latency_tokens, duration=a.latency_duration,
                           warmup=max(a.warmup, spread + 0.5), itl_ms=a.itl_ms, timings=True, ramp=spread)
            result[f"lat_{c}"] = r
            _say(name, f"latency c={c}", r)
        if proxy is not None:
            result["peak_rss_mb"] = proxy.memory_mb("VmHWM")
        if a.hold_streams and proxy is not None and name in a.hold_targets:
            time.sleep(0.5)
            before = proxy.memory_mb("VmRSS")
            hold = bench.load(url, proxy, concurrency=a.hold_streams, tokens=a.hold_tokens, duration=0,
                              warmup=0, itl_ms=a.hold_itl_ms, once=True, ramp=a.hold_ramp, sample_rss=True)
            hold.rss_before_mb = before
            result["hold"] = hold
            _say(name, f"hold {a.hold_streams} streams", hold)
    if bench.spans_received is not None:
        result["spans_received"] = bench.spans_received
    return result


def _say(name: str, what: str, r: PhaseResult) -> None:
    extra = f" open={r.max_open_streams}" if r.max_open_streams else ""
    print(f"   {what:28s} {r.rps:9.0f} req/s {r.cps:10.0f} chunks/s  errors={r.errors}{extra}"
          f"  proxy_cpu={r.proxy_cpu:.2f}s client_cpu={r.client_cpu:.2f}s bg={r.background_cpu:.2f}", flush=True)


# -- report ------------------------------------------------------------------------------------


def report(results: dict[str, dict], args: argparse.Namespace, started: datetime.datetime) -> str:
    lines: list[str] = []
    out = lines.append
    direct = results.get("direct")
    out(f"pdproxy overhead benchmark  {started:%Y-%m-%d %H:%M} UTC  on {harness.machine()}")
    out(f"upstreams: benchmarks/zero_upstream.py (zero delay; latency phases paced at {args.itl_ms:g} ms/token); "
        f"prompt {args.prompt_words} words; pinning: {'proxy CPU 1, rest CPU 0' if args.pin else 'none'}")
    out(f"saturation: concurrency {args.sat_concurrency}, {args.sat_tokens} tokens (chunks/s) and "
        f"{args.short_tokens} tokens (req/s), {args.duration:g} s each, best of {args.rounds}; latency: {args.latency_tokens} tokens, "
        f"{args.latency_duration:g} s per concurrency")
    out("")
    out("| target | req/s | chunks/s | CPU s / 1k chunks | CPU ms / req | peak RSS MB | client CPU % | other CPU "
        "| errors |")
    out("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        sc, sr = r["sat_chunks"], r["sat_requests"]
        cpu = f"{sc.proxy_cpu / sc.events * 1000:.4f}" if sc.events and name != "direct" else "-"
        per_req = f"{sr.proxy_cpu / sr.requests * 1000:.3f}" if sr.requests and name != "direct" else "-"
        rss = f"{r['peak_rss_mb']:.0f}" if "peak_rss_mb" in r else "-"
        errors = sum(v.errors for k, v in r.items() if isinstance(v, PhaseResult))
        out(f"| {name} | {sr.rps:.0f} | {sc.cps:.0f} | {cpu} | {per_req} | {rss} | {sc.client_cpu / sc.seconds * 100:.0f} | "
            f"{sc.background_cpu:.2f} | {errors} |")
    out("")
    out("Latency at the client, added to direct's (ms; difference of percentiles; paced decode; TTFT warm: "
        "back-to-back single requests of 2 zero-delay tokens):")
    head = "| target | +TTFT p50/p99 warm c=1 | " + " | ".join(f"+TTFT p50/p99 c={c}" for c in args.concurrency) + " | " + \
        " | ".join(f"+ITL p50/p99 c={c}" for c in args.concurrency) + " |"
    out(head)
    out("|---|" + "---:|" * (2 * len(args.concurrency) + 1))
    def cell(name: str, r: dict, phase: str, metric: str) -> str:
        """p50 / p99 in ms: direct's own in parentheses, a target's added to direct's."""
        values, base = getattr(r[phase], metric), getattr(direct[phase], metric) if direct else []
        if name == "direct":
            return f"({pct(values, 50) / 1000:.3f} / {pct(values, 99) / 1000:.3f})" if values else "-"
        if values and base:
            return f"{(pct(values, 50) - pct(base, 50)) / 1000:+.3f} / {(pct(values, 99) - pct(base, 99)) / 1000:+.3f}"
        return "-"

    for name, r in results.items():
        cells = [cell(name, r, "ttft_warm", "ttft_us")]
        cells += [cell(name, r, f"lat_{c}", metric) for metric in ("ttft_us", "gaps_us") for c in args.concurrency]
        out(f"| {name} | " + " | ".join(cells) + " |")
    out("(direct row: absolute values in parentheses)")
    out("client CPU %: the load generator's share of its core in the chunks/s phase; other CPU: cores used by "
        "everything else (upstreams, OTLP receiver, other users of the machine) during it.")
    holds = {n: r["hold"] for n, r in results.items() if "hold" in r}
    if holds:
        out("")
        out(f"Hold: {args.hold_streams} concurrent streams ({args.hold_tokens} tokens at {args.hold_itl_ms:g} ms, "
            f"opened over {args.hold_ramp:g} s):")
        out("| target | streams open at once | completed | errors | RSS before MB | RSS peak MB | MB per 1,000 streams |")
        out("|---|---:|---:|---:|---:|---:|---:|")
        for name, h in holds.items():
            before = h.rss_before_mb
            per = (h.peak_rss_mb - before) / (args.hold_streams / 1000)
            kinds = f" {h.error_kinds}" if h.errors else ""
            out(f"| {name} | {h.max_open_streams} | {h.requests} | {h.errors}{kinds} | {before:.0f} | "
                f"{h.peak_rss_mb:.0f} | {per:.1f} |")
    pd = results.get("pdproxy")
    if pd and "spans_received" in pd:
        requests = sum(v.requests for v in pd.values() if isinstance(v, PhaseResult))
        out("")
        out(f"Tracing on: the OTLP receiver got {pd['spans_received']['spans']} spans in "
            f"{pd['spans_received']['requests']} export requests ({pd['spans_received']['bad']} undecodable) for "
            f"at least {requests} measured requests (5 spans each; warm-up and drain requests are traced too).")
    out("")
    out(ratios(results, args))
    return "\n".join(lines)


def ratios(results: dict[str, dict], args: argparse.Namespace) -> str:
    lines = ["Ratios and targets:"]
    pd, off = results.get("pdproxy"), results.get("pdproxy-off")

    def cps(name: str) -> float | None:
        r = results.get(name)
        return r["sat_chunks"].cps if r else None

    def per_cpu(name: str) -> float:
        """Chunks per CPU-second of the proxy: what it would do with its core to itself."""
        r = results[name]["sat_chunks"]
        return r.events / r.proxy_cpu

    def check(label: str, value: float | None, ok: bool | None, target: str) -> None:
        shown = "n/a" if value is None else f"{value:.2f}"
        verdict = "n/a" if ok is None else ("MET" if ok else "NOT MET")
        lines.append(f"  {label:48s} {shown:>10s}   target {target:10s} {verdict}")

    if pd:
        for peer, need in (("vllm-router", 1.0), ("direct", 0.8), ("toy-proxy", 3.0)):
            if cps(peer):
                v = cps("pdproxy") / cps(peer)
                check(f"chunks/s pdproxy / {peer}", v, v >= need, f">= {need:g}")
        for peer, need in (("vllm-router", 0.6), ("toy-proxy", None)):
            r = results.get(peer)
            if r:
                v = pd["sat_requests"].rps / r["sat_requests"].rps
                check(f"req/s pdproxy / {peer}", v, None if need is None else v >= need,
                      "(info)" if need is None else f">= {need:g}")
        sr = pd["sat_requests"]
        if sr.requests:
            v = sr.proxy_cpu / sr.requests * 1000
            check("CPU ms per request (8-token streams)", v, v <= 0.25, "<= 0.25")
        for peer in ("vllm-router", "pdproxy-off"):
            if results.get(peer) and results[peer]["sat_chunks"].proxy_cpu:
                v = per_cpu("pdproxy") / per_cpu(peer)
                check(f"chunks per CPU-second pdproxy / {peer}", v, None, "(info)")
        for cost in getattr(args, "recorder_cost", None) or ():
            added = cost["on_us"] - cost["off_us"]
            which = f"1 in {cost['stall_every']} stalls" if cost["stall_every"] else "no stalls"
            check(f"recorder µs/req on/off, {which} ({cost['on_us']:.0f} / {cost['off_us']:.0f})",
                  cost["on_us"] / cost["off_us"], None, "(info)")
            if sr.requests:  # the attribution's added µs against the whole proxy's CPU per request
                v = 1 + added / (sr.proxy_cpu / sr.requests * 1e6)
                check(f"CPU per request with attribution / without, {which}", v,
                      v <= 1.03 if not cost["stall_every"] else None, "<= 1.03" if not cost["stall_every"] else "(info)")
        noattr = results.get("pdproxy-noattr")
        if noattr and sr.requests and noattr["sat_requests"].requests:
            na = noattr["sat_requests"]
            v = (sr.proxy_cpu / sr.requests) / (na.proxy_cpu / na.requests)
            check("CPU per request, stall attribution on / off", v, v <= 1.03, "<= 1.03")
            sc, nc = pd["sat_chunks"], noattr["sat_chunks"]
            if sc.events and nc.events:
                v = (sc.proxy_cpu / sc.events) / (nc.proxy_cpu / nc.events)
                check("CPU per chunk, stall attribution on / off", v, None, "(info)")
        if off:
            v = cps("pdproxy") / cps("pdproxy-off")
            check("chunks/s tracing on / off", v, v >= 0.9, ">= 0.9")
            v = pd["sat_requests"].rps / off["sat_requests"].rps
            check("req/s tracing on / off", v, v >= 0.9, ">= 0.9")
        direct, router = results.get("direct"), results.get("vllm-router")
        if direct:
            for key, label in (("ttft_warm", "warm"), ("lat_1", "paced")):
                if key not in pd:
                    continue
                added = (pct(pd[key].ttft_us, 50) - pct(direct[key].ttft_us, 50)) / 1000
                if router:
                    peer = (pct(router[key].ttft_us, 50) - pct(direct[key].ttft_us, 50)) / 1000
                    check(f"added TTFT p50 c=1 {label} ms (vllm-router {peer:.3f})", added, added <= peer, "<= router")
                else:
                    check(f"added TTFT p50 c=1 {label} ms", added, None, "<= router")
        if direct and 256 in args.concurrency:
            added = (pct(pd["lat_256"].ttft_us, 50) - pct(direct["lat_256"].ttft_us, 50)) / 1000
            check("added TTFT p50 c=256 ms", added, added <= 5.0, "<= 5")
        if direct and 64 in args.concurrency:
            added = (pct(pd["lat_64"].gaps_us, 99) - pct(direct["lat_64"].gaps_us, 99)) / 1000
            check("added ITL p99 c=64 ms", added, added < 1.0, "< 1")
        if "hold" in pd:
            h = pd["hold"]
            per = (h.peak_rss_mb - h.rss_before_mb) / (args.hold_streams / 1000)
            check("MB per 1,000 concurrent streams", per, per < 100, "< 100")
            check(f"{args.hold_streams} streams held, errors", h.errors,
                  h.errors == 0 and h.max_open_streams >= args.hold_streams, "0")
    two = results.get("pdproxy-2w")
    if pd and two:
        check("req/s pdproxy-2w / pdproxy", two["sat_requests"].rps / pd["sat_requests"].rps, None, "(info)")
        check("chunks/s pdproxy-2w / pdproxy", cps("pdproxy-2w") / cps("pdproxy"), None, "(info)")
    lines += before_after(results)
    return "\n".join(lines)


def before_after(results: dict[str, dict]) -> list[str]:
    """pdproxy against the --baseline-path tree, both measured in this run (after / before)."""
    lines = []
    direct = results.get("direct")
    for after, before in (("pdproxy", "pdproxy-before"), ("pdproxy-off", "pdproxy-off-before")):
        a, b = results.get(after), results.get(before)
        if not (a and b):
            continue
        if not lines:
            lines += ["", "Before / after (--baseline-path tree vs this tree, same run):",
                      f"  {'':24s} {'req/s':>8s} {'chunks/s':>9s} {'CPU ms/req':>11s} {'CPU s/1k ch':>12s} "
                      f"{'+TTFT warm':>11s} {'+TTFT c=256':>12s}"]
        for name, r in ((before, b), (after, a)):
            sc, sr = r["sat_chunks"], r["sat_requests"]
            cells = [f"{sr.rps:8.0f}", f"{sc.cps:9.0f}",
                     f"{sr.proxy_cpu / sr.requests * 1000:11.3f}" if sr.requests else f"{'-':>11s}",
                     f"{sc.proxy_cpu / sc.events * 1000:12.4f}" if sc.events else f"{'-':>12s}"]
            for key, width in (("ttft_warm", 11), ("lat_256", 12)):
                if direct and key in r and r[key].ttft_us and direct[key].ttft_us:
                    cells.append(f"{(pct(r[key].ttft_us, 50) - pct(direct[key].ttft_us, 50)) / 1000:+{width}.3f}")
                else:
                    cells.append(f"{'-':>{width}s}")
            lines.append(f"  {name:24s} " + " ".join(cells))
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", choices=TARGETS,
                   help=f"default: {' '.join(DEFAULT_TARGETS)}, and the two -before targets with --baseline-path")
    p.add_argument("--quick", action="store_true", help="short phases, concurrency 1 and 64, small hold (a smoke run)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured per saturation phase")
    p.add_argument("--latency-duration", type=float, default=4.0, help="seconds measured per latency phase")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--sat-concurrency", type=int, default=128)
    p.add_argument("--sat-tokens", type=int, default=256, help="tokens per request in the chunks/s phase")
    p.add_argument("--short-tokens", type=int, default=8, help="tokens per request in the requests/s phase")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--latency-tokens", type=int, default=32)
    p.add_argument("--itl-ms", type=float, default=10.0, help="decode token period in the latency phases")
    p.add_argument("--prompt-words", type=int, default=256)
    p.add_argument("--hold-streams", type=int, help="concurrent streams of the hold phase (default 5000, --quick 500; "
                                                    "0 skips it)")
    p.add_argument("--hold-tokens", type=int, default=20)
    p.add_argument("--hold-itl-ms", type=float, default=1000.0)
    p.add_argument("--hold-ramp", type=float, default=4.0)
    p.add_argument("--hold-targets", nargs="+", choices=TARGETS, default=["pdproxy", "vllm-router"],
                   help="targets that get the hold phase (the toy proxy takes minutes to open 5,000 streams)")
    p.add_argument("--rounds", type=int, default=2, help="saturation runs per target; the best is kept")
    p.add_argument("--quiet-timeout", type=float, default=8.0,
                   help="seconds to wait before a phase for other processes on the machine to go quiet")
    p.add_argument("--workers", default="1", help="pdproxy --workers (a number, or auto: one per CPU it may use)")
    p.add_argument("--pdproxy-path", help="run pdproxy from this source tree instead (e.g. a git worktree of an "
                                          "older commit, for before/after figures)")
    p.add_argument("--baseline-path", help="also measure pdproxy from this source tree (targets pdproxy-before, "
                                           "pdproxy-off-before), for before/after ratios from one run")
    p.add_argument("--otlp-receiver", choices=("sink", "oteltap"), default="sink",
                   help="where pdproxy exports spans with tracing on (benchmarks/otlp_sink.py, or oteltap, whose "
                        "JSON printing costs the shared CPU more than the proxy's tracing)")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin processes to CPUs")
    p.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "pdproxy-bench"),
                   help="logs and the fetched toy proxy (outside the repository)")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--markdown", help="also write the report here")
    p.add_argument("--report-only", metavar="JSON", help="print the report of an earlier run's --json file")
    return p


def main() -> int:
    p = parser()
    args = p.parse_args()
    if args.report_only:
        raw = json.loads(Path(args.report_only).read_text())
        args.__dict__.update(raw.pop("_args", {}))
        results = {n: {k: (PhaseResult(**v) if isinstance(v, dict) and "events" in v else v) for k, v in r.items()}
                   for n, r in raw.items()}
        started = datetime.datetime.fromisoformat(raw_started) if (raw_started := args.__dict__.get("started")) \
            else datetime.datetime.now(datetime.timezone.utc)
        print(report(results, args, started))
        return 0
    if args.quick:
        args.duration, args.latency_duration, args.warmup, args.rounds, args.quiet_timeout = 1.5, 1.5, 0.5, 1, 0
        args.concurrency = [1, 64]
        args.hold_ramp, args.hold_tokens, args.hold_itl_ms = 0.5, 4, 200.0
    if args.targets is None:
        args.targets = list(DEFAULT_TARGETS) + (["pdproxy-before", "pdproxy-off-before"] if args.baseline_path else [])
    if any(t.endswith("-before") for t in args.targets) and not args.baseline_path:
        p.error("the -before targets need --baseline-path")
    if args.hold_streams is None:
        args.hold_streams = 500 if args.quick else 5000
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    bench = harness.Bench(args.work_dir, pin=args.pin, workers=args.workers, otlp_receiver=args.otlp_receiver,
                          pdproxy_path=args.pdproxy_path, baseline_path=args.baseline_path,
                          prompt_words=args.prompt_words)
    results: dict[str, dict] = {}
    try:
        bench.start_upstreams()
        for name in args.targets:
            results[name] = run_target(bench, name, args)
    finally:
        bench.stop_all()
    if "pdproxy-noattr" in args.targets:
        # in-process, interleaved: zero-delay streams never stall (what the phases above measured), and a
        # worst case where every 10th request stalls on a decode taking 100 requests/s
        n = 2000 if args.quick else 5000
        args.recorder_cost = [recorder_cost(rounds=3 if args.quick else 9, requests=n, stall_every=k) for k in (0, 10)]
    text = report(results, args, started)
    text += f"\n\n(total wall time {time.monotonic() - t0:.0f} s)"
    print()
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        raw = {n: {k: (v.__dict__ if isinstance(v, PhaseResult) else v) for k, v in r.items()}
               for n, r in results.items()}
        keep = ("itl_ms", "prompt_words", "pin", "sat_concurrency", "sat_tokens", "short_tokens", "duration", "rounds",
                "latency_tokens", "latency_duration", "concurrency", "hold_streams", "hold_tokens", "hold_itl_ms",
                "hold_ramp", "recorder_cost")
        raw["_args"] = {k: getattr(args, k, None) for k in keep} | {"started": started.isoformat()}
        Path(args.json).write_text(json.dumps(raw))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
