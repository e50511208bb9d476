"""vLLM's API server finishes the streams that end in one engine step one after another.

The recorded vLLM 0.23 runs (tests/fixtures/vllm023) deliver the last tokens of streams ending in one step
1.0-1.3 ms apart, and their closed-loop clients' next prompts follow as far apart. The simulator's side of it
(pdproxy/sim/timing.py `FrontEnd.finished`, preset field frontend_finish_ms): a `pdproxy sim` process whose four
streams end in one step delivers their ends `--frontend-finish-ms` apart; without it, together. The what-if's
side, on the same engine in virtual time: tests/test_whatif_frontend.py.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from procs import start_sim

pytestmark = pytest.mark.timeout(120)
STREAMS = 4
FINISH_MS = 40.0  # large against the host's jitter


async def _end(session: aiohttp.ClientSession, url: str) -> float:
    """When the stream's last byte arrived (perf_counter)."""
    body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 50, "ignore_eos": True, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for _ in r.content.iter_any():
            pass
    return time.perf_counter()


async def _ends(url: str) -> list[float]:
    async with aiohttp.ClientSession() as s:
        return sorted(await asyncio.gather(*(_end(s, url) for _ in range(STREAMS))))


@pytest.mark.parametrize("finish_ms", [FINISH_MS, 0.0])
def test_streams_ending_in_one_step_are_finished_one_after_another(finish_ms):
    # no intake work, so that the four prompts arriving together are prefilled in one step and end in one
    proc, url = start_sim("single", "--frontend-request-ms", "0", "--frontend-stream-ms", "0",
                          "--frontend-finish-ms", str(finish_ms))
    try:
        ends = asyncio.run(_ends(url))
    finally:
        proc.stop()
    spread_ms = (ends[-1] - ends[0]) * 1e3
    if finish_ms:
        assert 0.75 * (STREAMS - 1) * finish_ms <= spread_ms <= 1.5 * (STREAMS - 1) * finish_ms, ends
    else:
        assert spread_ms < finish_ms + FINISH_MS / 2, ends  # one step apart at most, plus the host's jitter
