"""A zero-delay vLLM-shaped instance for measuring proxies: prefill answers at once, decode streams
as fast as the process can write.

Why not `pdproxy sim --preset instant`: the simulator is a full aiohttp application with an engine
model, and on a 2-core machine the upstream shares the CPU with the load generator and the proxy
under test. A raw uvloop protocol costs a few microseconds per event, so the proxy stays the
bottleneck and the "direct to decode" ceiling is set by the machine, not by the simulator.

Protocol (what a proxy needs to see): POST /v1/completions and /v1/chat/completions.
* prefill (`--role prefill`, or any non-streamed request): one JSON answer of one token with
  NIXL-shaped `kv_transfer_params`;
* decode: an SSE stream of `max_tokens` token events in vLLM's compact JSON, then a usage event when
  `stream_options.include_usage` is set (usage on every event with `continuous_usage_stats`), then
  `data: [DONE]`. Zero delay (`--itl-ms 0`): one event per stream per engine tick, a tick being
  one loop iteration. Paced (`--itl-ms N`, or per request with the extra body field
  `bench_itl_ms`, which every proxy forwards untouched): the first token at once, then one every N ms
  on the stream's own fixed-rate clock, so TTFT and ITL at the client are the upstream's plus
  whatever the path in between adds. Slow readers are paused by TCP back-pressure, never buffered
  without bound.
GET /health and /v1/models answer 200.

Run: python benchmarks/zero_upstream.py --role decode --port 8200 [--itl-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rawhttp beside it, also under PYTHONSAFEPATH=1 (CI)

from rawhttp import serve, take_requests

WORDS = [b" alpha", b" beta", b" gamma", b" delta", b" eps", b" zeta", b" eta", b" theta"]
CREATED = int(time.time())


class Engine:
    """Zero-delay streams; one `tick` (one loop iteration) writes one event to each of them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.active: dict[Stream, None] = {}  # insertion-ordered set: the same order every tick
        self.scheduled = False

    def add(self, stream: Stream) -> None:
        self.active[stream] = None
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.tick)

    def remove(self, stream: Stream) -> None:
        self.active.pop(stream, None)

    def tick(self) -> None:
        for stream in list(self.active):
            if not stream.paused and stream.step():
                self.active.pop(stream, None)
        if self.active:
            self.loop.call_soon(self.tick)
        else:
            self.scheduled = False


