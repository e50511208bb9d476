"""The HTTP/1.1 client of the two upstream legs: pooled keep-alive connections, llhttp parsing.

Why not aiohttp's `ClientSession`: its per-request machinery (request and response objects,
header multidicts, timers, tracing hooks, a task per body write) cost a third of the proxy's CPU
per request, and every request pays it twice (prefill and decode). Here a request is one pre-built
bytes buffer written to a pooled connection, and the answer is parsed by `httptools` (llhttp, what
uvicorn uses) into a status, a lower-cased header dict and body bytes, de-chunked in C.

Semantics the proxy relies on (docs/reference/failures.md):
* `ConnectFailed` / `ConnectTimeout`: the request never reached the instance (refused, unreachable,
  TLS handshake failed, not accepted within the connect timeout); a retry may reuse its KV params.
* `Disconnected`, `ReadTimeout`, `MalformedResponse`: it did reach it (or may have). One exception is
  handled here and never surfaces: a *reused* connection that ends (EOF or reset) before any byte of
  the answer. That is the instance closing an idle connection as the request went out (its
  keep-alive ran out; uvicorn reads nothing more once it decided to close), so the request goes
  again, once, on a fresh connection: not a failure of the instance, and the same KV parameters.
* The read timeout bounds each silence of the instance while an answer is awaited or read (aiohttp's
  `sock_read`); it does not run while the proxy itself stops reading because its client is slow.
* Closing a `Response` that was not read to its end closes its connection: that is how vLLM learns
  to abort the request. Cancelling `post()` does the same.
* Connections are reused only after a complete answer that allows keep-alive; at most `max_idle`
  idle ones are kept per instance, each for at most `keepalive` seconds counted from the answer's
  last byte. That must stay below the instance's own idle timeout (vLLM's uvicorn: 5 s) so that the
  proxy, not the instance, ends idle connections; an expired one is never handed out, even when a
  lagging event loop has not run the sweeper yet.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools
from mypy_extensions import mypyc_attr

KEEPALIVE = 4.0  # seconds an idle connection is kept: below vLLM's (uvicorn's) 5, so the proxy closes first
MAX_IDLE = 256  # idle connections kept per instance
HIGH_WATER = 1 << 17  # buffered answer bytes at which reading from the instance pauses (aiohttp's 2 x 64 KiB)


# The errors are plain Python classes when compiled: mypyc compiles no class with two built-in bases
# (ConnectTimeout and ReadTimeout are TimeoutErrors too), nor one derived from a compiled class.
@mypyc_attr(native_class=False)
class UpstreamError(Exception):
    """A transport failure on an upstream leg."""


@mypyc_attr(native_class=False)
class ConnectFailed(UpstreamError):
    """No connection: refused, unreachable, name not resolved or TLS handshake failed."""


@mypyc_attr(native_class=False)
class ConnectTimeout(UpstreamError, TimeoutError):
    """The instance did not accept a connection within the connect timeout."""


@mypyc_attr(native_class=False)
class ReadTimeout(UpstreamError, TimeoutError):
    """The instance stayed silent longer than the read timeout."""


@mypyc_attr(native_class=False)
class Disconnected(UpstreamError):
    """The instance closed the connection before its answer was complete."""


@mypyc_attr(native_class=False)
class MalformedResponse(UpstreamError):
    """The instance's bytes are not an HTTP/1.1 response."""


