"""Route by the engines' own load, read from each vLLM instance's /metrics, plus this proxy's in-flight count.

Every `load_metrics_interval` seconds a background task reads, per instance (vLLM 0.23 names, summed over
the `engine` label; the KV usage averaged):

* `vllm:num_requests_waiting` — queued in the engine, from every client and every proxy replica: the
  best single predictor of the queueing part of TTFT;
* `vllm:num_requests_running` — in the batch;
* `vllm:kv_cache_usage_perc` — 1.0 is a full cache, where new work waits or preempts.

score = in-flight (this proxy) + waiting + RUNNING_WEIGHT × running + KV_WEIGHT × kv_usage; the lowest
wins, ties in turn. Running counts half because this proxy's own share of it is in its in-flight count.
Several replicas reading the same engines see the same state, which in-flight counts alone cannot give.

When any candidate's reading is missing or older than `STALE_INTERVALS` intervals (the instance does not
serve /metrics, answers an error, or is slow), the choice falls back to in-flight counts for all of them
(reason `inflight_fallback`): scores of two kinds are not comparable. A reading that is not a finite,
non-negative number (NaN, +Inf, -3) is no reading: one such instance would otherwise take all the load or
none. The first failure per instance is logged, every one is counted. Routing never waits for a read.

An instance's /metrics is read by whatever serves on its port, so reading it costs bounded work on the
event loop: at most `MAX_METRICS_BYTES` (a real exposition is tens of KB), one regular-expression scan in
C for the three families, and at most `MAX_SAMPLES` of their samples; anything beyond is unreadable.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import aiohttp

from pdproxy.policies.base import Decision, Instance, Rotation, loads
from pdproxy.policies.request import RequestView

log = logging.getLogger("pdproxy.policies.load_aware")

WAITING, RUNNING, KV_USAGE = "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"
RUNNING_WEIGHT, KV_WEIGHT = 0.5, 4.0
STALE_INTERVALS = 3
MAX_METRICS_BYTES = 2 * 1024 * 1024  # a /metrics larger than this is not read (and counts as a failure)
MAX_SAMPLES = 1024  # of the three families together: one each per engine (data-parallel rank) in vLLM
# a sample line of one of the three families: name, optional {labels}, value (a timestamp may follow)
_SAMPLE = re.compile(rb"\n(" + b"|".join(re.escape(n.encode()) for n in (WAITING, RUNNING, KV_USAGE))
                     + rb")(?:\{[^\n]*\})?[ \t]+([^ \t\n]+)")


@dataclass(slots=True)
class Reading:
    waiting: float
    running: float
    kv_usage: float
    at: float  # monotonic
    score: float = 0.0

    def __post_init__(self) -> None:
        self.score = self.waiting + RUNNING_WEIGHT * self.running + KV_WEIGHT * self.kv_usage


def parse_load(raw: bytes | bytearray) -> tuple[float, float, float]:
    """(waiting, running, kv usage) from a Prometheus exposition; ValueError when a gauge is missing, a
    value is not a finite non-negative number, or there are more than `MAX_SAMPLES` samples."""
    sums: dict[bytes, list[float]] = {WAITING.encode(): [], RUNNING.encode(): [], KV_USAGE.encode(): []}
    for count, match in enumerate(_SAMPLE.finditer(b"\n" + raw)):
        if count == MAX_SAMPLES:
            raise ValueError(f"more than {MAX_SAMPLES} samples of the load gauges")
        value = float(match[2])  # ValueError on a value that is not a number
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{match[1].decode()} is {match[2].decode(errors='replace')[:32]}")
        sums[match[1]].append(value)
    if not all(sums.values()):
        raise ValueError("missing " + ", ".join(name.decode() for name, values in sums.items() if not values))
    waiting, running, usage = sums.values()
    load = (sum(waiting), sum(running), sum(usage) / len(usage))
    if not all(map(math.isfinite, load)):
        raise ValueError("the load gauges sum to infinity")
    return load


class LoadAware:
    name: ClassVar[str] = "load_aware"
    reasons: ClassVar[tuple[str, ...]] = ("engine_load", "inflight_fallback")

    def __init__(self, load_metrics_interval: float = 2.0) -> None:
        self.interval = load_metrics_interval
        self.readings: dict[str, Reading] = {}  # instance url -> its last good reading
        self.failures: dict[str, int] = {}  # instance url -> reads that failed (pdproxy_engine_metrics_failures)
        self._failing: set[str] = set()  # logged as failing, not yet readable again
        self.rotation = Rotation()
        self._task: asyncio.Task | None = None

    # -- routing --------------------------------------------------------------------------

    def _fresh(self, instance, now: float) -> Reading | None:  # for /status
        reading = self.readings.get(instance.url)
        if reading is None or now - reading.at > STALE_INTERVALS * self.interval:
            return None
        return reading

    def choose(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]:
        oldest = time.monotonic() - STALE_INTERVALS * self.interval
        readings = self.readings
        values: list[float] = []
        for inst in instances:
            r = readings.get(inst.url)
            if r is None or r.at < oldest:
                counts = loads(instances)
                return self.rotation.least(instances, counts), Decision(self.name, "inflight_fallback",
                                                                        compared=instances, values=counts)
            values.append(inst.inflight + r.score)
        return self.rotation.least(instances, values), Decision(self.name, "engine_load", compared=instances,
                                                                values=values)

    def status(self, instances: Sequence[Instance]) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        out = {}
        for i in instances:
            r = self._fresh(i, now)
            entry: dict[str, Any] = {"inflight": i.inflight, "metrics": "ok" if r else "unreadable",
                                     "metrics_failures": self.failures.get(i.url, 0)}
            if r is not None:
                entry.update(waiting=r.waiting, running=r.running, kv_cache_usage=r.kv_usage,
                             score=i.inflight + r.score, age_seconds=round(now - r.at, 3))
            out[i.address] = entry
        return out

    # -- reading the engines ----------------------------------------------------------------

    def start(self, instances: Callable[[], Sequence[Instance]], session: aiohttp.ClientSession,
              headers: dict[str, str]) -> None:
        """Read the engines `instances()` names at each round (the pool's members of the moment)."""
        self._task = asyncio.create_task(self._loop(instances, session, headers), name="engine-metrics")

    def forget(self, instance: Instance) -> None:
        """`instance` left the pool: its reading and failure count go (no series of a departed instance)."""
        self.readings.pop(instance.url, None)
        self.failures.pop(instance.url, None)
        self._failing.discard(instance.url)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self, instances: Callable[[], Sequence[Instance]], session: aiohttp.ClientSession,
                    headers: dict[str, str]) -> None:
        timeout = aiohttp.ClientTimeout(total=max(self.interval, 0.5))
        while True:
            await asyncio.gather(*(self.read(i.url, session, headers, timeout) for i in instances()))
            await asyncio.sleep(self.interval)

    async def read(self, url: str, session: aiohttp.ClientSession, headers: dict[str, str],
                   timeout: aiohttp.ClientTimeout) -> None:
        try:
            async with session.get(url + "/metrics", headers=headers, timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                raw = bytearray()
                async for chunk in resp.content.iter_chunked(65536):
                    raw += chunk
                    if len(raw) > MAX_METRICS_BYTES:
                        raise ValueError("exposition too large")
            waiting, running, usage = parse_load(raw)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            self.failures[url] = self.failures.get(url, 0) + 1
            if url not in self._failing:
                self._failing.add(url)
                log.warning("cannot read engine load from %s/metrics (%s); routing by in-flight counts until "
                            "it can be read", url, str(exc) or type(exc).__name__)
            return
        if url in self._failing:
            self._failing.discard(url)
            log.info("engine load from %s/metrics readable again", url)
        self.readings[url] = Reading(waiting, running, usage, time.monotonic())
