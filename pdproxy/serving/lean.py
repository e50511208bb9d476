"""pdproxy's own HTTP/1.1 server for plain POSTs to the inference routes.

Why: aiohttp's request and response machinery (request object, router, middleware, response
preparation, a coroutine and chunk framing per streamed write) costs 0.03-0.06 ms a request beyond
what a server must do (benchmarks/RESULTS.md, `floor-lean`): a fifth of vllm-router's whole CPU per
request. Here a request head is parsed by llhttp (httptools, as the legs' answers are), its body
taken by its declared length, and each answer written to the socket as bytes built once.

Only the plain case is served here: HTTP/1.1, `POST` to exactly an inference route, a body of
declared length within --max-body-bytes, no `Expect`, `Transfer-Encoding` or `Upgrade`. The moment
a connection carries anything else (another route, a query string, a malformed or oversized head),
it is handed to aiohttp's protocol at that request's first byte, with every byte since, and stays
there: aiohttp answers it exactly as it would have from the start (JSON errors, limits,
`100 Continue`, chunked bodies). Between requests a connection idles at most --keep-alive-timeout,
counted from its last answer (a head sent slowly gets no more); the unread rest of a body after an
early answer (401, 503) is read and dropped for at most `linger` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from pdproxy.errors import ProxyError, body_timeout, too_large
from pdproxy.protocol import Route

log = logging.getLogger("pdproxy.serving")

MAX_PENDING = 64 * 1024  # bytes of following requests held while one is served, before reading pauses
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_INTERNAL = ProxyError(500, "internal proxy error", error_type="internal")


class LeanServer:
    """The protocol factory for the listening socket (`loop.create_server(server, ...)`), and the
    connections it serves. `handle(exchange, route)` answers one request; `fallback()` makes the
    aiohttp protocol a connection is handed to."""

    def __init__(self, routes: Mapping[bytes, Route], handle: Callable[[LeanExchange, Route], Coroutine[Any, Any, None]],
                 fallback: Callable[[], asyncio.Protocol], *, max_body: int, max_head: int, max_headers: int,
                 keep_alive_timeout: float, linger: float) -> None:
        self.routes = routes
        self.handle = handle
        self.fallback = fallback
        self.max_body = max_body
        self.max_head = max_head  # a longer head, or one with more headers, is aiohttp's: its limits answer it
        self.max_headers = max_headers
        self.keep_alive_timeout = keep_alive_timeout
        self.linger = linger
        self.connections: set[Connection] = set()
        self.closing = False
        self._sweeper: asyncio.Task | None = None

    def __call__(self) -> Connection:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="lean-keepalive-sweeper")
        return Connection(self)

    async def _sweep(self) -> None:
        """Close connections idle past their keep-alive and lingering ones past their time: one sweep a
        second for all of them, not a timer armed and cancelled around every request."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, max(0.05, self.keep_alive_timeout / 4)))
            now = loop.time()
            idle_since = now - self.keep_alive_timeout
            for conn in [c for c in self.connections
                         if 0 < c.idle_since <= idle_since or 0 < c.linger_until <= now]:
                conn.close()

    async def shutdown(self, grace: float) -> None:
        """Idle connections close now; requests being served get `grace` seconds, then are cancelled."""
        self.closing = True
        for conn in list(self.connections):
            if conn.exchange is None:
                conn.close()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        for conn in list(self.connections):
            conn.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)


