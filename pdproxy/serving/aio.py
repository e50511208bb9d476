"""`Exchange` over aiohttp's server: the inference routes reached through aiohttp's application
(a request the lean server hands over: `Expect`, a chunked body, a query string, HTTP/1.0, ...)."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from pdproxy.errors import bad_request, body_timeout, client_closed, too_large

log = logging.getLogger("pdproxy.serving")


class AioExchange:
    """An aiohttp request and the response made for it (`response`, which the route handler returns)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.headers = request.headers
        self.content_length = request.content_length
        self.response: web.StreamResponse | None = None

    async def read_body(self, limit: int, timeout: float) -> bytes:
        request = self.request
        try:
            if request.content.is_eof():  # the whole body came with the headers: nothing to wait for
                raw = request.content.read_nowait()
                if len(raw) > limit:  # as request.read() checks the app's client_max_size (the same limit)
                    raise too_large(limit)
                return raw
            async with asyncio.timeout(timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large(limit) from None
        except TimeoutError:
            raise body_timeout(timeout) from None
        except RequestPayloadError as exc:
            raise bad_request(f"request body is malformed ({exc})") from None
        except ConnectionError:
            raise client_closed() from None

    def answer(self, status: int, body: bytes, headers: dict[str, str], close: bool = False) -> None:
        if self.started:  # a second response inside one that began would corrupt the connection
            log.error("an answer was given to a request whose answer had begun: connection dropped")
            self.abort()
            return
        self.response = web.Response(status=status, body=body, headers=headers)
        if close:
            self.response.force_close()

    def start(self, status: int, headers: dict[str, str]) -> None:
        self.response = web.StreamResponse(status=status, headers=headers)

    async def send(self, data: bytes, end: bool = False) -> None:
        response = self.response
        assert response is not None, "start() first"
        if not response.prepared:
            await response.prepare(self.request)
        if end:
            await response.write_eof(data)
        elif data:
            await response.write(data)

    @property
    def writable(self) -> bool:
        return False  # aiohttp's writes are coroutines: every event goes through `send`

    def write_now(self, data: bytes) -> None:
        raise RuntimeError("aiohttp's responses are written by send()")

    @property
    def started(self) -> bool:
        return self.response is not None and self.response.prepared

    def abort(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()
