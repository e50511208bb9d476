"""What a request body costs the proxy in resident memory, per MB of body, by the body's shape.

A JSON body becomes Python objects: a long string costs about its own size, but `[{},{},...]`
is one 64-byte dict and one 8-byte list slot for every 3 bytes of input. `--max-body-bytes`'s
default is set from the worst shape measured here (docs/reference/protocol.md, "Request bodies").

Each (shape, size) gets a fresh `pdproxy serve` (single mode, a decode that reads the body and
answers one token behind it: the simulator would refuse prompts this long), so
the process's high-water RSS (`max_rss_bytes` of /debug/runtime) is that one request's peak. The
cost per body MB is the slope between two sizes, which leaves out the process's fixed footprint.

Run: python benchmarks/body_memory.py [--sizes 4 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

HOST = harness.HOST
MIB = 1 << 20


def body(shape: str, size: int) -> bytes:
    """About `size` bytes of a valid completions request whose bulk has the given shape."""
    head = '{"model": "m", "max_tokens": 1, '
    if shape == "text":
        return (head + '"prompt": "' + "a" * size + '"}').encode()
    if shape == "token ids":
        return (head + '"prompt": [' + ",".join(["12345"] * (size // 6)) + "]}").encode()
    filler = {"objects": "{}", "lists": "[]", "numbers": "0", "messages": '{"role": "user", "content": "hi"}'}[shape]
    return (head + '"prompt": "x", "extra": [' + ",".join([filler] * (size // (len(filler) + 1))) + "]}").encode()


def decode_instance(port: int) -> None:
    """The upstream: reads the whole body, answers one token."""
    from aiohttp import web

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    app = web.Application(client_max_size=1 << 34)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", lambda request: web.json_response({"status": "ok"}))
    web.run_app(app, host=HOST, port=port, print=None, access_log=None)


def peak_rss(decode_url: str, data: bytes) -> tuple[int, int]:
    """(the proxy's high-water RSS before the request, after it), in bytes."""
    with harness.Procs() as procs:
        url = procs.pdproxy("serve", "--decode", decode_url, "--debug-endpoints", "--max-body-bytes",
                            str(len(data) + MIB), "--health-check-interval", "0", "--no-tracing",
                            "--read-timeout", "120").url
        before = json.load(urllib.request.urlopen(url + "/debug/runtime"))["max_rss_bytes"]
        request = urllib.request.Request(url + "/v1/completions", data=data,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            r.read()
        after = json.load(urllib.request.urlopen(url + "/debug/runtime"))["max_rss_bytes"]
        return before, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs=2, default=(4, 16), metavar="MIB",
                        help="the two body sizes (MiB) the slope is taken between")
    parser.add_argument("--decode-port", type=int, help=argparse.SUPPRESS)  # run as the upstream
    parser.add_argument("--shapes", nargs="+", default=["text", "token ids", "numbers", "messages", "lists", "objects"])
    args = parser.parse_args()
    if args.decode_port:
        return decode_instance(args.decode_port)
    small, large = args.sizes
    decode_port = harness.free_port()
    decode_url = f"http://{HOST}:{decode_port}"
    decode = harness.Proc("decode", [sys.executable, __file__, "--decode-port", str(decode_port)])
    try:
        decode.wait_http(decode_url + "/health", timeout=30)
        print(f"{'shape':<10} {'+RSS at ' + str(small) + ' MiB':>16} {'+RSS at ' + str(large) + ' MiB':>16} "
              f"{'RSS MB per body MB':>19}")
        for shape in args.shapes:
            grown = []
            for size in (small, large):
                before, after = peak_rss(decode_url, body(shape, size * MIB))
                grown.append(after - before)
            slope = (grown[1] - grown[0]) / ((large - small) * MIB)
            print(f"{shape:<10} {grown[0] / MIB:>13.0f} MB {grown[1] / MIB:>13.0f} MB {slope:>19.1f}")
    finally:
        decode.stop()


if __name__ == "__main__":
    main()