class Response:
    """One answer: status and headers once they are in; the body as it arrives."""

    __slots__ = ("status", "headers", "keep_alive", "sink", "_conn", "_chunks", "_size", "_done", "_error", "_waiter",
                 "_closed")

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}  # lower-cased names
        self.keep_alive = False
        # Takes body chunks as they arrive, while the reader waits for none (True: taken): a relay's fast
        # path, which spares the waiting reader a wake-up per chunk (pdproxy/stream.py, `Pipe`)
        self.sink: Callable[[bytes], bool] | None = None
        self._conn = conn
        self._chunks: list[bytes] = []
        self._size = 0
        self._done = False  # the whole body arrived
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._closed = False

    @property
    def at_eof(self) -> bool:
        """The whole answer arrived and was read."""
        return self._done and not self._chunks

    async def readany(self) -> bytes:
        """Everything that arrived since the last read (waiting for some); b"" at the end of the body."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        if self._size >= HIGH_WATER:
            self._conn.resume()
        self._size = 0
        return data

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def release(self) -> None:
        """Done with this answer: its connection goes back to the pool when that is safe, else closes."""
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if self._done and self.keep_alive and conn.response is self:
            conn.idle()
        else:
            conn.close()

    def close(self) -> None:
        """Drop the answer and its connection (an unfinished request is aborted on the instance)."""
        if not self._closed:
            self._closed = True
            self._conn.close()

    # -- fed by the connection ------------------------------------------------------------

    def interrupt(self, error: BaseException) -> None:
        """Stop with `error` (a sink that cannot go on): the reader gets it next, and nothing that came
        after; the connection closes (the request is aborted)."""
        self._error = error
        self._chunks = []
        self.sink = None
        self._wake()
        self.close()

    def _feed(self, data: bytes) -> None:
        if self._closed:
            return  # dropped: nobody reads it
        sink = self.sink
        if sink is not None and not self._chunks and sink(data):
            return
        self._chunks.append(data)
        self._size += len(data)
        if self._size >= HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if error is None:
            self._done = True
        elif not self._done and self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an instance; one answer at a time."""

    transport: asyncio.Transport  # from connection_made, which the loop calls before the connection is ours

    def __init__(self, pool: _InstancePool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.head: asyncio.Future | None = None  # resolved when the answer's headers are in
        self.closed = False
        self.paused = False
        self.last_read = 0.0  # loop time of the last bytes (or of sending the request)
        self.timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0  # loop time the connection went idle (its answer's last byte)
        self.reused = False  # handed out from the idle list (the instance may have closed it meanwhile)
        self.received = False  # some byte of the current answer arrived
        self._length_known = False  # Content-Length or chunked: the parser sees the body's end

    # -- used by the client ---------------------------------------------------------------

    def send(self, data: bytes) -> Response:
        response = self.response = Response(self)
        self.head = self.loop.create_future()
        self._length_known = False
        self.received = False
        self.last_read = self.loop.time()
        self.transport.write(data)
        self._arm()
        return response

    def idle(self) -> None:
        self.response = None  # the read timer, if armed, stays: the next request on this connection reuses it
        self.pool.put(self)

    def close(self, abort: bool = False) -> None:
        """Close the connection (`abort`: at once, dropping unsent bytes)."""
        if not self.closed:
            self.closed = True
            self._disarm()
            self.transport.abort() if abort else self.transport.close()
        self.pool.forget(self)

    def pause(self) -> None:
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.last_read = self.loop.time()  # the silence timer restarts with reading
            self.transport.resume_reading()
            self._arm()

    # -- the read timeout: one timer per silence, not one per read or per request ------------
    # An answer's end leaves the timer armed: when it fires with nothing awaited it lapses, and a request sent
    # on the pooled connection before that finds it armed (a timer costs ~7 k instructions under callgrind).

    def _arm(self) -> None:
        if self.timer is None and self.pool.read_timeout:
            self.timer = self.loop.call_at(self.last_read + self.pool.read_timeout, self._check_silence)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check_silence(self) -> None:
        self.timer = None
        if self.paused or self.closed or self.response is None or self.response._done:
            return  # re-armed on resume or by the next request; nothing to time otherwise
        due = self.last_read + self.pool.read_timeout
        if self.loop.time() < due:
            self.timer = self.loop.call_at(due, self._check_silence)
            return
        self._fail(ReadTimeout(f"no bytes for {self.pool.read_timeout:g}s"))

    def _fail(self, error: UpstreamError) -> None:
        self.close(abort=True)
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        if self.response is not None:
            self.response._finish(error)

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            self.close(abort=True)  # bytes nobody asked for on an idle connection: it cannot be trusted any more
            return
        self.received = True
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(MalformedResponse(f"{type(exc).__name__}: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        self.pool.forget(self)
        response, head = self.response, self.head
        if response is not None and not response._done:
            if head is not None and head.done() and not self._length_known and exc is None:
                response._finish()  # a body delimited by the end of the connection
                return
            self._fail(Disconnected(f"connection closed{f' ({exc})' if exc else ''}"))

    # -- httptools callbacks ----------------------------------------------------------------

    # they run only while an answer is awaited: data_received takes no bytes otherwise
    def on_message_begin(self) -> None:
        assert self.response is not None
        if self.response._done:  # a second answer to one request: the connection cannot be trusted
            raise MalformedResponse("bytes after the end of the answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response, head = self.response, self.head
        assert response is not None and head is not None
        response.status = self.parser.get_status_code()
        response.keep_alive = self.parser.should_keep_alive()
        headers = response.headers
        # Transfer-Encoding is case-insensitive (RFC 9112 §7): "Chunked" is chunked too
        self._length_known = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()
        if not head.done():
            head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        self.response._finish()


class _InstancePool:
    """Idle keep-alive connections to one instance, most recently used first."""

    def __init__(self, loop: asyncio.AbstractEventLoop, url: str, connect_timeout: float, read_timeout: float,
                 max_idle: int, keepalive: float, tls: ssl.SSLContext | None) -> None:
        parts = urlsplit(url)
        self.loop = loop
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = (tls or ssl.create_default_context()) if parts.scheme == "https" else None
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self.keepalive = keepalive
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = (parts.scheme == "https" and self.port == 443) or (parts.scheme == "http" and self.port == 80)
        self.host_header = host if default else f"{host}:{self.port}"
        self.base_path = parts.path.rstrip("/")
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()

    async def acquire(self) -> _Connection:
        """The most recently used idle connection still within its keep-alive, else a new one."""
        fresh_since = self.loop.time() - self.keepalive
        while self.idle:
            conn = self.idle.pop()
            if conn.closed:
                continue
            if conn.idle_since <= fresh_since:
                conn.close()  # the sweeper has not run (a lagging loop): the instance may be closing it now
                continue
            conn.reused = True
            return conn
        return await self.connect()

    async def connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(lambda: _Connection(self), self.host, self.port,
                                                            ssl=self.ssl)
        except TimeoutError:
            raise ConnectTimeout(f"not accepted within {self.connect_timeout:g}s") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from None
        self.open.add(conn)
        return conn

    def put(self, conn: _Connection) -> None:
        if conn.closed:
            return
        if len(self.idle) >= self.max_idle or self.keepalive <= 0:
            conn.close()
            return
        conn.idle_since = conn.last_read  # the instance's idle timer started when it sent that byte, not later
        self.idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self.open.discard(conn)
        if self.idle and conn in self.idle:
            self.idle.remove(conn)

    def expire(self) -> None:
        """Close idle connections past their keep-alive (oldest are first in the list)."""
        fresh_since = self.loop.time() - self.keepalive
        while self.idle and self.idle[0].idle_since <= fresh_since:
            self.idle.pop(0).close()

    def close(self) -> None:
        for conn in list(self.open):
            conn.close(abort=True)
        self.idle.clear()


class UpstreamClient:
    """Pooled connections to every instance the proxy talks to, and one way to send a request."""

    def __init__(self, connect_timeout: float, read_timeout: float, max_idle: int = MAX_IDLE,
                 keepalive: float = KEEPALIVE, tls: ssl.SSLContext | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self.keepalive = keepalive
        self.tls = tls  # for https: None is the system's trust store
        self.stale_retries = 0  # requests sent again because a reused connection was found closed
        self._pools: dict[str, _InstancePool] = {}
        self._sweeper: asyncio.Task | None = None

    def _pool(self, base_url: str) -> _InstancePool:
        pool = self._pools.get(base_url)
        if pool is None:
            loop = asyncio.get_running_loop()
            pool = self._pools[base_url] = _InstancePool(loop, base_url, self.connect_timeout, self.read_timeout,
                                                         self.max_idle, self.keepalive, self.tls)
            if self._sweeper is None and self.keepalive > 0:
                self._sweeper = loop.create_task(self._sweep(), name="upstream-keepalive-sweeper")
        return pool

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send `body` to `base_url + path`; return once the answer's status line and headers are in.

        Cancelling this (the client went away) closes the connection, which aborts the request."""
        pool = self._pool(base_url)
        request = _request_bytes(pool, path, body, headers)
        conn = await pool.acquire()
        try:
            return await _exchange(conn, request)
        except Disconnected:
            if not conn.reused or conn.received:
                raise
        # The instance closed this idle connection as the request went out and read none of it:
        # the request goes again on a new connection (once: a fresh connection has no such race).
        self.stale_retries += 1
        return await _exchange(await pool.connect(), request)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive / 3)
            for pool in self._pools.values():
                pool.expire()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for pool in self._pools.values():
            pool.close()


async def _exchange(conn: _Connection, request: bytes) -> Response:
    """Send `request` on `conn` and wait for the answer's head; the connection closes if that fails."""
    response = conn.send(request)
    head = conn.head
    assert head is not None  # send() made it
    try:
        await head
    except BaseException:
        conn.close(abort=True)
        raise
    return response


def _request_bytes(pool: _InstancePool, path: str, body: bytes, headers: dict[str, Any]) -> bytes:
    """The whole request (head and body) as one buffer, so it goes out in one write."""
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
        raise ValueError("header values must not contain line breaks")  # would split the request
    head = (f"POST {pool.base_path}{path} HTTP/1.1\r\nHost: {pool.host_header}\r\n{lines}"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("utf-8", "surrogateescape") + body
