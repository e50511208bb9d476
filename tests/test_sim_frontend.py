"""vLLM's API server under load: a request's way to the engine grows with the streams the instance serves.

The simulator's side of the front end `pdproxy whatif --fit-run` fits (pdproxy/sim/timing.py `FrontEnd`,
preset fields frontend_request_ms and frontend_stream_ms): a `pdproxy sim` process serving four long streams
takes a new request in later than when idle, by about `--frontend-stream-ms` per stream. Measured from the
client as time to first chunk, with a per-stream time large enough that the host's jitter cannot fake it.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from procs import start_sim

pytestmark = pytest.mark.timeout(120)
STREAMS = 4
PER_STREAM_MS = 40.0


async def _first_chunk(session: aiohttp.ClientSession, url: str, max_tokens: int) -> float:
    """Seconds to the first streamed chunk; reads the stream to its end."""
    body = {"model": "sim-model", "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    sent = time.perf_counter()
    first = None
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for _ in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - sent
    assert first is not None
    return first


async def _probe(url: str) -> tuple[float, float, float]:
    """(idle TTFT, TTFT beside STREAMS long streams, idle TTFT after them), medians of three each."""
    async with aiohttp.ClientSession() as s:
        async def idle() -> float:
            return sorted([await _first_chunk(s, url, 2) for _ in range(3)])[1]

        before = await idle()
        streams = [asyncio.ensure_future(_first_chunk(s, url, 600)) for _ in range(STREAMS)]  # ~3 s of decode
        await asyncio.sleep(0.5)  # all four decoding
        loaded = sorted([await _first_chunk(s, url, 2) for _ in range(3)])[1]
        assert not any(t.done() for t in streams), "the streams ended before the probes: the test measured nothing"
        await asyncio.gather(*streams)
        return before, loaded, await idle()


@pytest.mark.parametrize("per_stream", [PER_STREAM_MS, 0.0])
def test_intake_grows_with_the_streams_served(per_stream):
    proc, url = start_sim("single", "--frontend-stream-ms", str(per_stream))
    try:
        before, loaded, after = asyncio.run(_probe(url))
    finally:
        proc.stop()
    extra_ms = (loaded - before) * 1e3
    if per_stream:
        # four streams in flight: ~160 ms more; the host's jitter is tens of ms at worst
        assert 0.75 * STREAMS * per_stream <= extra_ms <= 1.5 * STREAMS * per_stream, (before, loaded)
        assert abs(after - before) * 1e3 < STREAMS * per_stream / 2, (before, after)  # streams gone, intake idle
    else:
        assert extra_ms < STREAMS * PER_STREAM_MS / 2, (before, loaded)