class Pacer:
    """A paced stream: first token at once, then one every `itl` seconds from its start (no drift)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: Stream, itl: float) -> None:
        self.loop, self.stream, self.itl = loop, stream, itl
        self.start = loop.time()
        self.k = 0
        self.handle: asyncio.TimerHandle | None = None
        self.tick()

    def tick(self) -> None:
        if self.stream.step():
            return
        self.k += 1
        self.handle = self.loop.call_at(self.start + self.k * self.itl, self.tick)

    def remove(self, stream: Stream) -> None:
        if self.handle is not None:
            self.handle.cancel()


class Stream:
    """One streamed response: pre-rendered event halves, so a tick only joins bytes."""

    __slots__ = ("proto", "left", "total", "i", "head", "tail", "usage_each", "usage_end", "prompt_tokens", "chat",
                 "paused", "engine")

    def __init__(self, proto: Upstream, rid: str, model: str, chat: bool, tokens: int, prompt_tokens: int,
                 usage_each: bool, usage_end: bool) -> None:
        self.proto = proto
        self.left = self.total = tokens
        self.i = 0
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        self.usage_each, self.usage_end = usage_each, usage_end
        self.paused = False
        self.engine: Engine | Pacer | None = None
        if chat:
            self.head = (b'data: {"id":"chatcmpl-' + rid.encode() + b'","object":"chat.completion.chunk","created":'
                         + str(CREATED).encode() + b',"model":' + json.dumps(model).encode()
                         + b',"choices":[{"index":0,"delta":{"content":"')
            self.tail = b'"},"logprobs":null,"finish_reason":'
        else:
            self.head = (b'data: {"id":"cmpl-' + rid.encode() + b'","object":"text_completion","created":'
                         + str(CREATED).encode() + b',"model":' + json.dumps(model).encode()
                         + b',"choices":[{"index":0,"text":"')
            self.tail = b'","logprobs":null,"finish_reason":'

    def _usage(self, completion: int) -> bytes:
        return (b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}'
                % (self.prompt_tokens, self.prompt_tokens + completion, completion))

    def step(self) -> bool:
        """Write the next event; True when the stream is complete."""
        if self.left == 0:  # the closing events
            out = b""
            if self.usage_end:
                out = (self.head.split(b',"choices":', 1)[0] + b',"choices":[],"usage":' + self._usage(self.total)
                       + b"}\n\n")
            self.proto.chunk(out + b"data: [DONE]\n\n")
            self.proto.end_chunks()
            return True
        self.i += 1
        self.left -= 1
        finish = b'"length"' if self.left == 0 else b"null"
        event = self.head + WORDS[self.i & 7] + self.tail + finish
        if self.chat:
            event += b"}]"
        else:
            event += b',"stop_reason":null}]'
        if self.usage_each:
            event += b',"usage":' + self._usage(self.i)
        self.proto.chunk(event + b"}\n\n")
        return False


class Upstream(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection (no pipelining: clients wait for each answer)."""

    def __init__(self, role: str, engine: Engine, default_itl: float, kv_host: str) -> None:
        self.role = role
        self.engine = engine
        self.default_itl = default_itl
        self.kv_host = kv_host
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.stream: Stream | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            if self.stream.engine is not None:
                self.stream.engine.remove(self.stream)
            self.stream = None

    def pause_writing(self) -> None:
        if self.stream is not None:
            self.stream.paused = True

    def resume_writing(self) -> None:
        if self.stream is not None:
            self.stream.paused = False

    def data_received(self, data: bytes) -> None:
        requests, self.buffer = take_requests(self.buffer + data)
        for request_line, headers, body in requests:
            method, path, _ = request_line.split(" ", 2)
            self.handle(method, path, body, headers.get("x-request-id"))

    def handle(self, method: str, path: str, body: bytes, rid: str | None) -> None:
        if method == "GET":
            if path.startswith("/v1/models"):
                self.respond(200, b'{"object":"list","data":[{"id":"bench-model","object":"model","owned_by":"vllm"}]}')
            else:
                self.respond(200, b'{"status":"ok"}')
            return
        if not path.endswith("/completions"):
            self.respond(404, b'{"error":{"message":"not found","type":"not_found_error","code":404}}')
            return
        req = json.loads(body)
        chat = path.endswith("/chat/completions")
        rid = (rid or os.urandom(8).hex()).replace('"', "")
        model = req.get("model") or "bench-model"
        prompt = req.get("messages") if chat else req.get("prompt")
        prompt_tokens = max(1, len(json.dumps(prompt)) // 5)
        if self.role == "prefill" or not req.get("stream"):
            self.respond(200, self.whole(rid, model, chat, req, prompt_tokens))
            return
        options = req.get("stream_options") or {}
        tokens = int(req.get("max_completion_tokens") or req.get("max_tokens") or 16)
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
        self.stream = Stream(self, rid, model, chat, tokens, prompt_tokens,
                             usage_each=bool(options.get("include_usage") and options.get("continuous_usage_stats")),
                             usage_end=bool(options.get("include_usage")))
        if chat:  # vLLM opens a chat stream with a role-only delta
            self.chunk(self.stream.head[:-len(b'{"content":"')] + b'{"role":"assistant","content":""},'
                       b'"logprobs":null,"finish_reason":null}]}\n\n')
        itl = float(req.get("bench_itl_ms", self.default_itl * 1000)) / 1000.0
        if itl > 0:
            self.stream.engine = Pacer(self.engine.loop, self.stream, itl)
        else:
            self.stream.engine = self.engine
            self.engine.add(self.stream)

    def whole(self, rid: str, model: str, chat: bool, req: dict, prompt_tokens: int) -> bytes:
        tokens = 1 if self.role == "prefill" else int(req.get("max_completion_tokens") or req.get("max_tokens") or 16)
        text = " word" * tokens
        answer: dict = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "object": "chat.completion" if chat else
                        "text_completion", "created": CREATED, "model": model}
        if chat:
            answer["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": "length"}]
        else:
            answer["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                                  "stop_reason": None}]
        answer["usage"] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + tokens,
                           "completion_tokens": tokens}
        if self.role == "prefill":
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
                "remote_engine_id": "bench-engine", "remote_request_id": rid, "remote_host": self.kv_host,
                "remote_port": 5600, "tp_size": 1}
        return json.dumps(answer, separators=(",", ":")).encode()

    def respond(self, status: int, body: bytes) -> None:
        reason = {200: b"OK", 404: b"Not Found"}.get(status, b"Error")
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, reason, len(body), body))

    def chunk(self, data: bytes) -> None:
        self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_chunks(self) -> None:
        self.transport.write(b"0\r\n\r\n")
        self.stream = None


async def main_async(args: argparse.Namespace) -> None:
    engine = Engine(asyncio.get_running_loop())
    await serve(f"zero_upstream {args.role}", lambda: Upstream(args.role, engine, args.itl_ms / 1000.0, args.host),
                args.host, args.port, backlog=8192, reuse_address=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("prefill", "decode"), default="decode")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--itl-ms", type=float, default=0.0, help="token period of paced streams; 0 = zero delay")
    args = parser.parse_args()
    _raise_fd_limit()
    import uvloop

    uvloop.run(main_async(args))


def _raise_fd_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


if __name__ == "__main__":
    main()
