"""A decode whose intake takes KV in by batches (--kv-intake-bursts) releases the KV of a batch together.

Real `pdproxy sim` processes: two prefills on a fast link (2 GB/s: a 1,024-token KV in ~67 ms) and two decodes
with a slow intake (0.5 GB/s: ~270 ms a KV), one taking KV in one at a time (the presets' intake), one by batches.
Four requests over the two prefills at once: the first KV to land starts the intake, the three landing while it
is copied form the next batch. One at a time, their first tokens come an intake time apart; by batches, the
three come in one step, as vLLM 0.23's decodes released five to nine KV loads at once in the recorded 2P2D
(docs/whatif.md, "The decode's intake").
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from pdproxy.sim.probe import pd_request
from procs import start_sim

pytestmark = pytest.mark.timeout(120)

KV = ("--kv-bandwidth-gbps", "2", "--kv-latency-ms", "1", "--kv-intake-gbps", "0.5")
PROMPT_TOKENS = 1024
INTAKE_S = PROMPT_TOKENS * 131072 / 0.5e9
REQUESTS = 4


@pytest.fixture(scope="module")
def cluster():
    procs = []
    try:
        urls = []
        for role, extra in (("prefill", ("--engine-id", "prefill-a")), ("prefill", ("--engine-id", "prefill-b")),
                            ("decode", ()), ("decode", ("--kv-intake-bursts",))):
            proc, url = start_sim(role, *KV, *extra)
            procs.append(proc)
            urls.append(url)
        yield urls
    finally:
        for proc in procs:
            proc.stop()


def _body(i: int) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": [2000 + i] * PROMPT_TOKENS, "max_tokens": 4, "ignore_eos": True,
            "stream": True}


async def _first_tokens(prefills: list[str], decode: str, tag: str) -> list[float]:
    async with aiohttp.ClientSession() as s:
        results = await asyncio.wait_for(asyncio.gather(*(
            pd_request(s, prefills[i % len(prefills)], decode, "/v1/completions", _body(i), f"{tag}-{i}")
            for i in range(REQUESTS))), 60)
    legs = [r.decode for r in results]
    assert all(leg is not None and leg.ok and leg.chunk_times for leg in legs), \
        [leg.error or leg.body if leg else None for leg in legs]
    return sorted(leg.chunk_times[0] for leg in legs if leg is not None)


def test_an_intake_by_batches_releases_the_kv_that_landed_during_a_batch_together(cluster):
    url_a, url_b, one_at_a_time, by_batches = cluster
    fifo = asyncio.run(_first_tokens([url_a, url_b], one_at_a_time, "fifo"))
    bursts = asyncio.run(_first_tokens([url_a, url_b], by_batches, "bursts"))
    # one at a time: the last three first tokens are two intake times apart, one per KV
    assert fifo[-1] - fifo[-3] > 1.5 * INTAKE_S, fifo
    # by batches: the three KVs that landed while the first was copied in are released in one step
    assert bursts[-1] - bursts[-3] < 0.3 * INTAKE_S, bursts
    # and the batch is not released before all of it is in: the last first token still waits three intakes
    assert bursts[-1] - bursts[0] > 2 * INTAKE_S, bursts
