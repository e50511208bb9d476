"""How long one large chat body holds the proxy's event loop: every other request waits that long.

A chat of N empty messages (`{}` each, 3 bytes: 2.7 million in 8 MB, under --max-body-bytes) is the
most objects per byte a client can send. The decode answers 400 at once (it reads the bytes and
refuses), so what is measured is the proxy's own work on the body: reading, parsing, checking,
routing, writing the leg. Meanwhile a second connection asks `/healthcheck` back to back; the
longest of those answers is the stall every request saw.

Each tree (this one; --baseline-path another, e.g. `git archive fc21030 | tar -x -C DIR`) gets its own
`pdproxy serve` in single mode; the rounds alternate between them, and the report gives each one's
median stall and the ratio this / baseline. Also the stall of a body given as one long string of the
same size, for scale (a string is one object: its parse is a copy).

Run: python benchmarks/big_body_stall.py [--baseline-path DIR] [--messages 2700000] [--rounds 3]
     [--policy round_robin]
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

HOST = harness.HOST
REFUSAL = (b'{"error":{"message":"refused at once","type":"BadRequestError","param":null,"code":400}}')


def refusing_decode(port: int) -> None:
    """The upstream: reads the body, answers vLLM's 400 shape at once."""
    from aiohttp import web

    async def refuse(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=400, body=REFUSAL, content_type="application/json")

    app = web.Application(client_max_size=1 << 34)
    app.router.add_post("/v1/chat/completions", refuse)
    app.router.add_post("/v1/completions", refuse)
    app.router.add_get("/health", lambda request: web.json_response({"status": "ok"}))
    app.router.add_get("/v1/models", lambda request: web.json_response(
        {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 1 << 24}]}))
    web.run_app(app, host=HOST, port=port, print=None, access_log=None)


def chat_body(messages: int) -> bytes:
    return b'{"model":"m","max_tokens":4,"messages":[' + b",".join([b"{}"] * messages) + b"]}"


def string_body(size: int) -> bytes:
    return b'{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"' + b"a" * size + b'"}]}'


def stall(url: str, data: bytes) -> tuple[float, float, int]:
    """(the longest /healthcheck answer while the body was served, the body's own round trip, its status)."""
    host, port = url.split("//")[1].split(":")
    done = threading.Event()
    longest = [0.0]

    def poll() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        while not done.is_set():
            t = time.perf_counter()
            conn.request("GET", "/healthcheck")
            conn.getresponse().read()
            longest[0] = max(longest[0], time.perf_counter() - t)
        conn.close()

    warm = http.client.HTTPConnection(host, int(port), timeout=60)
    warm.request("GET", "/healthcheck")
    warm.getresponse().read()
    warm.close()
    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    t = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    took = time.perf_counter() - t
    conn.close()
    time.sleep(0.2)
    done.set()
    poller.join()
    return longest[0], took, resp.status


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-path", help="a source tree to measure beside this one (e.g. fc21030, git archive)")
    p.add_argument("--pdproxy-path", default=str(harness.REPO), help="the tree measured (default: this one)")
    p.add_argument("--messages", type=int, default=2_700_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policy", default="round_robin")
    args = p.parse_args()
    bodies = {"chat of empty messages": chat_body(args.messages)}
    bodies["one long string"] = string_body(len(bodies["chat of empty messages"]))
    trees = {"this": args.pdproxy_path, **({"baseline": args.baseline_path} if args.baseline_path else {})}
    results: dict[tuple[str, str], list[float]] = {}
    with harness.Procs() as procs:
        dport = harness.free_port()
        decode = procs.start("decode", [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(harness.HERE)!r}); "
                                        f"from big_body_stall import refusing_decode; refusing_decode({dport})"])
        decode.wait_http(f"http://{HOST}:{dport}/health")
        proxies = {}
        for label, tree in trees.items():
            proxies[label] = procs.pdproxy("serve", "--decode", f"http://{HOST}:{dport}", "--policy", args.policy,
                                           "--max-body-bytes", str(16 << 20), "--health-check-interval", "0",
                                           "--no-tracing", cwd=tree, env={"PYTHONPATH": tree})
        for r in range(args.rounds):
            for label, proc in proxies.items():
                for shape, data in bodies.items():
                    longest, took, status = stall(proc.url, data)
                    results.setdefault((label, shape), []).append(longest)
                    print(f"round {r + 1} {label:8s} {shape:24s} {len(data) / 1e6:.1f} MB: status {status}, "
                          f"round trip {took:.2f} s, longest /healthcheck {longest:.3f} s", flush=True)
    print(f"\nLongest /healthcheck while one body was served (median of {args.rounds} interleaved rounds, "
          f"--policy {args.policy}):")
    print("| body | " + " | ".join(trees) + (" | this / baseline |" if len(trees) > 1 else " |"))
    print("|---|" + "---:|" * (len(trees) + (len(trees) > 1)))
    for shape in bodies:
        meds = [statistics.median(results[(label, shape)]) for label in trees]
        ratio = f" | {meds[0] / meds[1]:.2f}" if len(meds) > 1 else ""
        print(f"| {shape} | " + " | ".join(f"{m:.3f} s" for m in meds) + ratio + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
