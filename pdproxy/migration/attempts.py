"""Decode attempts up to the commit point: which KV the next one gets, how many there may be, and
the reading of a stream up to its first token (the package docstring says the rules)."""

from __future__ import annotations

import time
from typing import Any

from pdproxy.errors import DECODE, ProxyError
from pdproxy.migration.continuation import TokenTap
from pdproxy.pool import Instance
from pdproxy.stream import CR, ResponseScan, stream_failure, through_done
from pdproxy.upstream import Response, UpstreamError

BEFORE_FIRST_TOKEN, MID_STREAM = "before_first_token", "mid_stream"  # the stages a migration happens in
# mid-stream failures a continuation can repair: the decode went away. An error event is the instance's
# answer (relayed), and after a malformed event the client's stream cannot be trusted to continue.
MIGRATABLE = frozenset({"stream_broken", "timeout", "stream_truncated"})


# Plain classes, not dataclasses: compiled, a dataclass's generated `__init__` runs interpreted, and
# every request makes a Handoff, an Attempt and a Budget.
class Handoff:
    """The KV coordinates the next decode attempt gets, and whether they are still safe to give."""

    def __init__(self, params: dict[str, Any] | None, prefill: Instance | None) -> None:
        self.params = params
        self.prefill = prefill  # the instance holding the blocks (None: single-instance mode)
        self.reusable = True  # False once a decode may have pulled them

    def spent(self, used: bool) -> str | None:
        """Record a failed attempt; the prefill instance's address when its parameters were abandoned
        (the blocks stay held there).

        `used`: the decode may have read them. Only a request that never reached its decode
        (connection refused, not accepted in time) or that was turned away as busy (429, 503 with
        Retry-After: vLLM refuses those before its engine sees them) leaves them usable."""
        if self.params is None or self.prefill is None or not used or not self.reusable:
            return None
        self.reusable = False
        return self.prefill.address


class Attempt:
    """A decode answer at its commit point: the client may be answered from it now."""

    def __init__(self, instance: Instance, response: Response, head: bytes, streamed: bool,
                 tap: TokenTap | None = None) -> None:
        self.instance = instance
        self.response = response
        self.head = head  # read before the commit point: the first events of a stream, or a whole body
        self.streamed = streamed
        self.tap = tap  # rewrites a stream armed for mid-stream migration
        self.closed = False

    def close(self) -> None:
        """An answer not read to its end is closed, not pooled: that aborts it on the instance."""
        if not self.closed:
            self.closed = True
            self.response.release() if self.response.at_eof else self.response.close()
            self.instance.inflight -= 1


class Budget:
    """How many more decode attempts a request may start, and until when (--decode-retries, --decode-deadline)."""

    def __init__(self, retries: int, deadline: float) -> None:
        self.retries = retries
        self.deadline = deadline  # time.monotonic()
        self.used = 0

    @classmethod
    def start(cls, retries: int, seconds: float) -> Budget:
        return cls(retries, time.monotonic() + seconds if seconds else float("inf"))

    def take(self) -> bool:
        """Spend one more attempt; False when none is left."""
        if self.used >= self.retries or time.monotonic() >= self.deadline:
            return False
        self.used += 1
        return True


# What a decode may send before its first token, all held until then (the client's status line waits for
# it): vLLM sends a role-only delta (chat), a few events whose text the detokenizer holds back, and with
# return_token_ids the prompt's ids in its first event (~7 bytes an id: 16 MiB is a 2M-token prompt).
MAX_HEAD_EVENTS = 1024
MAX_HEAD_BYTES = 16 * 1024 * 1024


async def read_head(response: Response, scan: ResponseScan, tap: TokenTap | None) -> bytes:
    """Read a stream up to its commit point: its first token-bearing event (or its finish). Anything
    else first — the end of the stream, an error event, a malformed event, a broken connection, more
    than MAX_HEAD_EVENTS events or MAX_HEAD_BYTES bytes without a token — is a `ProxyError` the caller
    may retry, since not one byte of it has reached the client. (A read that brings the token is taken
    whatever the number of events in it: the events bound counts reads without one.)
    (A continuation's scan already holds the delivered stream: its own events are the new ones.)"""
    parts = []
    tokens, finishes, malformed = len(scan.chunk_times), len(scan.finish_reasons), scan.malformed
    received = events = 0
    while True:
        try:
            data = await response.readany()
        except (TimeoutError, UpstreamError) as exc:
            raise stream_failure(exc, "before its first token") from None
        if not data:
            raise ProxyError(502, "decode instance ended the stream before its first token",
                             error_type="stream_truncated", stage=DECODE)
        received += len(data)
        if received > MAX_HEAD_BYTES:
            raise _no_token(events + _events_in(data), received)
        fed = tap.feed(data) if tap is not None else data
        scan.feed(fed, time.monotonic_ns())
        parts.append(fed)
        if scan.malformed > malformed:
            raise ProxyError(502, "decode instance sent a malformed stream event (not a JSON object)",
                             error_type="malformed_stream", stage=DECODE)
        if len(scan.chunk_times) > tokens or len(scan.finish_reasons) > finishes:
            head = b"".join(parts)
            return through_done(head) if scan.done else head  # a whole answer in one read: nothing after [DONE]
        # counted in the reads that brought no token only: the usual first read brings it, and a count of its
        # ~2 KB is ~9 k instructions under callgrind on Python 3.12
        events += _events_in(data)
        if events > MAX_HEAD_EVENTS:
            raise _no_token(events, received)
        if scan.error is not None or scan.done:
            message = str((scan.error or {}).get("message", "stream ended without a token"))[:300]
            raise ProxyError(502, f"decode instance failed before its first token: {message}",
                             error_type="stream_error", stage=DECODE)


def _events_in(data: bytes) -> int:
    """The SSE events that end in `data` (a CR: one memchr, then CRLF ends are counted too)."""
    return data.count(b"\n\n") + (data.count(b"\r\n\r\n") if CR in data else 0)


def _no_token(events: int, received: int) -> ProxyError:
    return ProxyError(502, f"decode instance sent {events} events ({received} bytes) and no token",
                      error_type="no_first_token", stage=DECODE)


async def read_whole(response: Response, scan: ResponseScan) -> bytes:
    """An unstreamed answer, read whole and checked before the client gets any of it."""
    try:
        raw = await response.read()
    except TimeoutError:
        raise ProxyError(504, "decode instance timed out sending its response", error_type="timeout",
                         stage=DECODE) from None
    except UpstreamError as exc:
        raise ProxyError(502, f"decode instance broke its response ({type(exc).__name__})",
                         error_type="stream_broken", stage=DECODE) from None
    scan.feed_whole(raw, time.monotonic_ns())
    if scan.malformed:
        raise ProxyError(502, "decode instance sent a response that is not valid JSON",
                         error_type="invalid_response", stage=DECODE)
    return raw


def first_token_timeout(seconds: float) -> ProxyError:
    return ProxyError(504, f"decode instance sent no token within {seconds:g}s (--first-token-timeout)",
                      error_type="first_token_timeout", stage=DECODE)


# -- mid-stream ----------------------------------------------------------------------------------
