"""A decode fed by several prefills at once takes their KV in one at a time (preset kv_intake_gbps).

Real `pdproxy sim` processes: two prefills on a fast link (2 GB/s: a 1,024-token KV in ~67 ms) and one
decode whose intake is slow (0.5 GB/s: ~270 ms a KV) and, like the two-GPU preset, holds its steps while
KV comes in (--kv-pull-stalls-decode). Four requests through ONE prefill: their KV queues on that
prefill's link and lands one KV at a time, the intake never engages (one source: the recorded vLLM 1P1D
runs show no intake wait). The same four requests split over TWO prefills: the links run side by side, yet
the decode's KV wait grows, one intake time per KV, and a stream running on the decode meanwhile stalls
for the intake (the recorded 2P2D runs' decodes waited 3-16 s before their engine queue once a second
prefill fed them; docs/notes/whatif-issue40.md, "the decode's intake").
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from pdproxy.sim.probe import Timed, pd_request, timed_request
from procs import start_sim

pytestmark = pytest.mark.timeout(120)

KV = ("--kv-bandwidth-gbps", "2", "--kv-latency-ms", "1")
PROMPT_TOKENS = 1024  # 134 MB of KV: 67 ms on the link, 268 ms through the intake
INTAKE_S = PROMPT_TOKENS * 131072 / 0.5e9
REQUESTS = 4


@pytest.fixture(scope="module")
def cluster():
    procs = []
    try:
        a, url_a = start_sim("prefill", *KV, "--engine-id", "prefill-a")
        procs.append(a)
        b, url_b = start_sim("prefill", *KV, "--engine-id", "prefill-b")
        procs.append(b)
        d, url_d = start_sim("decode", *KV, "--kv-intake-gbps", "0.5", "--kv-pull-stalls-decode")
        procs.append(d)
        # the one-GPU presets' decode: it steps on while its intake works
        bursts, url_bursts = start_sim("decode", *KV, "--kv-intake-gbps", "0.5", "--kv-intake-bursts")
        procs.append(bursts)
        yield url_a, url_b, url_d, url_bursts
    finally:
        for proc in procs:
            proc.stop()


def _body(i: int, tokens: int = 4) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": [1000 + i] * PROMPT_TOKENS, "max_tokens": tokens, "ignore_eos": True,
            "stream": True}


async def _phase(prefills: list[str], decode: str, tag: str) -> tuple[list[Timed], Timed]:
    """REQUESTS P/D requests spread over `prefills`, while one local stream decodes on `decode`."""
    async with aiohttp.ClientSession() as s:
        stream_body = {"model": "sim-model", "prompt": "a running stream", "max_tokens": 400, "ignore_eos": True,
                       "stream": True}
        stream = asyncio.ensure_future(timed_request(s, decode + "/v1/completions", stream_body, {}))
        await asyncio.sleep(0.2)  # the stream is decoding when the KV comes in
        results = await asyncio.wait_for(asyncio.gather(*(
            pd_request(s, prefills[i % len(prefills)], decode, "/v1/completions", _body(i), f"{tag}-{i}")
            for i in range(REQUESTS))), 60)
        return [r.decode for r in results if r.decode is not None], await asyncio.wait_for(stream, 60)


def test_several_prefills_feeding_one_decode_queue_at_its_intake_and_stall_its_streams(cluster):
    url_a, url_b, url_d, _ = cluster
    one, stream_one = asyncio.run(_phase([url_a], url_d, "one"))
    two, stream_two = asyncio.run(_phase([url_a, url_b], url_d, "two"))
    for legs, stream in ((one, stream_one), (two, stream_two)):
        assert len(legs) == REQUESTS and all(leg.ok for leg in legs), [leg.error or leg.body for leg in legs]
        assert stream.ok and stream.max_gap is not None
    wait_one = max(leg.ttft for leg in one)  # type: ignore[type-var]
    wait_two = max(leg.ttft for leg in two)  # type: ignore[type-var]
    # one prefill: four KVs in a row on its link (~0.27 s), no intake
    assert wait_one < 2 * INTAKE_S, wait_one
    # two prefills: the links run side by side, but the decode takes the KVs in one at a time
    assert wait_two > 3 * INTAKE_S and wait_two > 2 * wait_one, (wait_one, wait_two)
    # its stream is held while the intake works: at least two intakes in a row, against a link time or two
    assert stream_two.max_gap > 2 * INTAKE_S > stream_one.max_gap, (stream_one.max_gap, stream_two.max_gap)


def test_an_intake_by_batches_releases_the_kv_that_landed_during_a_batch_together(cluster):
    url_a, url_b, _, url_bursts = cluster
    legs, _ = asyncio.run(_phase([url_a, url_b], url_bursts, "bursts"))
    assert len(legs) == REQUESTS and all(leg.ok and leg.chunk_times for leg in legs), \
        [leg.error or leg.body for leg in legs]
    bursts = sorted(leg.chunk_times[0] for leg in legs)
    # taken in one at a time (without --kv-intake-bursts), the last three would come an intake time apart;
    # by batches: the three KVs that landed while the first was copied in are released in one step
    assert bursts[-1] - bursts[-3] < 0.3 * INTAKE_S, bursts
    # and not before all of the batch is in: the last first token still waits about three intakes after the first
    assert bursts[-1] - bursts[0] > 2 * INTAKE_S, bursts
