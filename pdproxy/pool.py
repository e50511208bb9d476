"""Instances, their health, and how one is chosen for each leg.

Health has two sources: an active probe (`GET /health` every few seconds) and passive outlier
detection (consecutive connection errors or 5xx answers eject an instance). An ejected instance
is skipped until a probe succeeds again; with probes disabled it is re-admitted after a cool-off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from pdproxy.errors import ProxyError

log = logging.getLogger("pdproxy.pool")

PREFILL, DECODE = "prefill", "decode"
EJECTION_COOL_OFF = 10.0  # seconds; used only when active health checks are off


@dataclass(eq=False)
class Instance:
    url: str
    role: str
    inflight: int = 0
    healthy: bool = True
    consecutive_failures: int = 0
    ejected_at: float = 0.0
    host: str = field(init=False)
    port: int = field(init=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class Pool:
    """The instances of one role and the policy that picks among the healthy ones."""

    def __init__(self, role: str, urls: list[str], policy: str = "round_robin", eject_after: int = 3,
                 cool_off: float | None = EJECTION_COOL_OFF) -> None:
        self.role = role
        self.instances = [Instance(url, role) for url in urls]
        self.policy = policy
        self.eject_after = eject_after
        self.cool_off = cool_off  # None: only a passing health check re-admits
        self._next = 0

    def __len__(self) -> int:
        return len(self.instances)

    def choose(self, exclude: Instance | None = None) -> Instance:
        """Pick an instance; `exclude` steers a retry away from the one that just failed."""
        self._readmit_cooled_off()
        candidates = [i for i in self.instances if i.healthy and i is not exclude]
        if not candidates and exclude is not None and exclude.healthy:
            candidates = [exclude]
        if not candidates:
            raise ProxyError(
                503, f"no healthy {self.role} instance available", error_type="no_healthy_instance", stage=self.role,
                retry_after=1,
            )
        start = self._next % len(candidates)
        self._next += 1
        if self.policy == "least_inflight":
            rotated = candidates[start:] + candidates[:start]  # ties go round-robin
            return min(rotated, key=lambda i: i.inflight)
        return candidates[start]

    def succeeded(self, instance: Instance) -> None:
        instance.consecutive_failures = 0

    def failed(self, instance: Instance) -> None:
        """A connection error or 5xx: eject after `eject_after` in a row (0 disables passive ejection)."""
        instance.consecutive_failures += 1
        if self.eject_after and instance.consecutive_failures >= self.eject_after and instance.healthy:
            instance.healthy = False
            instance.ejected_at = time.monotonic()
            log.warning("ejecting %s instance %s after %d consecutive failures", self.role, instance.url,
                        instance.consecutive_failures)

    def _readmit_cooled_off(self) -> None:
        if self.cool_off is None:
            return
        now = time.monotonic()
        for inst in self.instances:
            if not inst.healthy and now - inst.ejected_at > self.cool_off:
                inst.healthy, inst.consecutive_failures = True, 0


class HealthChecker:
    """Probes every instance of the given pools and flips their `healthy` flag."""

    def __init__(self, pools: list[Pool], session: aiohttp.ClientSession, path: str, interval: float, timeout: float,
                 headers: dict[str, str] | None = None) -> None:
        self.pools = pools
        self.session = session
        self.path = path
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.headers = headers or {}
        self._task: asyncio.Task | None = None
        for pool in pools:
            pool.cool_off = None  # re-admission is this checker's job now

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="health-checker")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def check_all(self) -> None:
        await asyncio.gather(*(self._probe(pool, inst) for pool in self.pools for inst in pool.instances))

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)

    async def _probe(self, pool: Pool, inst: Instance) -> None:
        try:
            async with self.session.get(inst.url + self.path, timeout=self.timeout, headers=self.headers) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ok = False
        if ok and not inst.healthy:
            log.info("%s instance %s is healthy again", pool.role, inst.url)
            inst.healthy, inst.consecutive_failures = True, 0
        elif not ok and inst.healthy:
            log.warning("%s instance %s failed its health check", pool.role, inst.url)
            inst.healthy, inst.ejected_at = False, time.monotonic()
