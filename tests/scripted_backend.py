"""A scripted vLLM-like instance for proxy tests: exact bytes, exact faults, a journal.

Run: python tests/scripted_backend.py --port N [--port M ...] --role prefill|decode

Several ports make several instances that share one script and one journal (each entry says
which port it came in on), so "the first attempt fails, whichever instance it reaches" is exact.

By default it answers like a vLLM instance of its role (a prefill returns `kv_transfer_params`,
a decode streams a fixed SSE body). Tests queue exact answers with `POST /_script` (a list of
steps, one consumed per inference request) and read what arrived with `GET /_journal`.
A step may set: status, headers, body (JSON or string), chunks (list of strings written one by
one), repeat (send the chunks that many times), hold (answer only once a test posts /_release),
delay (before the status line), chunk_delay, stall_after (chunks before a long pause),
abort_after (chunks before the connection is cut), drop (close the connection without answering),
flood ([string, times]: written that many times after the chunks).
`--delay` and `--chunk-delay` set the defaults for requests without a step. `--echo-model` answers
every request as the model it asked for (some OpenAI-compatible servers do), while /v1/models
still lists only `scripted-model`. `GET /metrics` answers 404 until a test posts an exposition to
`/_metrics` ({"text": ..., "repeat": n}: the text n times, for hostile sizes without uploading them).
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

PREFILL_KV = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "engine-p",
    "remote_request_id": "cmpl-x-0-abcd1234", "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1,
}


def default_stream(rid: str, chat: bool, model: str | None = None) -> list[str]:
    rid = ("chatcmpl-" if chat else "cmpl-") + rid
    named = {"model": model} if model is not None else {}
    chunks = []
    if chat:  # vLLM opens a chat stream with a role-only delta
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        chunks.append("data: " + json.dumps({"id": rid, **named, "choices": [role]}) + "\n\n")
    for word in ["Hello", " P/D", " world", "!"]:
        choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
        chunks.append("data: " + json.dumps({"id": rid, **named, "choices": [{**choice, "finish_reason": None}]})
                      + "\n\n")
    chunks.append('data: {"id":"x","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":4,"total_tokens":8}}\n\n')
    chunks.append("data: [DONE]\n\n")
    return chunks


class Backend:
    def __init__(self, role: str, delay: float = 0.0, chunk_delay: float = 0.005, echo_model: bool = False) -> None:
        self.role = role
        self.echo_model = echo_model
        self.defaults = {"delay": delay, "chunk_delay": chunk_delay}
        self.script: list[dict] = []
        self.journal: list[dict] = []
        self.released = asyncio.Event()  # held steps wait for it
        self.metrics: bytes | None = None  # GET /metrics answers this, once set

    async def inference(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        entry = {"path": request.path, "headers": {k.lower(): v for k, v in request.headers.items()}, "body": body,
                 "peer": list(request.transport.get_extra_info("peername") or ()), "completed": False, "aborted": False,
                 "port": (request.transport.get_extra_info("sockname") or (None, None))[1]}
        self.journal.append(entry)
        step = self.script.pop(0) if self.script else {}
        step = {**self.defaults, **step}
        try:
            response = await self._answer(request, step, body or {})
            entry["completed"] = True
            return response
        except (asyncio.CancelledError, ConnectionError):
            entry["aborted"] = True  # the proxy went away mid-answer
            raise

    async def _answer(self, request: web.Request, step: dict, body: dict) -> web.StreamResponse:
        if step.get("hold"):
            await self.released.wait()
        await asyncio.sleep(step.get("delay", 0))
        if step.get("drop"):
            request.transport.close()
            return web.Response(status=500)  # never reaches the proxy
        rid = request.headers.get("X-Request-Id", "none")
        chat = request.path.endswith("chat/completions")
        status = step.get("status", 200)
        headers = step.get("headers", {})
        model = body.get("model") if self.echo_model and isinstance(body.get("model"), str) else None
        if "chunks" not in step and (status != 200 or "body" in step or self.role == "prefill" or not body.get("stream")):
            answer = step.get("body")
            if answer is None:
                answer = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "object": "text_completion",
                          "choices": [{"index": 0, "text": "Hello", "finish_reason": "length"}],
                          "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
                if model is not None:
                    answer["model"] = model
                if self.role == "prefill":
                    answer["kv_transfer_params"] = PREFILL_KV
            text = answer if isinstance(answer, str) else json.dumps(answer)
            return web.Response(status=status, text=text, headers={"Content-Type": "application/json", **headers})
        response = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream", **headers})
        await response.prepare(request)
        chunks = (step.get("chunks") or default_stream(rid, chat, model)) * step.get("repeat", 1)
        for i, chunk in enumerate(chunks):
            if i == step.get("abort_after"):
                request.transport.abort()
                return response
            if i == step.get("stall_after"):
                await asyncio.sleep(step.get("stall", 30))
            await asyncio.sleep(step.get("chunk_delay", 0.005))
            await response.write(chunk.encode())
        flood, times = step.get("flood", ("", 0))
        for _ in range(times):  # a large answer from a small script
            await response.write(flood.encode())
        await response.write_eof()
        return response

    async def set_script(self, request: web.Request) -> web.Response:
        self.script = list(await request.json())
        return web.json_response({"queued": len(self.script)})

    async def set_metrics(self, request: web.Request) -> web.Response:
        step = await request.json()
        self.metrics = step["text"].encode() * step.get("repeat", 1)
        return web.json_response({"bytes": len(self.metrics)})

    async def get_metrics(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            raise web.HTTPNotFound()
        return web.Response(body=self.metrics, content_type="text/plain")

    async def get_journal(self, request: web.Request) -> web.Response:
        return web.json_response(self.journal)

    async def reset(self, request: web.Request) -> web.Response:
        self.script.clear()
        self.journal.clear()
        self.released = asyncio.Event()
        return web.json_response({})

    async def release(self, request: web.Request) -> web.Response:
        self.released.set()
        return web.json_response({})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, action="append", required=True, help="repeat for more instances")
    parser.add_argument("--role", choices=("prefill", "decode"), default="decode")
    parser.add_argument("--delay", type=float, default=0.0, help="default delay before the status line")
    parser.add_argument("--chunk-delay", type=float, default=0.005, help="default pause before each chunk")
    parser.add_argument("--echo-model", action="store_true", help="answer as whatever model was requested")
    args = parser.parse_args()
    backend = Backend(args.role, args.delay, args.chunk_delay, args.echo_model)
    app = web.Application(client_max_size=64 << 20)  # vLLM sets no limit; the proxy's own is what tests probe
    app.router.add_post("/v1/completions", backend.inference)
    app.router.add_post("/v1/chat/completions", backend.inference)
    app.router.add_post("/tokenize", backend.inference)  # scripted like the rest (a hold, a status)
    app.router.add_post("/detokenize", backend.inference)
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    app.router.add_get("/v1/models", lambda r: web.json_response(
        {"object": "list", "data": [{"id": "scripted-model", "object": "model", "owned_by": "vllm"}]}))
    app.router.add_post("/_script", backend.set_script)
    app.router.add_get("/_journal", backend.get_journal)
    app.router.add_post("/_metrics", backend.set_metrics)
    app.router.add_get("/metrics", backend.get_metrics)
    app.router.add_post("/_reset", backend.reset)
    app.router.add_post("/_release", backend.release)
    asyncio.run(_serve(app, args.port))


async def _serve(app: web.Application, ports: list[int]) -> None:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    main()
