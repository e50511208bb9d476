"""The simulator's timing model under small, bounded loads: the phenomena it exists to show.

* a long prompt arriving during decoding stalls every stream of a `single` instance; chunked
  prefill bounds the stall; P/D takes it out of the decode instance;
* KV transfer time grows with prompt length, and transfers queue on the prefill's link;
* requests queue (and running ones get preempted) when the KV cache is full.

Timing thresholds are derived from the default preset with wide margins (this machine is shared
and has two cores); the calibration script, not these tests, checks the numbers themselves.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import aiohttp
import numpy as np
import pytest

from pdproxy.sim.probe import Timed, metric_value, pd_request, prefill_body, timed_request
from procs import start_sim
from waits import scaled

pytestmark = pytest.mark.timeout(90)

COMPLETIONS = "/v1/completions"
rng = random.Random(11)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def ids(n: int) -> list[int]:
    return [rng.randrange(1000, 90000) for _ in range(n)]


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as r:
        return await r.json()


async def metrics_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as r:
        return await r.text()


class Started:
    """Sims started by one test, all stopped at the end."""

    def __init__(self) -> None:
        self.procs: list[Any] = []

    def sim(self, role: str, *flags: str) -> str:
        proc, url = start_sim(role, *flags)
        self.procs.append(proc)
        return url

    def stop(self) -> None:
        for proc in self.procs:
            assert proc.stop() == 0, proc.output()


@pytest.fixture
def sims():
    started = Started()
    try:
        yield started
    finally:
        started.stop()


# ---- 1. the prefill stall: single vs chunked vs P/D ---------------------------------------------------
STREAM_BODY = {"max_tokens": 120, "stream": True, "ignore_eos": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def mixed_load(single: str | None = None, pd: tuple[str, str] | None = None) -> list[Timed]:
    """8 streams decoding for ~0.7 s while four 3000-token prompts arrive, 0.2 s apart."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(prompt: int, max_tokens: int, name: str) -> Timed:
            body = dict(STREAM_BODY, prompt=ids(prompt), max_tokens=max_tokens)
            if pd:
                r = await pd_request(s, pd[0], pd[1], COMPLETIONS, body, name)
                assert r.ok, (r.prefill.error, r.decode and r.decode.error)
                return r.decode
            return await timed_request(s, single + COMPLETIONS, body)

        async def long_prompts() -> None:
            await asyncio.sleep(0.12)
            pending = []
            for i in range(4):
                pending.append(asyncio.create_task(one(3000, 4, f"long-{i}")))
                await asyncio.sleep(0.2)
            await asyncio.gather(*pending)

        streams = [one(64, 120, f"stream-{i}") for i in range(8)]
        results = await asyncio.gather(*streams, long_prompts())
    streams_out = results[:8]
    assert all(t.ok and t.chunk_tokens[-1] == 120 for t in streams_out), [t.error for t in streams_out]
    return streams_out


def median_max_gap(streams: list[Timed]) -> float:
    return float(np.median([t.max_gap for t in streams])) * 1000


def test_long_prompts_stall_single_chunking_bounds_it_pd_removes_it(sims):
    single_url = sims.sim("single")
    chunked_url = sims.sim("single", "--max-num-batched-tokens", "2048")
    two_gpu = ("--preset", "h200-llama8b-2gpu")
    pd_urls = (sims.sim("prefill", *two_gpu), sims.sim("decode", *two_gpu, "--no-kv-pull-stalls-decode"))
    # the preset's default: the decode holds its steps while a KV pull is in flight, as recorded
    pd_stall_urls = (sims.sim("prefill", *two_gpu), sims.sim("decode", *two_gpu))

    def measure() -> tuple[float, float, float, float]:
        return (median_max_gap(run(mixed_load(single=single_url))),
                median_max_gap(run(mixed_load(single=chunked_url))),
                median_max_gap(run(mixed_load(pd=pd_urls))),
                median_max_gap(run(mixed_load(pd=pd_stall_urls))))

    def ordered(single: float, chunked: float, pd: float, pd_stall: float) -> bool:
        # preset: a 3000-token step with 8 decodes ~ 73 ms; a 2048-token chunk ~ 48 ms; a decode step ~ 5 ms;
        # a 3000-token KV pull on the 2-GPU link ~ 39 ms
        return (single > 60 and single > chunked + 12 and chunked > pd + 15 and pd < 30
                and pd_stall > pd + 15 and pd_stall > 35)

    first = measure()
    print("median per-request max ITL (ms): single {:.1f}, chunked-2048 {:.1f}, P/D {:.1f}, "
          "P/D stalling on KV pulls {:.1f}".format(*first))
    result = first
    if not ordered(*first):
        # A pause of this shared host lands in every stream at once and can mask one config's
        # stall; it does not repeat at the same moment, so the smaller of two runs is the engine's.
        second = measure()
        print("again: single {:.1f}, chunked-2048 {:.1f}, P/D {:.1f}, P/D stalling {:.1f}".format(*second))
        result = tuple(min(a, b) for a, b in zip(first, second))
    assert ordered(*result), result


