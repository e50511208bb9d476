"""migration.read_head: a decode stream read up to its first token, and the bound on the events before it."""

from __future__ import annotations

import asyncio

import pytest

from pdproxy.errors import ProxyError
from pdproxy.migration import MAX_HEAD_EVENTS, read_head
from pdproxy.stream import ResponseScan
from pdproxy.upstream import Response, _Connection, _InstancePool

COMMENT = b": keep-alive\n\n"
TOKEN = b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"a"}]}\n\n'


def head_of(*reads: bytes) -> bytes:
    """What read_head returns (or raises) for a stream that arrives as `reads`."""
    async def main() -> bytes:
        pool = _InstancePool(asyncio.get_running_loop(), "http://127.0.0.1:1", 1.0, 1.0, 1, 1.0, None)
        response = Response(_Connection(pool))
        for data in reads:
            response._feed(data)
        response._finish()
        return await read_head(response, ResponseScan(chat=False), None)
    return asyncio.run(main())


def test_the_events_before_the_first_token_are_bounded_in_reads_without_one():
    with pytest.raises(ProxyError) as cut:
        head_of(COMMENT * (MAX_HEAD_EVENTS + 1))
    assert cut.value.error_type == "no_first_token" and f"sent {MAX_HEAD_EVENTS + 1} events" in cut.value.message
    reads = [COMMENT * (MAX_HEAD_EVENTS // 2)] * 2 + [COMMENT]  # counted across reads
    with pytest.raises(ProxyError) as cut:
        head_of(*reads)
    assert cut.value.error_type == "no_first_token"
    assert head_of(COMMENT * MAX_HEAD_EVENTS, TOKEN) == COMMENT * MAX_HEAD_EVENTS + TOKEN  # within the bound


def test_a_read_that_brings_the_first_token_is_taken_whatever_its_events():
    # the bound counts the reads that brought no token (a count of the usual one-read head cost ~9 k
    # instructions a request); the token's own read is taken as it is
    data = COMMENT * (MAX_HEAD_EVENTS + 5) + TOKEN
    assert head_of(data) == data
