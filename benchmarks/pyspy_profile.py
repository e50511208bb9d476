"""Where pdproxy's CPU goes per request: py-spy on the proxy under overhead.py's saturation load.

The same set-up as benchmarks/overhead.py (zero-delay upstreams, the OTLP receiver, pinning on a
2-core machine), one target, one closed-loop phase; py-spy samples the proxy's process while the
load generator runs, and the samples are summed by the pdproxy function (or library) they were
spent in: self time by frame, and inclusive time by the outermost pdproxy frame of each stack.

Run:  python benchmarks/pyspy_profile.py [--tokens 8] [--concurrency 32] [--duration 6] [--no-tracing]
      [--pdproxy-path TREE]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)


def frames(line: str) -> tuple[list[str], int]:
    """One line of py-spy's collapsed (`raw`) output: its frames, outermost first, and its samples."""
    stack, _, count = line.rstrip().rpartition(" ")
    return [f for f in stack.split(";") if f], int(count)


def where(frame: str) -> str:
    """`function (file:line)` reduced to `module.function`, pdproxy's own files by their package path."""
    name, _, rest = frame.partition(" (")
    path = rest.split(":")[0]
    parts = path.split("/")
    if "pdproxy" in parts[:-1]:
        module = "/".join(parts[parts.index("pdproxy"):]).removesuffix(".py").replace("/", ".")
        return f"{module}.{name}"
    for lib in ("aiohttp", "asyncio", "uvloop", "json", "orjson"):
        if lib in parts[:-1]:
            return f"{lib}.{name}"
    return f"{Path(path).name}:{name}" if path else name


def summarise(raw: str, top: int) -> str:
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        stack, count = frames(line)
        total += count
        if stack:
            self_time[where(stack[-1])] += count
        seen = set()
        for f in stack:  # every pdproxy function on the stack, once per sample
            w = where(f)
            if w.startswith("pdproxy.") and w not in seen:
                seen.add(w)
                inclusive[w] += count
    out = [f"{total} samples", "", "self time (innermost frame):"]
    out += [f"  {100 * c / total:5.1f} %  {w}" for w, c in self_time.most_common(top)]
    out += ["", "inclusive (pdproxy functions on the stack):"]
    out += [f"  {100 * c / total:5.1f} %  {w}" for w, c in inclusive.most_common(top)]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--no-tracing", dest="tracing", action="store_false")
    p.add_argument("--pdproxy-path", help="profile pdproxy from this source tree")
    p.add_argument("--no-pin", dest="pin", action="store_false")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--work-dir", default="/tmp/pdproxy-profile")
    args = p.parse_args()
    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    bench = harness.Bench(args.work_dir, pin=args.pin, pdproxy_path=args.pdproxy_path)
    bench.start_upstreams()
    target = "pdproxy" if args.tracing else "pdproxy-off"
    raw_out = Path(args.work_dir) / "profile.txt"
    try:
        with bench.running(target) as (url, proxy):
            bench.load(url, proxy, concurrency=args.concurrency, tokens=args.tokens, duration=2.0, warmup=0.5)
            (pid,) = proxy.pids()[:1]
            cmd = [spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--duration", str(int(args.duration)),
                   "--nonblocking", "--format", "raw", "--output", str(raw_out)]
            spying = subprocess.Popen(harness.placed(cmd, bench.other_cpus), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            results: list[harness.PhaseResult] = []
            loading = threading.Thread(target=lambda: results.append(bench.load(
                url, proxy, concurrency=args.concurrency, tokens=args.tokens, duration=args.duration, warmup=0.5)))
            loading.start()
            spying.wait(timeout=args.duration + 60)
            loading.join()
            (r,) = results
            print(f"{target}: {r.rps:.0f} req/s, {r.proxy_cpu / max(r.requests, 1) * 1000:.3f} ms CPU per request "
                  f"({args.tokens}-token streams, concurrency {args.concurrency}), errors {r.errors}")
            print(summarise(raw_out.read_text(), args.top))
    finally:
        bench.stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
