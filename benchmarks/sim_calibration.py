#!/usr/bin/env python3
"""Does `pdproxy sim` with its default preset reproduce real vLLM on one H200?

Starts simulated instances as processes on 127.0.0.1 and compares with
tests/fixtures/vllm023/real-vllm-h200.md (numbers copied into pdproxy/sim/presets.py):

1. calibration curves, each point PASS when within 15 %:
   - prefill TTFT of a lone request at 128..4096 prompt tokens (median of 7, token-id prompts);
   - per-token ITL with 1..128 concurrent streams (median over streams of
     (last chunk - first chunk) / tokens in between; streams use --stream-interval 4 so the
     Python client can keep up at 128 streams: the rate per token does not depend on chunking);
   - NIXL transfer time (the decode's vllm:nixl_xfer_time_seconds) and P/D TTFT (prefill
     request + decode request to its first token, orchestrated here like vLLM's toy proxy);
2. a mixed load (24 closed-loop streams of 200-token prompts x 256 tokens, plus one 3000-token
   prompt x 16 tokens per second) against single (max-num-batched-tokens 16384), single with
   2048-token chunked prefill, and P/D over the two-GPU link, with the real table beside it and
   the orderings checked: big-step single has the worst per-request tail ITL, chunked prefill
   bounds it, P/D's tail is below single's (no prefill on the decode; its KV arrivals stall it) and
   P/D does not raise throughput; then the recorded 2-GPU workload's KV-arrival stall (streams whose
   decode window held a long prompt's KV arrival against the others). A last short run shows the
   transfer-link collapse of the one-GPU preset (offered KV bytes above the link bandwidth).

Percentiles: numpy linear. Exit status 0 when every check passes. Run it on a quiet machine: the
simulator's own HTTP path (~1.5 ms) is part of the small-prompt TTFT points, and background load
on a 2-core host can add a few ms there (15 % of 17 ms is 2.5 ms).
Usage: python benchmarks/sim_calibration.py [--mixed-seconds 24] [--warmup-seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdproxy.sim.presets import (REAL_DECODE_ITL_MS, REAL_KV_ARRIVAL_STALL_MS, REAL_NIXL_XFER_2GPU_MS,  # noqa: E402
                                 REAL_NIXL_XFER_MS, REAL_PD_TTFT_MS, REAL_PREFILL_TTFT_MS)
from pdproxy.sim.probe import Timed, pd_request, timed_request  # noqa: E402

HOST = "127.0.0.1"
TOLERANCE = 0.15
COMPLETIONS = "/v1/completions"
REAL_MIXED = {  # tests/fixtures/vllm023/real-vllm-h200.md, mixed-load table
    "single-16384": dict(ttft=(200, 236, 318), itl=(5.6, 6.7, 35.4), max_itl=(85, 100, 198), gap100=10.8,
                         long_ttft=(147, 304), chunks=3291),
    "single-chunked-2048": dict(ttft=(166, 231, 321), itl=(5.6, 6.6, 36.6), max_itl=(53, 71, 75), gap100=0.0,
                                long_ttft=(156, 283), chunks=3343),
    "P/D (2 GPUs)": dict(ttft=(151, 246, 553), itl=(5.4, 7.3, 25.1), max_itl=(65, 74, 116), gap100=2.2,
                         long_ttft=(275, 432), chunks=3489),
}


# ---- processes -------------------------------------------------------------------------------
class Sim:
    def __init__(self, role: str, *flags: str) -> None:
        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"sim-cal-{role}-", suffix=".log", delete=False)
        args = [sys.executable, "-m", "pdproxy", "sim", "--role", role, "--host", HOST, "--port", str(self.port),
                *flags]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sim exited: {Path(self.log.name).read_text()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"sim on {self.url} did not come up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        os.unlink(self.log.name)


class Sims:
    def __init__(self) -> None:
        self.started: list[Sim] = []

    def start(self, role: str, *flags: str) -> Sim:
        sim = Sim(role, *flags)
        self.started.append(sim)
        return sim

    def stop_all(self) -> None:
        while self.started:
            self.started.pop().stop()


async def metric_sum(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


# ---- reporting ---------------------------------------------------------------------------------
@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    def compare(self, label: str, measured: float, real: float) -> str:
        dev = measured / real - 1
        ok = abs(dev) <= TOLERANCE
        self.checks.append(Check(label, ok, f"{measured:.1f} vs {real:.1f} ({dev:+.1%})"))
        return f"{measured:9.1f} {real:9.1f} {dev:+8.1%}  {'PASS' if ok else 'FAIL'}"

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else float("nan")


def token_prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 100000) for _ in range(n)]


# ---- 1. calibration curves ---------------------------------------------------------------------------
async def prefill_curve(sims: Sims, report: Report, rng: random.Random) -> None:
    sim = sims.start("single")
    print("\nPrefill TTFT, lone request, single instance (default preset), median of 7")
    print(f"{'tokens':>8} {'sim ms':>9} {'real ms':>9} {'dev':>8}")
    async with aiohttp.ClientSession() as s:
        for _ in range(3):  # warm-up: connection, first-use paths
            await timed_request(s, sim.url + COMPLETIONS, {"prompt": token_prompt(64, rng), "max_tokens": 2,
                                                           "stream": True})
        for n, real in REAL_PREFILL_TTFT_MS.items():
            ttfts = []
            for _ in range(7):
                t = await timed_request(s, sim.url + COMPLETIONS, {"prompt": token_prompt(n, rng), "max_tokens": 2,
                                                                   "stream": True})
                ttfts.append(t.ttft * 1000)
                await asyncio.sleep(0.02)
            print(f"{n:>8} " + report.compare(f"prefill TTFT {n}", float(np.median(ttfts)), real))
    sims.stop_all()


async def itl_curve(sims: Sims, report: Report, rng: random.Random) -> None:
    sim = sims.start("single", "--stream-interval", "4")
    print("\nPer-token ITL with N concurrent streams (default preset), median over streams")
    print(f"{'streams':>8} {'sim ms':>9} {'real ms':>9} {'dev':>8}")
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        for n, real in REAL_DECODE_ITL_MS.items():
            body = {"max_tokens": 160, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            reps = 3 if n < 8 else 1
            values = []
            for _ in range(reps):
                results = await asyncio.gather(*[
                    timed_request(s, sim.url + COMPLETIONS, dict(body, prompt=token_prompt(32, rng)))
                    for _ in range(n)])
                values += [r.per_token_itl * 1000 for r in results if r.ok and r.per_token_itl]
            print(f"{n:>8} " + report.compare(f"ITL at {n} streams", float(np.median(values)), real))
    sims.stop_all()


async def warm_pd(s: aiohttp.ClientSession, p: Sim, d: Sim, rng: random.Random, name: str) -> None:
    for i in range(3):
        await pd_request(s, p.url, d.url, COMPLETIONS, {"prompt": token_prompt(64, rng), "max_tokens": 2,
                                                        "stream": True}, f"{name}-{i}")


async def transfer(s: aiohttp.ClientSession, p: Sim, d: Sim, tokens: int, rng: random.Random,
                   name: str) -> tuple[float, Any]:
    """One P/D request of `tokens` prompt tokens: its KV transfer (ms, the decode's own metric) and result."""
    before = await metric_sum(s, d.url, "vllm:nixl_xfer_time_seconds_sum")
    r = await pd_request(s, p.url, d.url, COMPLETIONS, {"prompt": token_prompt(tokens, rng), "max_tokens": 2,
                                                        "stream": True}, name)
    assert r.ok, (r.prefill.error, r.decode and r.decode.error)
    return (await metric_sum(s, d.url, "vllm:nixl_xfer_time_seconds_sum") - before) * 1000, r


async def pd_curve(sims: Sims, report: Report, rng: random.Random) -> None:
    p = sims.start("prefill")
    d = sims.start("decode")
    print("\nP/D on the default preset (two instances on one GPU): median of 3")
    print(f"{'tokens':>8} {'MB':>7} | {'xfer sim':>9} {'real':>9} {'dev':>8}      | {'P/D TTFT':>9} {'real':>9} "
          f"{'dev':>8}      | prefill  hand-off")
    async with aiohttp.ClientSession() as s:
        await warm_pd(s, p, d, rng, "warm")
        for n in REAL_NIXL_XFER_MS:
            xfers, ttfts, prefills, mbs = [], [], [], []
            for i in range(3):
                bytes_before = await metric_sum(s, d.url, "vllm:nixl_bytes_transferred_sum")
                xfer, r = await transfer(s, p, d, n, rng, f"cal-{n}-{i}")
                xfers.append(xfer)
                mbs.append((await metric_sum(s, d.url, "vllm:nixl_bytes_transferred_sum") - bytes_before) / 1e6)
                ttfts.append(r.ttft * 1000)
                prefills.append((r.prefill.done_at - r.prefill.sent_at) * 1000)
            x, t, pf = float(np.median(xfers)), float(np.median(ttfts)), float(np.median(prefills))
            print(f"{n:>8} {np.median(mbs):7.1f} | " + report.compare(f"NIXL transfer {n}", x, REAL_NIXL_XFER_MS[n])
                  + " | " + report.compare(f"P/D TTFT {n}", t, REAL_PD_TTFT_MS[n])
                  + f" | {pf:7.1f} {t - pf - x:8.1f}")
    sims.stop_all()


async def pd_2gpu_curve(sims: Sims, report: Report, rng: random.Random) -> None:
    p = sims.start("prefill", "--preset", "h200-llama8b-2gpu")
    d = sims.start("decode", "--preset", "h200-llama8b-2gpu")
    print("\nNIXL transfer on the two-GPU preset (P and D on two H200s): median of 3")
    print(f"{'tokens':>8} {'xfer sim':>9} {'real':>9} {'dev':>8}")
    async with aiohttp.ClientSession() as s:
        await warm_pd(s, p, d, rng, "warm2")
        for n, real in REAL_NIXL_XFER_2GPU_MS.items():
            xfers = [(await transfer(s, p, d, n, rng, f"cal2-{n}-{i}"))[0] for i in range(3)]
            print(f"{n:>8} " + report.compare(f"NIXL transfer 2 GPUs {n}", float(np.median(xfers)), real))
    sims.stop_all()


# ---- 2. mixed load -----------------------------------------------------------------------------------
@dataclass
class MixedResult:
    name: str
    gpus: int
    streams: list[Timed] = field(default_factory=list)
    longs: list[Timed] = field(default_factory=list)
    ttft_streams: list[float] = field(default_factory=list)
    ttft_longs: list[float] = field(default_factory=list)
    failed: int = 0
    chunks: int = 0
    tokens: int = 0
    window: float = 0.0


async def mixed_load(name: str, gpus: int, single_url: str | None, pd_urls: tuple[str, str] | None,
                     seconds: float, warmup: float, rng: random.Random, streams: int = 24,
                     long_tokens: int = 3000, stream_tokens: int = 200, long_every: float = 1.0) -> MixedResult:
    """Closed-loop streams plus one long prompt every `long_every` s; stats over requests started after
    warm-up and finished before the end; chunks/s and tokens/s over the measured window."""
    res = MixedResult(name, gpus)
    start = time.perf_counter()
    t_measure, t_end = start + warmup, start + warmup + seconds
    counter = 0

    async def one(session: aiohttp.ClientSession, prompt_tokens: int,
                  max_tokens: int) -> tuple[Timed | None, float | None]:
        nonlocal counter
        counter += 1
        body = {"prompt": token_prompt(prompt_tokens, rng), "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if pd_urls:
            r = await pd_request(session, pd_urls[0], pd_urls[1], COMPLETIONS, body, f"mix-{counter}")
            return r.decode if r.decode is not None else r.prefill, r.ttft
        t = await timed_request(session, single_url + COMPLETIONS, body, {"X-Request-Id": f"mix-{counter}"})
        return t, t.ttft

    def account(t: Timed | None, ttft: float | None, sent: float, is_long: bool) -> None:
        if t is not None:  # rates: whatever was delivered inside the window, from any request
            prev = 0
            for when, tokens in zip(t.chunk_times, t.chunk_tokens):
                if t_measure <= when <= t_end:
                    res.chunks += 1
                    res.tokens += tokens - prev
                prev = tokens
        if sent < t_measure or t is None or (t.done_at or 1e18) > t_end:
            return  # latency statistics: requests sent after the warm-up and finished in the window
        if not t.ok or ttft is None:
            res.failed += 1
            return
        (res.longs if is_long else res.streams).append(t)
        (res.ttft_longs if is_long else res.ttft_streams).append(ttft * 1000)

    async def stream_worker(session: aiohttp.ClientSession, offset: float) -> None:
        await asyncio.sleep(offset)
        while time.perf_counter() < t_end:
            sent = time.perf_counter()
            t, ttft = await one(session, stream_tokens, 256)
            account(t, ttft, sent, False)

    async def long_worker(session: aiohttp.ClientSession) -> None:
        tasks = []
        k = 0
        while True:
            at = start + 0.5 + k * long_every
            if at >= t_end - 1.0:
                break
            await asyncio.sleep(max(0.0, at - time.perf_counter()))

            async def fire(sent: float) -> None:
                t, ttft = await one(session, long_tokens, 16)
                account(t, ttft, sent, True)
            tasks.append(asyncio.create_task(fire(time.perf_counter())))
            k += 1
        await asyncio.gather(*tasks)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=seconds + warmup + 60)) as s:
        work = [stream_worker(s, i * 0.05) for i in range(streams)] + [long_worker(s)]
        try:
            await asyncio.wait_for(asyncio.gather(*work), timeout=seconds + warmup + 30)
        except TimeoutError:
            pass
    res.window = seconds
    return res


