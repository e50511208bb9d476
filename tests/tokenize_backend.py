"""A vLLM-like instance whose /tokenize a test controls: passes /v1/* and /tokenize to an upstream (a simulated
instance) and journals every /tokenize body.

Run: python tests/tokenize_backend.py --port N --upstream http://127.0.0.1:M

`POST /_tokenize` sets how /tokenize answers from then on: {"mode": "forward"} (the upstream's answer; with
`tools` in the body, one more id per 4 characters of their JSON, as vLLM's chat template renders them into the
prompt: the simulator's template has no tools), {"mode": "hang"} (never answers), {"mode": "ids", "count": n}
(n ids, whatever the prompt), {"mode": "status", "status": 500}, {"mode": "slow", "seconds_per_kib": s} (forwards
after s seconds per KiB of the ask: a tokenizer's time grows with its input). `GET /_tokenize` answers
{"calls": [bodies]}.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

from no_tokenize_backend import SESSION, passthrough


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    args = ap.parse_args()
    state: dict = {"mode": {"mode": "forward"}, "calls": []}

    async def tokenize(request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw)
        state["calls"].append(body)
        mode = state["mode"]
        if mode["mode"] == "slow":
            await asyncio.sleep(len(raw) / 1024 * mode["seconds_per_kib"])
        if mode["mode"] == "hang":
            await asyncio.sleep(3600)
        if mode["mode"] == "status":
            return web.json_response({"error": {"message": "scripted", "code": mode["status"]}}, status=mode["status"])
        if mode["mode"] == "ids":
            ids = list(range(1, mode["count"] + 1))
            return web.json_response({"count": len(ids), "max_model_len": 1 << 20, "tokens": ids})
        sim = {k: v for k, v in body.items() if k in ("model", "prompt", "messages", "add_special_tokens",
                                                        "add_generation_prompt")}
        async with request.app[SESSION].post(args.upstream + "/tokenize", json=sim) as up:
            answer = await up.json()
            if up.status != 200:
                return web.json_response(answer, status=up.status)
        answer["tokens"] += [7] * (len(json.dumps(body["tools"])) // 4 if body.get("tools") else 0)
        answer["count"] = len(answer["tokens"])
        return web.json_response(answer)

    async def set_mode(request: web.Request) -> web.Response:
        state["mode"] = await request.json()
        return web.json_response({"ok": True})

    async def journal(request: web.Request) -> web.Response:
        return web.json_response({"calls": state["calls"]})

    app = passthrough(args.upstream)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/_tokenize", set_mode)
    app.router.add_get("/_tokenize", journal)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
