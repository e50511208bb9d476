"""A closed-loop streaming load generator cheap enough not to be the bottleneck.

Each virtual user keeps one keep-alive HTTP/1.1 connection and sends the next request as soon as
the previous answer ended. Responses are read by a raw uvloop protocol: the cost per received
read is a few microseconds (chunked framing and SSE event boundaries found with `bytes.find`, no
JSON), so on the 2-core machine the proxy under test, not the client, runs out of CPU. Its own
ceiling is what it reaches against the zero-delay decode directly.

Timing, at the client, on one monotonic clock:
* TTFT: request written -> the read that completed the first token event;
* ITL: gaps between the reads that completed token events (k events completed by one read are
  k arrivals at the same instant, so k-1 gaps of 0, as any SSE client would see them).
A request counts as an error when its status is not 200, the connection breaks, or it does not
end with `data: [DONE]` after exactly the expected number of token events.

Run: python benchmarks/loadgen.py --url http://127.0.0.1:8000 --concurrency 64 --duration 5 \
        --tokens 32 [--warmup 1] [--timings]     (prints one JSON object)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from urllib.parse import urlsplit

clock = time.perf_counter_ns


class Phase:
    """Counters of one run, shared by all virtual users."""

    def __init__(self, timings: bool) -> None:
        self.timings = timings
        self.measuring = False
        self.stopping = False
        self.requests = 0
        self.errors = 0
        self.error_kinds: dict[str, int] = {}
        self.events = 0  # token events received while measuring
        self.ttft: list[int] = []
        self.gaps: list[int] = []
        self.open_streams = 0
        self.max_open_streams = 0

    def error(self, kind: str) -> None:
        if self.measuring or self.stopping:
            self.errors += 1
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


class Client(asyncio.Protocol):
    """One virtual user: request, read the whole streamed answer, repeat."""

    def __init__(self, phase: Phase, request: bytes, tokens: int, done: asyncio.Future, once: bool) -> None:
        self.phase = phase
        self.request = request
        self.tokens = tokens  # token events expected per answer
        self.done = done
        self.once = once
        self.transport: asyncio.Transport | None = None
        self.connected = asyncio.get_running_loop().create_future()
        self._reset()

    def _reset(self) -> None:
        self.head = b""
        self.in_body = False
        self.status = 0
        self.chunk_left = 0  # bytes left in the current HTTP chunk; -1: expecting a size line
        self.size_line = b""
        self.tail = b""  # the last bytes of body, to find an event boundary split across reads
        self.events = 0
        self.last = 0
        self.sent = 0
        self.finished = False
        self.saw_done = False

    # -- connection ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connected.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            if self.sent:
                self.phase.error("connection_lost")
                self._close_stream()
            self.done.set_result(False)  # the user reconnects

    def send(self) -> None:
        self._reset()
        self.sent = clock()
        self.transport.write(self.request)

    # -- reading ---------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        now = clock()
        if not self.in_body:
            data = self.head + data if self.head else data.lstrip(b"\r\n")
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self.head = data
                return
            head = data[:end]
            self.status = int(head[9:12])
            lower = head.lower()
            self.chunked = b"transfer-encoding: chunked" in lower
            if not self.chunked:
                i = lower.find(b"content-length:")
                self.chunk_left = int(lower[i + 15:lower.find(b"\r\n", i)]) if i >= 0 else -2
            else:
                self.chunk_left = -1
            self.in_body = True
            if self.status == 200:
                self.phase.open_streams += 1
                if self.phase.open_streams > self.phase.max_open_streams:
                    self.phase.max_open_streams = self.phase.open_streams
            data = data[end + 4:]
        body = self._unframe(data) if self.chunked else self._plain(data)
        if body:
            self._events(body, now)
        if self.finished:
            self._complete()

    def _plain(self, data: bytes) -> bytes:
        if self.chunk_left >= 0:
            self.chunk_left -= len(data)
            if self.chunk_left <= 0:
                self.finished = True
        return data

    def _unframe(self, data: bytes) -> bytes:
        """The payload bytes of the chunked encoding in `data`; sets `finished` at the last chunk."""
        out = []
        i, n = 0, len(data)
        while i < n:
            if self.chunk_left > 0:
                take = min(self.chunk_left, n - i)
                out.append(data[i:i + take])
                i += take
                self.chunk_left -= take
                if self.chunk_left == 0:
                    self.chunk_left = -3  # the CRLF after a chunk
                continue
            if self.chunk_left == -3:  # skip the chunk's trailing CRLF (may be split)
                skip = min(2 - len(self.size_line), n - i)
                self.size_line += b"x" * skip
                i += skip
                if len(self.size_line) == 2:
                    self.size_line = b""
                    self.chunk_left = -1
                continue
            j = data.find(b"\r\n", i)
            if j < 0:
                self.size_line += data[i:]
                break
            line = self.size_line + data[i:j]
            self.size_line = b""
            i = j + 2
            size = int(line.split(b";", 1)[0], 16)
            if size == 0:
                self.finished = True  # no trailers expected; the final CRLF is in this or the next read
                break
            self.chunk_left = size
        return b"".join(out) if len(out) != 1 else out[0]

    def _events(self, body: bytes, now: int) -> None:
        text = self.tail + body
        count = text.count(b"\n\n")
        self.tail = text[-1:] if text.endswith(b"\n") else b""
        if b"[DONE]" in text:
            self.saw_done = True
        if not count:
            return
        tokens_before = self.events
        self.events = min(self.tokens, self.events + count)
        new = self.events - tokens_before
        if not new:
            return
        phase = self.phase
        if phase.measuring:
            phase.events += new
            if phase.timings:
                if tokens_before == 0:
                    phase.ttft.append(now - self.sent)
                    new -= 1
                elif self.last:
                    phase.gaps.append(now - self.last)
                    new -= 1
                if new > 0:
                    phase.gaps.extend([0] * new)
        self.last = now

    def _complete(self) -> None:
        phase = self.phase
        self._close_stream()
        if self.status != 200:
            phase.error(f"status_{self.status}")
        elif self.chunked and not self.saw_done:
            phase.error("no_done")
        elif self.chunked and self.events < self.tokens:
            phase.error("short_stream")
        elif phase.measuring:
            phase.requests += 1
        self.sent = 0
        if phase.stopping or self.once:
            if not self.done.done():
                self.done.set_result(True)
            return
        self.send()

    def _close_stream(self) -> None:
        if self.in_body and self.status == 200:
            self.phase.open_streams -= 1
            self.in_body = False


def build_request(url: str, path: str, tokens: int, prompt_words: int, model: str, chat: bool,
                  itl_ms: float | None = None) -> bytes:
    parts = urlsplit(url)
    prompt = " ".join(f"w{i % 97}" for i in range(prompt_words))
    body: dict = {"model": model, "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True},
                  "ignore_eos": True}
    if itl_ms is not None:
        body["bench_itl_ms"] = itl_ms  # read by benchmarks/zero_upstream.py, forwarded untouched by proxies
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(raw)}\r\n\r\n").encode() + raw


async def user(phase: Phase, host: str, port: int, request: bytes, tokens: int, once: bool, start_delay: float) -> None:
    loop = asyncio.get_running_loop()
    if start_delay:
        await asyncio.sleep(start_delay)
    while not phase.stopping:
        done = loop.create_future()
        try:
            _, proto = await loop.create_connection(lambda: Client(phase, request, tokens, done, once), host, port)
        except OSError:
            phase.error("connect_error")
            await asyncio.sleep(0.05)
            continue
        proto.send()
        ok = await done
        if ok or once:
            proto.transport.close()
            return
        await asyncio.sleep(0.01)


async def run(args: argparse.Namespace) -> dict:
    parts = urlsplit(args.url)
    request = build_request(args.url, args.path, args.tokens, args.prompt_words, args.model, args.chat, args.itl_ms)
    phase = Phase(args.timings)
    once = args.once
    tasks = [asyncio.create_task(user(phase, parts.hostname, parts.port, request, args.tokens, once,
                                      args.ramp * i / max(1, args.concurrency)))
             for i in range(args.concurrency)]
    if once:  # every user sends one request: measure the whole run (the hold test)
        phase.measuring = True
        started = time.monotonic()
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
    else:
        await asyncio.sleep(args.warmup)
        cpu0 = time.process_time()
        _mark("measure-start")
        phase.measuring = True
        started = time.monotonic()
        await asyncio.sleep(args.duration)
        phase.measuring = False
        elapsed = time.monotonic() - started
        _mark("measure-end")
        cpu = time.process_time() - cpu0
        phase.stopping = True  # let every user finish its current answer (errors still count)
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), args.drain_timeout)
        except TimeoutError:
            phase.error("drain_timeout")
    result = {"requests": phase.requests, "errors": phase.errors, "error_kinds": phase.error_kinds,
              "events": phase.events, "seconds": elapsed, "max_open_streams": phase.max_open_streams}
    if not once:
        result["client_cpu"] = cpu
    if args.timings:
        result["ttft_us"] = [t / 1000 for t in phase.ttft]
        result["gaps_us"] = [g / 1000 for g in phase.gaps]
    return result


def _mark(what: str) -> None:
    """Tell the orchestrator (reading stderr) when the measured window opens and closes."""
    sys.stderr.write(what + "\n")
    sys.stderr.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--path", default="/v1/completions")
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--model", default="bench-model")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=256)
    parser.add_argument("--itl-ms", type=float, help="ask benchmarks/zero_upstream.py for this token period")
    parser.add_argument("--timings", action="store_true", help="report every TTFT and gap (microseconds)")
    parser.add_argument("--once", action="store_true", help="each user sends one request (concurrency = streams held)")
    parser.add_argument("--ramp", type=float, default=0.0, help="seconds over which users start")
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--out", help="write the JSON result here instead of stdout")
    args = parser.parse_args()
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    import uvloop

    result = json.dumps(uvloop.run(run(args)))
    if args.out:
        with open(args.out, "w") as f:
            f.write(result)
    else:
        print(result)


if __name__ == "__main__":
    main()
