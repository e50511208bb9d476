"""An OpenAI-compatible server without /tokenize: passes /v1/* to an upstream (a simulated instance), 404s
the rest, like servers that do not have vLLM's extra endpoints."""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


def passthrough(upstream: str) -> web.Application:
    """The app: /v1/* passed to `upstream` as it is, /health; `app[SESSION]` is its client (for added routes)."""

    async def forward(request: web.Request) -> web.StreamResponse:
        async with request.app[SESSION].request(request.method, upstream + request.path, data=await request.read(),
                                                headers={"Content-Type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def session(app: web.Application):
        app[SESSION] = aiohttp.ClientSession()
        yield
        await app[SESSION].close()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/v1/{tail:.*}", forward)
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(session)
    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    args = ap.parse_args()
    web.run_app(passthrough(args.upstream), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
