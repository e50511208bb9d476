"""Two `pdproxy sim` instances time-sharing one GPU slow each other's steps (preset gpu_share).

The simulator's side of the mechanism `pdproxy whatif --fit-run` fits (pdproxy/sim/timing.py `SharedGPU`):
instances given the same --gpu-share-file stretch a step by --gpu-share per other instance stepping at the
same time. Read from the engines' own accounting (`busy_seconds` of /sim/state: the steps' modelled
durations), so the host's load does not blur it.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import pytest

from procs import run, start_proxy, start_sim

pytestmark = pytest.mark.timeout(120)
BODY = {"model": "sim-model", "prompt": "hello there", "max_tokens": 300, "ignore_eos": True}


async def _busy(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/sim/state") as r:
        return float((await r.json())["busy_seconds"])


async def _generate(session: aiohttp.ClientSession, url: str) -> None:
    async with session.post(url + "/v1/completions", json=BODY) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def _busy_for(session: aiohttp.ClientSession, measured: str, others: list[str]) -> float:
    before = await _busy(session, measured)
    await asyncio.gather(_generate(session, measured), *(_generate(session, u) for u in others))
    return await _busy(session, measured) - before


@pytest.mark.parametrize("share, low, high", [(1.0, 1.6, 2.1), (0.0, 0.9, 1.1)])
def test_two_instances_sharing_one_gpu_slow_each_other(tmp_path, share, low, high):
    gpu = str(tmp_path / "gpu")
    a, url_a = start_sim("single", "--gpu-share", str(share), "--gpu-share-file", gpu)
    b, url_b = start_sim("single", "--gpu-share", str(share), "--gpu-share-file", gpu)
    try:
        async def main() -> tuple[float, float]:
            async with aiohttp.ClientSession() as s:
                alone = await _busy_for(s, url_a, [])
                shared = await _busy_for(s, url_a, [url_b])
                return alone, shared

        alone, shared = asyncio.run(main())
    finally:
        a.stop()
        b.stop()
    assert alone > 0
    # 300 decode steps side by side: with full time-slicing each step of A is about twice as long
    assert low <= shared / alone <= high, (alone, shared)


@pytest.mark.parametrize("args, message", [
    (["--gpu-share", "1"], "--gpu-share needs --gpu-share-file"),
    (["--gpu-share", "-0.5", "--gpu-share-file", "{f}"], "--gpu-share must be >= 0"),
])
def test_bad_gpu_share_flags_are_a_clear_error(tmp_path, args, message):
    argv = [a.format(f=tmp_path / "gpu") for a in args]
    p = run([sys.executable, "-m", "pdproxy", "sim", "--port", "0", *argv], timeout=60)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr


async def _single_busy_beside_a_transfer(session: aiohttp.ClientSession, single: str,
                                         proxy: str) -> tuple[float, float]:
    """The single's modelled busy time for one long generation, alone, then while a P/D request's KV crosses the
    prefill's link (a long prompt, one token to decode): what the copies took of the shared GPU."""
    alone = await _busy_for(session, single, [])

    async def transfer() -> None:
        await asyncio.sleep(0.2)  # the single is streaming when the prompt arrives
        body = {"model": "sim-model", "prompt": "word " * 450, "max_tokens": 1}
        async with session.post(proxy + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()

    before = await _busy(session, single)
    await asyncio.gather(_generate(session, single), transfer())
    return alone, await _busy(session, single) - before


@pytest.mark.parametrize("link, low, high", [("--kv-link-shares-gpu", 1.25, 2.6),
                                              ("--no-kv-link-shares-gpu", 0.9, 1.15)])
def test_kv_copies_share_the_gpu_unless_told_not_to(tmp_path, link, low, high):
    """A prefill's KV copies count as one more busy instance on the shared GPU (the presets' default), or run beside
    the steps untouched (`kv_link_shares_gpu` off, what `pdproxy whatif --fit-run` may fit): ~1.2 s of copy
    (1,000 tokens of KV at 0.1 GB/s) beside ~1.5 s of another instance's decoding stretches it (1.4x here, up to
    1.8x on a loaded host, where the prefill's and decode's own steps overlap it more) or leaves it."""
    shared = ("--gpu-share", "1", "--gpu-share-file", str(tmp_path / "gpu"))
    procs = []
    try:
        single, url = start_sim("single", *shared)
        procs.append(single)
        prefill, p_url = start_sim("prefill", *shared, link, "--kv-bandwidth-gbps", "0.1")
        procs.append(prefill)
        decode, d_url = start_sim("decode", *shared)
        procs.append(decode)
        proxy, proxy_url = start_proxy("--prefill", p_url, "--decode", d_url, "--no-tracing")
        procs.append(proxy)

        async def main() -> tuple[float, float]:
            async with aiohttp.ClientSession() as s:
                return await _single_busy_beside_a_transfer(s, url, proxy_url)

        alone, beside = asyncio.run(main())
    finally:
        for p in reversed(procs):
            p.stop()
    assert alone > 0
    assert low <= beside / alone <= high, (link, alone, beside)