class Connection(asyncio.Protocol):
    """One client connection: one request at a time, answered in order."""

    transport: asyncio.Transport

    def __init__(self, server: LeanServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.buffer = b""  # received bytes not yet taken: the next request's
        self.exchange: LeanExchange | None = None  # the request being served
        self.task: asyncio.Task | None = None
        self.idle_since = 0.0  # loop time the connection went idle; 0 while a request is served
        self.discard = 0  # bytes of an answered request's body still to read and drop
        self.linger_until = 0.0  # loop time by which they must have come
        self.close_after_discard = False
        self.closed = False
        self.reading_paused = False
        self.writing_paused = False
        self.drained: asyncio.Future | None = None
        # the head being parsed (httptools callbacks)
        self.url = b""
        self.fields: list[tuple[str, str]] = []
        self.head_complete = False

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.idle_since = self.loop.time()
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.discard:  # the rest of a body answered early
            take = min(self.discard, len(data))
            self.discard -= take
            data = data[take:]
            if self.discard:
                return
            self.linger_until = 0.0
            if self.close_after_discard:
                self.close()
                return
            if not data:
                return
        exchange = self.exchange
        if exchange is not None and exchange.remaining:
            data = exchange.feed(data)
            if not data:
                return
        self.buffer = self.buffer + data if self.buffer else data
        if exchange is None:
            self._next()
        elif len(self.buffer) > MAX_PENDING and not self.reading_paused:
            self.reading_paused = True  # a client that pipelines: the rest waits for this answer
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.task is not None:
            self.task.cancel()  # the client went away: the request is abandoned (its legs closed, vLLM aborts)
        self._wake_writer(ConnectionResetError("client closed the connection"))

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_writer(None)

    # -- httptools callbacks (the head only) ----------------------------------------------

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        self.head_complete = True

    # -- requests ---------------------------------------------------------------------------

    def _next(self) -> None:
        """Start serving the request at the front of the buffer, once its head is complete."""
        buffer = self.buffer
        if buffer[:1] in (b"\r", b"\n"):
            buffer = self.buffer = buffer.lstrip(b"\r\n")  # empty lines before a request line are ignored
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > self.server.max_head:
                self._hand_over()
            return
        plain = self._parse(buffer[:end + 4])
        if plain is None:
            self._hand_over()
            return
        route, headers, length, keep_alive = plain
        self.buffer = buffer[end + 4:]
        self.idle_since = 0.0
        exchange = self.exchange = LeanExchange(self, headers, length, keep_alive)
        if self.buffer and length:
            self.buffer = exchange.feed(self.buffer)
        self.task = task = self.loop.create_task(self.server.handle(exchange, route))
        task.add_done_callback(self._answered)

    def _parse(self, head: bytes) -> tuple[Route, CIMultiDictProxy[str], int, bool] | None:
        """The route, headers, body length and keep-alive of a head this server serves; None: aiohttp's."""
        self.url, self.fields, self.head_complete = b"", [], False
        parser = httptools.HttpRequestParser(self)
        try:
            parser.feed_data(head)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            return None
        if not self.head_complete or parser.get_method() != b"POST" or parser.get_http_version() != "1.1":
            return None
        route = self.server.routes.get(self.url)
        if route is None or len(self.fields) > self.server.max_headers or len(head) > self.server.max_head:
            return None
        headers = CIMultiDict(self.fields)
        if "Expect" in headers or "Transfer-Encoding" in headers or "Upgrade" in headers:
            return None
        declared = headers.getall("Content-Length", ())
        if len(declared) > 1:
            return None
        length = int(declared[0]) if declared else 0  # llhttp took digits only
        if length > self.server.max_body:
            return None  # refused by aiohttp's path with 413 before a byte is read, traced like every refusal
        return route, CIMultiDictProxy(headers), length, parser.should_keep_alive()

    def _answered(self, task: asyncio.Task) -> None:
        """The handler is done: the next request (or the end of the connection)."""
        self.task = None
        exchange = self.exchange
        self.exchange = None
        if self.closed or task.cancelled() or exchange is None:
            return
        error = task.exception()
        if error is not None:
            log.error("error serving a request: %r", error)
        if not exchange.finished:  # no whole answer: say so when nothing went out, else cut the stream
            if exchange.started:
                self.transport.abort()
                return
            exchange.answer(*_INTERNAL.reply())
        close = exchange.close or not exchange.keep_alive or self.server.closing
        self.idle_since = self.loop.time()
        if exchange.remaining:  # answered before its body came: drop the rest, then the next request
            self.discard = exchange.remaining
            self.linger_until = self.idle_since + self.server.linger
            self.close_after_discard = close
            return  # (nothing is buffered: bytes that came so far were the body's)
        if close:
            self.close()
            return
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.buffer:
            self._next()

    def _hand_over(self) -> None:
        """This request and every later one on the connection are aiohttp's (see the module docstring)."""
        self.server.connections.discard(self)
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        protocol = self.server.fallback()
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        buffer, self.buffer = self.buffer, b""
        if buffer:
            protocol.data_received(buffer)

    # -- writing ----------------------------------------------------------------------------

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("client closed the connection")
        self.drained = self.loop.create_future()
        try:
            await self.drained
        finally:
            self.drained = None

    def _wake_writer(self, error: BaseException | None) -> None:
        drained = self.drained
        if drained is not None and not drained.done():
            if error is None:
                drained.set_result(None)
            else:
                drained.set_exception(error)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.server.connections.discard(self)
            self.transport.close()


class LeanExchange:
    """One request on a `Connection` (`pdproxy.serving.Exchange`)."""

    __slots__ = ("conn", "headers", "content_length", "keep_alive", "remaining", "parts", "waiter", "status",
                 "stream_headers", "started", "finished", "close")

    def __init__(self, conn: Connection, headers: CIMultiDictProxy[str], length: int, keep_alive: bool) -> None:
        self.conn = conn
        self.headers = headers
        self.content_length: int | None = length
        self.keep_alive = keep_alive
        self.remaining = length  # body bytes still to come
        self.parts: list[bytes] = []
        self.waiter: asyncio.Future | None = None
        self.status = 200
        self.stream_headers: dict[str, str] = {}
        self.started = False  # the head went out
        self.finished = False  # the whole answer went out
        self.close = False  # the connection ends after the answer

    # -- the body ---------------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """Take the body's bytes from `data`; return the bytes after the body."""
        take = self.remaining
        if len(data) <= take:
            self.parts.append(data)
            self.remaining = take - len(data)
            rest = b""
        else:
            self.parts.append(data[:take])
            self.remaining = 0
            rest = data[take:]
        if not self.remaining and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)
        return rest

    async def read_body(self, limit: int, timeout: float) -> bytes:
        if self.content_length is not None and self.content_length > limit:
            raise too_large(limit)
        if self.remaining:
            self.waiter = self.conn.loop.create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self.waiter
            except TimeoutError:
                raise body_timeout(timeout) from None
            finally:
                self.waiter = None
        parts = self.parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # -- the answer -------------------------------------------------------------------------

    def answer(self, status: int, body: bytes, headers: dict[str, str], close: bool = False) -> None:
        if self.started:  # a second response inside one that began would corrupt the connection
            log.error("an answer was given to a request whose answer had begun: connection dropped")
            self.conn.transport.abort()
            return
        if self.conn.closed:
            return
        self.close = close
        self.started = self.finished = True
        self.conn.transport.write(self._head(status, headers, b"Content-Length: %d\r\n" % len(body)) + body)

    def start(self, status: int, headers: dict[str, str]) -> None:
        self.status, self.stream_headers = status, headers

    async def send(self, data: bytes, end: bool = False) -> None:
        if self.finished:
            return
        conn = self.conn
        if conn.closed or conn.transport.is_closing():
            raise ConnectionResetError("client closed the connection")
        out = b""
        if not self.started:
            self.started = True
            out = self._head(self.status, self.stream_headers, b"Transfer-Encoding: chunked\r\n")
        if data:
            out += b"%x\r\n%b\r\n" % (len(data), data)  # as write_now
        if end:
            out += b"0\r\n\r\n"
            self.finished = True
        conn.transport.write(out)
        if conn.writing_paused:
            await conn.drain()  # the client reads slower than the stream comes

    @property
    def writable(self) -> bool:
        conn = self.conn
        return (self.started and not self.finished and not conn.closed and not conn.writing_paused
                and not conn.transport.is_closing())

    def write_now(self, data: bytes) -> None:
        conn = self.conn
        if data and not conn.closed and not conn.transport.is_closing():  # (an empty chunk would end the body)
            conn.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def abort(self) -> None:
        self.conn.transport.abort()

    def _head(self, status: int, headers: dict[str, str], framing: bytes) -> bytes:
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
            raise ValueError("header values must not contain line breaks")
        keep = self.keep_alive and not self.close and not self.conn.server.closing
        return b"".join((_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status, _date(), framing,
                         b"" if keep else b"Connection: close\r\n", lines.encode("utf-8", "surrogateescape"),
                         b"\r\n"))


_dated: list[Any] = [0, b""]  # the Date header of the current second


def _date() -> bytes:
    second = int(time.time())
    if _dated[0] != second:
        _dated[0], _dated[1] = second, f"Date: {formatdate(second, usegmt=True)}\r\n".encode()
    return _dated[1]