def mixed_row(r: MixedResult) -> dict[str, Any]:
    gaps = [g * 1000 for t in r.streams for g in t.gaps]
    maxes = [t.max_gap * 1000 for t in r.streams if t.max_gap is not None]
    return dict(
        n=len(r.streams), longs=len(r.longs), failed=r.failed,
        ttft=[pct(r.ttft_streams, q) for q in (50, 90, 99)],
        itl=[pct(gaps, q) for q in (50, 90, 99)],
        max_itl=[pct(maxes, q) for q in (50, 90, 99)],
        gap100=100.0 * sum(1 for m in maxes if m > 100) / max(1, len(maxes)),
        long_ttft=[pct(r.ttft_longs, q) for q in (50, 99)],
        chunks=r.chunks / r.window,
        tokens_s=r.tokens / r.window,
    )


def fmt3(vals: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in vals)


def print_mixed(results: list[MixedResult]) -> dict[str, dict[str, Any]]:
    def fmt(vals: list[float], digits: int = 0) -> str:
        return " / ".join(f"{v:.{digits}f}" for v in vals)

    print(f"\n{'set-up':<22}{'GPUs':>5} {'reqs':>5} {'fail':>5}  {'streams TTFT p50/p90/p99':>26}  "
          f"{'pooled ITL p50/p90/p99':>24}  {'max ITL p50/p90/p99':>21}  {'gap>100ms':>9}  "
          f"{'long TTFT p50/p99':>18}  {'chunks/s':>8}  {'tokens/s':>8}")
    rows = {}
    for r in results:
        row = mixed_row(r)
        tokens_s = row["tokens_s"]
        rows[r.name] = row
        print(f"{r.name:<22}{r.gpus:>5} {row['n']:>5} {row['failed']:>5}  {fmt(row['ttft']):>26}  "
              f"{fmt(row['itl'], 1):>24}  {fmt(row['max_itl']):>21}  {row['gap100']:>8.1f}%  "
              f"{fmt(row['long_ttft']):>18}  {row['chunks']:>8.0f}  {tokens_s:>8.0f}")
        real = REAL_MIXED.get(r.name)
        if real:
            print(f"{'  real vLLM':<22}{r.gpus:>5} {'':>5} {'':>5}  {fmt(real['ttft']):>26}  "
                  f"{fmt(real['itl'], 1):>24}  {fmt(real['max_itl']):>21}  {real['gap100']:>8.1f}%  "
                  f"{fmt(real['long_ttft']):>18}  {real['chunks']:>8.0f}  {'':>8}")
    return rows


