"""The keep-alive race against a real uvicorn (vLLM's HTTP server), side by side for two settings.

    python benchmarks/keepalive_race.py --requests 200 --server-idle 0.5

uvicorn closes a connection idle for `--server-idle` seconds (vLLM: 5 s, scaled down here). The
proxy's upstream client sends requests one at a time, each after a pause drawn around that idle
timeout, and before each send its event loop is held for a random lag of up to a third of it (a
proxy busy with other requests). A request written to a connection uvicorn has just closed meets
EOF before any answer byte: the client resends it on a new connection (counted as `resent`; each
was a 502 or a KV-dropping retry before issue 24). Run for `--upstream-keep-alive` below the
server's idle timeout (the default's ratio, 4 s vs 5 s) and above it (the old 15 s vs 5 s):
below, no request meets a closed connection. Also prints failures (must be 0) and what the server
ran (each request exactly once). Bounded: --requests per setting, one uvicorn process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
from pdproxy.upstream import UpstreamClient, UpstreamError  # noqa: E402


async def run(url: str, keepalive: float, server_idle: float, requests: int, seed: int) -> dict:
    rng = random.Random(seed)
    client = UpstreamClient(2.0, 10.0, keepalive=keepalive)
    failures, ports, served = 0, set(), []
    try:
        for _ in range(requests):
            await asyncio.sleep(rng.uniform(0.7, 1.1) * server_idle)
            time.sleep(rng.uniform(0, server_idle / 3))  # the loop lags: nothing runs, FINs wait unread
            try:
                r = await client.post(url, "/", b"{}", {"Content-Type": "application/json"})
                answer = json.loads(await r.read())
                r.release()
            except UpstreamError:
                failures += 1
                continue
            ports.add(answer["peer_port"])
            served.append(answer["request"])
    finally:
        await client.close()
    return {"keepalive": keepalive, "requests": requests, "failures": failures, "resent": client.stale_retries,
            "connections": len(ports), "ran_once": served == list(range(served[0], served[0] + len(served)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per setting (default 200)")
    parser.add_argument("--server-idle", type=float, default=0.5, help="uvicorn's --timeout-keep-alive (default 0.5)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    port = harness.free_port()
    server = harness.Proc("uvicorn", [sys.executable, str(harness.REPO / "tests" / "keepalive_backend.py"),
                                      "--port", str(port), "--timeout-keep-alive", str(args.server_idle)])
    url = f"http://{harness.HOST}:{port}"
    try:
        server.wait_http(url + "/", timeout=20)
        below, above = args.server_idle * 4 / 5, args.server_idle * 3  # 4 s vs 5 s; 15 s vs 5 s
        print(f"uvicorn closes idle connections after {args.server_idle:g}s; loop lag up to {args.server_idle / 3:.2f}s")
        print(f"{'upstream keep-alive':>20} {'requests':>9} {'failures':>9} {'resent':>7} {'connections':>12} ran once")
        for keepalive in (below, above):
            result = asyncio.run(run(url, keepalive, args.server_idle, args.requests, args.seed))
            print(f"{keepalive:>19.2f}s {result['requests']:>9} {result['failures']:>9} {result['resent']:>7} "
                  f"{result['connections']:>12} {result['ran_once']}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