def test_without_chunking_a_prompt_over_the_budget_runs_whole(sims):
    async def steps_for(url: str) -> int:
        async with aiohttp.ClientSession() as s:
            before = (await get_json(s, url + "/sim/state"))["steps"]
            t = await timed_request(s, url + COMPLETIONS, {"prompt": ids(3000), "max_tokens": 1})
            assert t.ok, t.error
            return (await get_json(s, url + "/sim/state"))["steps"] - before
    whole = run(steps_for(sims.sim("single", "--max-num-batched-tokens", "1024", "--no-enable-chunked-prefill")))
    chunked = run(steps_for(sims.sim("single", "--max-num-batched-tokens", "1024")))
    assert (whole, chunked) == (1, 3)


# ---- 2. KV transfer ----------------------------------------------------------------------------------
def test_kv_transfer_time_grows_with_prompt_length(sims):
    prefill = sims.sim("prefill", "--preset", "h200-llama8b-2gpu")
    decode = sims.sim("decode", "--preset", "h200-llama8b-2gpu")

    async def transfer(tokens: int) -> tuple[float, float, float]:
        async with aiohttp.ClientSession() as s:
            before = await metrics_text(s, decode)
            r = await pd_request(s, prefill, decode, COMPLETIONS,
                                 {"prompt": ids(tokens), "max_tokens": 2, "stream": True}, f"x{tokens}")
            assert r.ok
            after = await metrics_text(s, decode)
        xfer = (metric_value(after, "vllm:nixl_xfer_time_seconds_sum")
                - metric_value(before, "vllm:nixl_xfer_time_seconds_sum"))
        moved = (metric_value(after, "vllm:nixl_bytes_transferred_sum")
                 - metric_value(before, "vllm:nixl_bytes_transferred_sum"))
        return xfer, moved, r.ttft

    sizes = (256, 1024, 4096)
    results = {n: run(transfer(n)) for n in sizes}
    xfer = {n: r[0] for n, r in results.items()}
    print({n: f"{x * 1000:.1f} ms" for n, x in xfer.items()})
    for n in sizes:
        assert results[n][1] == n * 131072  # whole 16-token blocks of 131072 B per token
        expected = 4.0e-3 + n * 131072 / 11.2e9  # preset: 11.2 GB/s + 4 ms
        assert 0.7 * expected < xfer[n] < 1.5 * expected + 0.005
    # the difference is the link's: bytes over its bandwidth
    assert xfer[256] < xfer[1024] < xfer[4096] and xfer[4096] - xfer[256] > 0.7 * (4096 - 256) * 131072 / 11.2e9
    ttft = {n: r[2] for n, r in results.items()}
    assert ttft[256] < ttft[1024] < ttft[4096]


def test_concurrent_transfers_queue_on_the_prefill_link(sims):
    # the link alone, slow enough that its queueing stands out of this host's noise (the 2-GPU preset's
    # 11.2 GB/s moves 2048 tokens in ~28 ms); a decode that holds its steps during pulls would also delay
    # their scheduling
    slow = ("--preset", "h200-llama8b-2gpu", "--kv-bandwidth-gbps", "2.4", "--kv-latency-ms", "0.5")
    prefill = sims.sim("prefill", *slow)
    decode = sims.sim("decode", *slow, "--enable-per-request-metrics", "--no-kv-pull-stalls-decode")

    async def scenario() -> list[float]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            bodies = [{"prompt": ids(2048), "max_tokens": 1} for _ in range(4)]
            kvs = []
            for body in bodies:
                async with s.post(prefill + COMPLETIONS, json=prefill_body(body)) as r:
                    kvs.append((await r.json())["kv_transfer_params"])
            # all four decodes at once: each transfer is ~112 ms on the 2.4 GB/s link
            results = await asyncio.gather(*[
                timed_request(s, decode + COMPLETIONS, dict(b, kv_transfer_params=kv)) for b, kv in zip(bodies, kvs)])
            assert all(r.ok for r in results), [r.error for r in results]
            return sorted(r.metrics["queue_time_ms"] for r in results)
    waits = run(scenario())
    # FIFO on one link: the k-th transfer waits for the k-1 before it
    assert waits[-1] > 3 * 100 and waits[-1] > 2.5 * waits[0]
    assert all(b - a > 60 for a, b in zip(waits, waits[1:]))