async def mixed_section(sims: Sims, report: Report, rng: random.Random, seconds: float, warmup: float) -> None:
    print(f"\nMixed load: 24 closed-loop streams (200-token prompts, 256 tokens) + one 3000-token prompt "
          f"(16 tokens) per second; {seconds:.0f} s measured after {warmup:.0f} s warm-up; ms; numpy linear")
    results = []
    sim = sims.start("single")
    results.append(await mixed_load("single-16384", 1, sim.url, None, seconds, warmup, rng))
    sims.stop_all()
    sim = sims.start("single", "--max-num-batched-tokens", "2048")
    results.append(await mixed_load("single-chunked-2048", 1, sim.url, None, seconds, warmup, rng))
    sims.stop_all()
    p = sims.start("prefill", "--preset", "h200-llama8b-2gpu")
    d = sims.start("decode", "--preset", "h200-llama8b-2gpu")
    results.append(await mixed_load("P/D (2 GPUs)", 2, None, (p.url, d.url), seconds, warmup, rng))
    sims.stop_all()
    rows = print_mixed(results)

    print("\nOrdering checks (the mixed-load table's findings)")
    big, chunked, pd = rows["single-16384"], rows["single-chunked-2048"], rows["P/D (2 GPUs)"]
    for name, row in rows.items():
        report.check(f"{name}: no failed requests and enough samples", row["failed"] == 0 and row["n"] >= 50,
                     f"{row['n']} stream requests, {row['longs']} long, {row['failed']} failed")
    # Per-request max ITL is already a tail statistic; it is compared across requests at p50 and p90
    # (p99 is printed) so that one scheduling hiccup of this shared 2-core machine cannot flip an order.
    report.check("big-step single has the worst per-request tail ITL",
                 all(big["max_itl"][i] > chunked["max_itl"][i] and big["max_itl"][i] > pd["max_itl"][i]
                     for i in (0, 1)),
                 f"max ITL p50/p90/p99 single {fmt3(big['max_itl'])} ms, chunked {fmt3(chunked['max_itl'])}, "
                 f"P/D {fmt3(pd['max_itl'])}")
    report.check("chunked prefill bounds the stall (p90 max ITL under 100 ms, <= 2 % of streams with a gap > 100 ms)",
                 chunked["max_itl"][1] < 100 and chunked["gap100"] <= 2.0,
                 f"p90 max ITL {chunked['max_itl'][1]:.0f} ms, gap>100ms {chunked['gap100']:.1f} % "
                 f"(single: {big['max_itl'][1]:.0f} ms, {big['gap100']:.1f} %)")
    # real: P/D 65 ms p50 against chunked 53 and single 85: prefill is off the decode steps, but the long
    # prompts' KV arrivals stall the decode (the 2-GPU preset's kv_pull_stalls_decode: ~45 ms for these
    # 3000-token prompts, about chunked's; the recorded split is checked below on its own workload)
    report.check("P/D takes the prefill stall off the decode (tail ITL below big-step single's)",
                 pd["max_itl"][0] < big["max_itl"][0] and pd["max_itl"][1] < big["max_itl"][1],
                 f"p50/p90 max ITL P/D {pd['max_itl'][0]:.0f}/{pd['max_itl'][1]:.0f} ms vs single "
                 f"{big['max_itl'][0]:.0f}/{big['max_itl'][1]:.0f} (chunked {chunked['max_itl'][0]:.0f}/"
                 f"{chunked['max_itl'][1]:.0f}; real P/D 65/74, single 85/100, chunked 53/71)")
    ratio = pd["tokens_s"] / big["tokens_s"]
    report.check("P/D does not raise throughput (tokens/s within 15 % of single, i.e. about half per GPU)",
                 ratio < 1.15, f"P/D {pd['tokens_s']:.0f} vs single {big['tokens_s']:.0f} tokens/s "
                               f"(x{ratio:.2f}; per GPU x{ratio / 2:.2f}; real chunks/s x{3489 / 3291:.2f})")
    report.check("P/D long-prompt TTFT is worse than single's (transfer of 3000 tokens)",
                 pd["long_ttft"][0] > big["long_ttft"][0],
                 f"p50 {pd['long_ttft'][0]:.0f} vs {big['long_ttft'][0]:.0f} ms")


