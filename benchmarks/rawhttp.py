"""HTTP/1.1 request framing for the benchmark's raw asyncio servers (zero_upstream, otlp_sink).

Those servers skip aiohttp so that they cost the shared CPU as little as possible; this is the
one piece of HTTP they need: cutting whole requests (with a Content-Length body) off a buffer,
and serving a protocol until the process is stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


async def serve(name: str, protocol: Callable[[], asyncio.Protocol], host: str, port: int, **options: Any) -> None:
    """Serve `protocol` on host:port until cancelled; says so on stdout once listening."""
    server = await asyncio.get_running_loop().create_server(protocol, host, port, **options)
    print(f"{name} listening on {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def take_requests(buffer: bytes) -> tuple[list[tuple[str, dict[str, str], bytes]], bytes]:
    """The complete requests at the start of `buffer` as (request line, lower-cased headers, body),
    and the bytes left over for the next read."""
    requests = []
    while True:
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            return requests, buffer
        request_line, *lines = buffer[:end].decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", 0))
        if len(buffer) < end + 4 + length:
            return requests, buffer
        requests.append((request_line, headers, buffer[end + 4:end + 4 + length]))
        buffer = buffer[end + 4 + length:]
