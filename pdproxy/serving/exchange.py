"""What the request flow needs of a client's request, as a protocol both servers implement."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Exchange(Protocol):
    """One client request and its answer.

    The answer is either whole (`answer`) or a stream (`start`, then `send` until `end=True`); its
    status line and headers go out with the first bytes, so a stream that fails before its first
    `send` can still be answered whole. Writing to a client that went away raises `ConnectionError`."""

    @property
    def headers(self) -> Mapping[str, str]:
        """The request's headers (names case-insensitive)."""
        ...

    @property
    def content_length(self) -> int | None:
        ...

    async def read_body(self, limit: int, timeout: float) -> bytes:
        """The whole body, within `timeout` seconds and `limit` bytes; `ProxyError` (408, 413, 400, 499) when not."""
        ...

    def answer(self, status: int, body: bytes, headers: dict[str, str], close: bool = False) -> None:
        """Answer whole; `close`: the connection ends after it (the rest of an unread body is not worth reading)."""
        ...

    def start(self, status: int, headers: dict[str, str]) -> None:
        """Begin a streamed answer; nothing is sent before the first `send`."""
        ...

    async def send(self, data: bytes, end: bool = False) -> None:
        """Send `data` on the stream (`end`: and end it), waiting while the client's socket is full."""
        ...

    @property
    def writable(self) -> bool:
        """`write_now` may be called: the stream began and the client's socket takes bytes without waiting."""
        ...

    def write_now(self, data: bytes) -> None:
        """Send `data` on the stream at once, without waiting (the relay's fast path, outside any coroutine:
        taken while `writable`); dropped when the client is gone (the relay learns it on its next write)."""
        ...

    @property
    def started(self) -> bool:
        """Some of the answer went out: the status can no longer change."""
        ...

    def abort(self) -> None:
        """Drop the connection at once (a client that stopped reading)."""
        ...
