"""Hostile model names: /metrics series and the proxy's memory before and after N made-up names.

    python benchmarks/cardinality.py --names 10000

A client may write any `model` into its request. Starts one simulated instance (`pdproxy sim`,
which serves `sim-model` and answers 404 for any other name) and a proxy in front of it, warms
both up with requests for the served model and for a few made-up names, then sends --names
requests, each for a model name nobody serves, --concurrency at a time. Prints, before and after,
the number of series in `/metrics`, its size, the proxy's resident memory (VmRSS), and the values
the `model` label takes; `--json` prints the same as one JSON object (tests/test_cardinality.py
reads it). Bounded: --names requests, each with a 30 s timeout, then everything it started stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

SERVED = "sim-model"


def snapshot(url: str, pid: int) -> dict:
    """Series in /metrics (every sample line), its size, the proxy's RSS, the `model` label's values."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    series, models = 0, set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series += 1
            if "model" in sample.labels:
                models.add(sample.labels["model"])
    return {"series": series, "metrics_bytes": len(text.encode()), "rss_bytes": harness.rss_bytes(pid),
            "model_labels": sorted(models)}


def made_up(i: int, rng: random.Random) -> str:
    return f"hostile-{i}-" + "".join(rng.choices(string.ascii_lowercase + string.digits, k=24))


async def send(url: str, models: list[str], concurrency: int, stream: bool = False) -> dict[int, int]:
    """One request per name, `concurrency` at a time; returns how many got each status."""
    statuses: dict[int, int] = {}
    queue = list(reversed(models))
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def worker() -> None:
            while queue:
                body = {"model": queue.pop(), "prompt": "hello there", "max_tokens": 2, "stream": stream}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


def run(names: int, concurrency: int, seed: int, logs_dir: str | None = None) -> dict:
    rng = random.Random(seed)
    logs = Path(logs_dir or tempfile.mkdtemp(prefix="pdproxy-cardinality-"))
    with harness.Procs() as procs:
        sim = procs.pdproxy("sim", "--role", "single", "--model", SERVED, "--time-scale", "0.05", log=logs / "sim.log")
        proxy = procs.pdproxy("serve", "--decode", sim.url, "--log-level", "warning", log=logs / "proxy.log")
        url = proxy.url
        # warm-up: every label set the load will touch exists already (served model streamed and whole,
        # made-up names failing with the instance's 404), and the allocator has settled
        for stream in (False, True):
            asyncio.run(send(url, [SERVED] * 100, concurrency, stream))
        asyncio.run(send(url, [made_up(-i, rng) for i in range(1, 501)], concurrency))
        before = snapshot(url, proxy.pid)
        t0 = time.monotonic()
        statuses = asyncio.run(send(url, [made_up(i, rng) for i in range(names)], concurrency))
        wall = time.monotonic() - t0
        served = asyncio.run(send(url, [SERVED] * 20, concurrency))  # the served model still gets its own label
        after = snapshot(url, proxy.pid)
        return {"names": names, "statuses": {str(k): v for k, v in sorted(statuses.items())},
                "served_statuses": {str(k): v for k, v in served.items()}, "seconds": round(wall, 1),
                "before": before, "after": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--names", type=int, default=10_000, help="distinct made-up model names to send (10000)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", help="where the processes' logs go (default: a new directory under the temporary one)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    result = run(args.names, args.concurrency, args.seed, args.logs)
    if args.json:
        print(json.dumps(result))
        return
    b, a = result["before"], result["after"]
    print(f"{result['names']} requests with distinct made-up model names in {result['seconds']} s; "
          f"statuses {result['statuses']}")
    print(f"{'':24s}{'before':>14s}{'after':>14s}")
    print(f"{'/metrics series':24s}{b['series']:>14d}{a['series']:>14d}")
    print(f"{'/metrics bytes':24s}{b['metrics_bytes']:>14d}{a['metrics_bytes']:>14d}")
    print(f"{'proxy RSS (MiB)':24s}{b['rss_bytes'] / 2**20:>14.1f}{a['rss_bytes'] / 2**20:>14.1f}")
    shown = a["model_labels"][:5]
    more = len(a["model_labels"]) - len(shown)
    print(f"model label values after: {len(a['model_labels'])} ({', '.join(shown)}{f', … {more} more' if more else ''})")


if __name__ == "__main__":
    main()