def kv_arrival_overlap(r: MixedResult) -> tuple[list[float], list[float]]:
    """Per-request max gap (ms) of the streams whose decode window (first to last token) held a long
    prompt's KV arrival (its first token), and of the others: the recording's request-level view."""
    arrivals = sorted(t.chunk_times[0] for t in r.longs if t.chunk_times)
    with_, others = [], []
    for t in r.streams:
        if t.max_gap is None or len(t.chunk_times) < 2:
            continue
        a, b = t.chunk_times[0], t.chunk_times[-1]
        hit = any(a <= x <= b for x in arrivals)
        (with_ if hit else others).append(t.max_gap * 1000)
    return with_, others


async def kv_stall_section(sims: Sims, report: Report, rng: random.Random, seconds: float, warmup: float) -> None:
    print(f"\nKV-arrival stall: P/D on the two-GPU preset, the recorded workload (16 streams of 453-token prompts "
          f"x 256 tokens, one 4520-token prompt x 16 every 2 s), {seconds:.0f} s after {warmup:.0f} s warm-up")
    p = sims.start("prefill", "--preset", "h200-llama8b-2gpu")
    d = sims.start("decode", "--preset", "h200-llama8b-2gpu")
    res = await mixed_load("P/D (2 GPUs), recorded workload", 2, None, (p.url, d.url), seconds, warmup, rng,
                           streams=16, long_tokens=4520, stream_tokens=453, long_every=2.0)
    sims.stop_all()
    with_, others = kv_arrival_overlap(res)
    real = REAL_KV_ARRIVAL_STALL_MS
    print(f"  streams with a long KV arrival in their decode window: {len(with_)}, others: {len(others)}; "
          f"max gap p50 {pct(with_, 50):.1f} vs {pct(others, 50):.1f} ms (real {real['with_large_kv_arrival']} vs "
          f"{real['others']})")
    enough = len(with_) >= 20 and len(others) >= 5
    report.check("enough streams on both sides of the split", enough, f"{len(with_)} with, {len(others)} without")
    if enough:
        print("  with a KV arrival, max gap p50 " + report.compare("KV-arrival stall (max gap p50)", pct(with_, 50),
                                                                    real["with_large_kv_arrival"]))
        report.check("streams that saw a long prompt's KV arrive stall longer than the others (> 1.5x)",
                     pct(with_, 50) > 1.5 * pct(others, 50),
                     f"p50 {pct(with_, 50):.1f} vs {pct(others, 50):.1f} ms (real x"
                     f"{real['with_large_kv_arrival'] / real['others']:.1f})")


