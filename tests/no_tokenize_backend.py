"""An OpenAI-compatible server without /tokenize: passes /v1/* to an upstream (a simulated instance), 404s
the rest, like servers that do not have vLLM's extra endpoints."""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    args = ap.parse_args()
    session: aiohttp.ClientSession | None = None

    async def forward(request: web.Request) -> web.StreamResponse:
        assert session is not None
        async with session.request(request.method, args.upstream + request.path, data=await request.read(),
                                   headers={"Content-Type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start(app: web.Application) -> None:
        nonlocal session
        session = aiohttp.ClientSession()

    async def stop(app: web.Application) -> None:
        if session is not None:
            await session.close()

    app = web.Application()
    app.router.add_route("*", "/v1/{tail:.*}", forward)
    app.router.add_get("/health", health)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
