"""A vLLM-like instance whose /tokenize a test controls: passes /v1/* and /tokenize to an upstream (a simulated
instance) and journals every /tokenize body.

Run: python tests/tokenize_backend.py --port N --upstream http://127.0.0.1:M

`POST /_tokenize` sets how /tokenize answers from then on: {"mode": "forward"} (the upstream's answer; with
`tools` in the body, one more id per 4 characters of their JSON, as vLLM's chat template renders them into the
prompt: the simulator's template has no tools), {"mode": "hang"} (never answers), {"mode": "ids", "count": n}
(n ids, whatever the prompt), {"mode": "status", "status": 500}. `GET /_tokenize` answers {"calls": [bodies]}.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
from aiohttp import web


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    args = ap.parse_args()
    state: dict = {"mode": {"mode": "forward"}, "calls": [], "session": None}

    async def forward(request: web.Request) -> web.StreamResponse:
        async with state["session"].request(request.method, args.upstream + request.path, data=await request.read(),
                                            headers={"Content-Type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        state["calls"].append(body)
        mode = state["mode"]
        if mode["mode"] == "hang":
            await asyncio.sleep(3600)
        if mode["mode"] == "status":
            return web.json_response({"error": {"message": "scripted", "code": mode["status"]}}, status=mode["status"])
        if mode["mode"] == "ids":
            ids = list(range(1, mode["count"] + 1))
            return web.json_response({"count": len(ids), "max_model_len": 1 << 20, "tokens": ids})
        sim = {k: v for k, v in body.items() if k in ("model", "prompt", "messages", "add_special_tokens",
                                                        "add_generation_prompt")}
        async with state["session"].post(args.upstream + "/tokenize", json=sim) as up:
            answer = await up.json()
            if up.status != 200:
                return web.json_response(answer, status=up.status)
        extra = len(json.dumps(body["tools"])) // 4 if body.get("tools") else 0
        answer["tokens"] += [7] * extra
        answer["count"] = len(answer["tokens"])
        return web.json_response(answer)

    async def set_mode(request: web.Request) -> web.Response:
        state["mode"] = await request.json()
        return web.json_response({"ok": True})

    async def journal(request: web.Request) -> web.Response:
        return web.json_response({"calls": state["calls"]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start(app: web.Application) -> None:
        state["session"] = aiohttp.ClientSession()

    async def stop(app: web.Application) -> None:
        await state["session"].close()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/v1/{tail:.*}", forward)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/_tokenize", set_mode)
    app.router.add_get("/_tokenize", journal)
    app.router.add_get("/health", health)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