async def collapse_section(sims: Sims, report: Report, rng: random.Random, seconds: float) -> None:
    print(f"\nTransfer-link collapse: P/D on the one-GPU preset (0.341 GB/s), 24 streams + one 2000-token prompt "
          f"per second, {seconds:.0f} s (offered KV ~0.7 GB/s > link)")
    p = sims.start("prefill")
    d = sims.start("decode")
    queued: list[int] = []

    async def sample() -> None:
        async with aiohttp.ClientSession() as s:
            while True:
                await asyncio.sleep(0.5)
                async with s.get(p.url + "/sim/state") as r:
                    queued.append((await r.json())["transfers_queued"])

    sampler = asyncio.create_task(sample())
    res = await mixed_load("P/D one GPU", 1, None, (p.url, d.url), seconds, 1.0, rng, long_tokens=2000)
    sampler.cancel()
    sims.stop_all()
    row = mixed_row(res)
    print(f"  streams TTFT p50/p99 {row['ttft'][0]:.0f} / {row['ttft'][2]:.0f} ms, per-request max ITL p99 "
          f"{row['max_itl'][2]:.0f} ms, {row['tokens_s']:.0f} tokens/s, transfers queued at the prefill: up to "
          f"{max(queued, default=0)}")
    report.check("KV transfers queue on a saturated link: TTFT collapses while decode ITL stays low",
                 max(queued, default=0) >= 3 and row["ttft"][0] > 1000 and row["max_itl"][2] < 50,
                 f"up to {max(queued, default=0)} transfers queued, stream TTFT p50 {row['ttft'][0]:.0f} ms, "
                 f"max ITL p99 {row['max_itl'][2]:.0f} ms (real: TTFT 27 s p50 after 50 s, max ITL < 20 ms)")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixed-seconds", type=float, default=24.0, help="measured seconds per mixed-load set-up")
    ap.add_argument("--warmup-seconds", type=float, default=5.0, help="warm-up excluded from mixed-load stats")
    ap.add_argument("--collapse-seconds", type=float, default=10.0, help="length of the link-collapse run (0: skip)")
    ap.add_argument("--kv-stall-seconds", type=float, default=20.0,
                    help="length of the KV-arrival stall run on the recorded 2-GPU workload (0: skip)")
    ap.add_argument("--only-kv-stall", action="store_true", help="only the 2-GPU link curve and the KV-arrival stall")
    ap.add_argument("--skip-mixed", action="store_true", help="only the calibration curves")
    ap.add_argument("--skip-curves", action="store_true", help="only the mixed load")
    args = ap.parse_args()
    rng = random.Random(7)
    report = Report()
    sims = Sims()
    t0 = time.monotonic()
    try:
        if args.only_kv_stall:
            args.skip_curves = args.skip_mixed = True
            await pd_2gpu_curve(sims, report, rng)
            await kv_stall_section(sims, report, rng, args.kv_stall_seconds, args.warmup_seconds)
        if not args.skip_curves:
            await prefill_curve(sims, report, rng)
            await itl_curve(sims, report, rng)
            await pd_curve(sims, report, rng)
            await pd_2gpu_curve(sims, report, rng)
        if not args.skip_mixed:
            await mixed_section(sims, report, rng, args.mixed_seconds, args.warmup_seconds)
            if args.kv_stall_seconds > 0:
                await kv_stall_section(sims, report, rng, args.kv_stall_seconds, args.warmup_seconds)
            if args.collapse_seconds > 0:
                await collapse_section(sims, report, rng, args.collapse_seconds)
    finally:
        sims.stop_all()
    failed = [c for c in report.checks if not c.ok]
    print(f"\n{len(report.checks) - len(failed)}/{len(report.checks)} checks passed in {time.monotonic() - t0:.0f} s")
    for c in failed:
        print(f"  FAILED: {c.name}: {c.detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