# ---- 3. KV-cache capacity -----------------------------------------------------------------------------
def test_requests_queue_when_kv_blocks_run_out(sims):
    # 40 blocks of 16 tokens; each request needs 18 blocks for its prompt and 19 at the end
    small = sims.sim("single", "--num-gpu-blocks", "40", "--max-model-len", "640", "--enable-per-request-metrics")
    ample = sims.sim("single", "--num-gpu-blocks", "4000", "--max-model-len", "640", "--enable-per-request-metrics")

    async def three(url: str) -> tuple[list[float], dict[str, Any], float]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            tasks = [asyncio.create_task(timed_request(s, url + COMPLETIONS, {"prompt": ids(288), "max_tokens": 16}))
                     for _ in range(3)]
            await asyncio.sleep(0.045)  # front end 8 ms + prefill ~10 ms: two running, one waiting
            state = await get_json(s, url + "/sim/state")
            waiting = metric_value(await metrics_text(s, url), "vllm:num_requests_waiting")
            results = await asyncio.gather(*tasks)
        assert all(r.ok and r.usage["completion_tokens"] == 16 for r in results)
        return sorted(r.metrics["queue_time_ms"] for r in results), state, waiting

    waits, state, waiting = run(three(small))
    assert state["waiting"] == 1 and state["running"] == 2 and state["kv_blocks_free"] < 18
    assert waiting == 1
    assert waits[0] < 20 and waits[1] < 20
    assert waits[2] > 60  # waited for a whole request (16 decode steps) to free its blocks
    waits, state, _ = run(three(ample))
    assert state["waiting"] == 0 and max(waits) < 20


def test_running_sequences_are_preempted_when_the_cache_fills(sims):
    url = sims.sim("single", "--num-gpu-blocks", "40", "--max-model-len", "640", "--stream-interval", "1")

    async def scenario() -> tuple[list[Timed], dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            body = {"max_tokens": 60, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            results = await asyncio.gather(*[timed_request(s, url + COMPLETIONS, dict(body, prompt=ids(300)))
                                             for _ in range(2)])
            return list(results), await get_json(s, url + "/sim/state")
    results, state = run(scenario())
    assert all(r.ok and r.chunk_tokens[-1] == 60 for r in results)
    assert state["preemptions"] >= 1 and state["kv_blocks_used"] == 0
    # the preempted request recomputed its prompt and tokens: one gap of a prefill step, not a decode step
    assert max(r.max_gap for r in results) > 2 * min(float(np.median(r.gaps)) for r in results)


# ---- 4. misc -------------------------------------------------------------------------------------------
def test_time_scale_speeds_everything_up(sims):
    normal = sims.sim("single")
    fast = sims.sim("single", "--time-scale", "0.5")

    async def itl(url: str) -> float:
        async with aiohttp.ClientSession() as s:
            t = await timed_request(s, url + COMPLETIONS, dict(STREAM_BODY, prompt=ids(16), max_tokens=60))
            return t.per_token_itl
    slow_itl, fast_itl = run(itl(normal)), run(itl(fast))
    assert 0.4 < fast_itl / slow_itl < 0.65


def test_sigterm_stops_promptly_with_streams_open():
    proc, url = start_sim("single")

    async def open_stream() -> None:
        async with aiohttp.ClientSession() as s:
            await timed_request(s, url + COMPLETIONS, dict(STREAM_BODY, prompt=ids(16), max_tokens=2000))

    async def scenario() -> tuple[int, float]:
        task = asyncio.create_task(open_stream())
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        code = await asyncio.get_running_loop().run_in_executor(None, proc.stop)
        await asyncio.wait_for(task, 5)
        return code, time.monotonic() - t0
    code, took = run(scenario())
    assert code == 0 and took < scaled(4), proc.output()


def test_client_disconnect_aborts_the_request(sims):
    url = sims.sim("single")

    async def scenario() -> tuple[dict[str, Any], str]:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + COMPLETIONS, json=dict(STREAM_BODY, prompt=ids(16), max_tokens=1000)) as r:
                chunks = 0
                async for line in r.content:
                    chunks += line.startswith(b"data: ")
                    if chunks == 5:
                        break  # leaving the block closes the connection mid-stream
            await asyncio.sleep(0.2)
            return await get_json(s, url + "/sim/state"), await metrics_text(s, url)
    state, text = run(scenario())
    assert state["running"] == 0 and state["kv_blocks_used"] == 0
    assert metric_value(text, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric_value(text, "vllm:generation_tokens_total") < 200  # stopped long before max_tokens
