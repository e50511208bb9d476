"""The listening socket: pdproxy's lean protocol for plain inference POSTs (pdproxy/serving/lean.py),
aiohttp's for everything else, with deadlines and JSON errors for unparsable requests.

Every connection starts on the lean protocol, which hands it to aiohttp's at the first request it
does not serve itself (another route, an unusual or oversized head, ...). What follows is what
aiohttp's side needs, and the lean side does alike (the same limits and deadlines).
Three things aiohttp's defaults do not give a proxy on the serving path:

* A deadline for the request head. aiohttp closes a connection that is idle (or still sending its
  request line and headers) after `keepalive_timeout`, 3630 s by default; `--keep-alive-timeout`
  (75 s, nginx's default) bounds how long a slowloris client holds a connection. The body has its
  own deadline, `--body-timeout`, enforced by the request handler.
* An answer in OpenAI's error shape for requests that never reach a handler: a request line or
  header that is too long, too many headers, or bytes that are not HTTP. aiohttp answers those with
  a text page and logs a traceback per request; here they get a JSON error body, 431 for oversized
  headers (400 otherwise), and one log line at debug level, so hostile input cannot flood the log.
* No inflating of request bodies (see `handler_options`): vLLM takes none compressed, and aiohttp's
  own decompression is unbounded work on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from pdproxy.config import Settings
from pdproxy.errors import error_body
from pdproxy.protocol import Route
from pdproxy.serving import Exchange, LeanServer

log = logging.getLogger("pdproxy.listener")

MAX_LINE_SIZE = 8190  # request line and each header line, bytes (aiohttp's default)
MAX_FIELD_SIZE = 8190
MAX_HEADERS = 128
MAX_LINGER = 2.0  # seconds spent draining an unread body after an early answer (413, 408, 503)


def handler_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for aiohttp's request handler (also given to the AppRunner)."""
    # After answering before the body was read, aiohttp drains the rest of it (so that closing does
    # not reset the connection under the answer) for `lingering_time`, 10 s by default: bounded here.
    # `auto_decompress` off: aiohttp would inflate a gzip/deflate body inside the parser, on the loop
    # and without a bound (a 1 MB bomb is 1 GB), even while draining a body nobody reads. Such a body
    # is refused with 415 from its head (protocol.check_body_encoding); its bytes are drained as sent.
    return {"keepalive_timeout": settings.keep_alive_timeout, "max_line_size": MAX_LINE_SIZE,
            "max_field_size": MAX_FIELD_SIZE, "max_headers": MAX_HEADERS, "access_log": None,
            "lingering_time": min(MAX_LINGER, settings.body_timeout), "auto_decompress": False}


class JsonErrorProtocol(web.RequestHandler):
    """aiohttp's protocol, answering requests it cannot parse in OpenAI's error shape."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # part of a response is out: nothing more can be said
            raise ConnectionError("response already started")
        if isinstance(exc, HttpProcessingError):
            text = "request headers are too large" if _headers_too_large(exc) else "malformed HTTP request"
            if _headers_too_large(exc):
                status = 431
            log.debug("refused a request from %s: %s (%s)", request.remote, text, exc.__class__.__name__)
            detail = f"{text} (limits: {MAX_LINE_SIZE} bytes per line, {MAX_HEADERS} headers)"
        else:
            status = 500
            log.error("error handling a request from %s: %r", request.remote, exc)
            detail = "internal proxy error"
        response = web.json_response(error_body(detail, status), status=status)
        response.force_close()
        return response


def _headers_too_large(exc: HttpProcessingError) -> bool:
    return isinstance(exc, LineTooLong) or "too many headers" in str(exc).lower()


async def listen(runner: web.AppRunner, sock: socket.socket, settings: Settings, routes: Mapping[bytes, Route],
                 handle: Callable[[Exchange, Route], Coroutine[Any, Any, None]]) -> tuple[asyncio.AbstractServer, LeanServer]:
    """Serve plain POSTs to `routes` with `handle` on pdproxy's lean protocol, and every other request
    with `runner`'s application on `JsonErrorProtocol`. Close the returned server, then shut the lean
    one down with `runner.cleanup()` (both let the requests being served finish)."""
    loop = asyncio.get_running_loop()
    server = runner.server
    assert server is not None, "runner.setup() first"
    options = handler_options(settings)
    lean = LeanServer(routes, handle, lambda: JsonErrorProtocol(server, loop=loop, **options),
                      max_body=settings.max_body_bytes, max_head=MAX_LINE_SIZE, max_headers=MAX_HEADERS,
                      keep_alive_timeout=settings.keep_alive_timeout,
                      linger=options["lingering_time"])
    return await loop.create_server(lean, sock=sock, backlog=4096), lean
