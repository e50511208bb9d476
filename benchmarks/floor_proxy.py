"""The floor of pdproxy's design: the least a server with pdproxy's upstream client does per P/D
request (read the body, prefill leg, decode leg with the KV parameters spliced in, relay the
stream). No checks, no limits, no telemetry, no retries: not a proxy anyone should run, only the
measure of what the HTTP server and the legs cost before any of pdproxy's own work
(benchmarks/cpu_per_request.py).

Two servers, to tell the server's share from the legs':
  aiohttp   aiohttp's web server, as pdproxy served the inference routes until issue 32's third round
            (target `floor`)
  httptools a bare asyncio protocol on llhttp, writing the response bytes itself: keep-alive and
            chunked encoding only (target `floor-lean`); what a minimal server costs, the model of
            pdproxy's own lean server (pdproxy/serving/lean.py)

Run: python benchmarks/floor_proxy.py PREFILL_URL DECODE_URL PORT [aiohttp|httptools]
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httptools
import uvloop
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdproxy.upstream import Response, UpstreamClient  # noqa: E402

P, D, PORT = sys.argv[1], sys.argv[2], int(sys.argv[3])
SERVER = sys.argv[4] if len(sys.argv) > 4 else "aiohttp"
H = {"Content-Type": "application/json"}
up: UpstreamClient


async def legs(raw: bytes) -> Response:
    """The prefill leg, then the decode leg with the prefill's KV parameters; the decode's open answer."""
    body = json.loads(raw)
    pb = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    pb.pop("stream_options", None)
    r = await up.post(P, "/v1/completions", json.dumps(pb).encode(), H)
    ans = await r.read()
    r.release()
    kv = json.loads(ans).get("kv_transfer_params")
    end = raw.rindex(b"}")
    payload = raw[:end] + b',"kv_transfer_params":' + json.dumps(kv).encode() + raw[end:]
    return await up.post(D, "/v1/completions", payload, H)


async def handle(request: web.Request) -> web.StreamResponse:
    d = await legs(await request.read())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    while data := await d.readany():
        await resp.write(data)
    d.release()
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


class BareProtocol(asyncio.Protocol):
    """One connection, one request at a time (the load generator does not pipeline)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        raw, url = b"".join(self.body), self.url
        self.body, self.url = [], b""
        if url == b"/health":
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        else:
            asyncio.get_running_loop().create_task(self.relay(raw))

    async def relay(self, raw: bytes) -> None:
        d = await legs(raw)
        write = self.transport.write
        write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        while data := await d.readany():
            write(b"%x\r\n%s\r\n" % (len(data), data))
        d.release()
        write(b"0\r\n\r\n")


async def main() -> None:
    global up
    up = UpstreamClient(5.0, 60.0, keepalive=4.0)
    if SERVER == "httptools":
        await asyncio.get_running_loop().create_server(BareProtocol, "127.0.0.1", PORT, backlog=4096)
    else:
        app = web.Application()
        app.router.add_post("/v1/completions", handle)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", PORT).start()
    await asyncio.Event().wait()


uvloop.run(main())
