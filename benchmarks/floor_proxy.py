"""The floor of pdproxy's design: the least an aiohttp server with pdproxy's upstream client does per
P/D request (read the body, prefill leg, decode leg with the KV parameters spliced in, relay the
stream). No checks, no limits, no telemetry, no retries: not a proxy anyone should run, only the
measure of what aiohttp and the legs cost before any of pdproxy's own work (benchmarks/cpu_per_request.py).

Run: python benchmarks/floor_proxy.py PREFILL_URL DECODE_URL PORT
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import uvloop
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdproxy.upstream import UpstreamClient  # noqa: E402

P, D, PORT = sys.argv[1], sys.argv[2], int(sys.argv[3])
H = {"Content-Type": "application/json"}

async def handle(request):
    raw = await request.read()
    body = json.loads(raw)
    up = request.app["up"]
    pb = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    pb.pop("stream_options", None)
    r = await up.post(P, "/v1/completions", json.dumps(pb).encode(), H)
    ans = await r.read()
    r.release()
    kv = json.loads(ans).get("kv_transfer_params")
    end = raw.rindex(b"}")
    payload = raw[:end] + b',"kv_transfer_params":' + json.dumps(kv).encode() + raw[end:]
    d = await up.post(D, "/v1/completions", payload, H)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    while True:
        data = await d.readany()
        if not data:
            break
        await resp.write(data)
    d.release()
    await resp.write_eof()
    return resp

async def health(request):
    return web.Response(text="ok")

async def main():
    app = web.Application()
    app["up"] = UpstreamClient(5.0, 60.0, keepalive=4.0)
    app.router.add_post("/v1/completions", handle)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", PORT).start()
    await asyncio.Event().wait()

uvloop.run(main())
