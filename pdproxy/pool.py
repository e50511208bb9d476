"""Instances, their health, and how one is chosen for each leg.

An instance is in rotation when three things hold:
* its last active health check passed (`GET /health` every few seconds; always true with checks off);
* it is not passively ejected: `eject_after` consecutive failures it is to blame for (what counts is
  decided in pd.py: connection errors, resets, 5xx; not read timeouts, which a long answer causes)
  take it out for `eject_seconds` × the number of ejections in a row (capped at 6×), so a flapping
  instance stays out longer each time. A passing health check does not shorten an ejection: an
  instance can answer `/health` and still fail every request (a broken KV connector does). As in
  Envoy (`max_ejection_percent`), at most that share of the pool is ejected at once, and never its
  last instance: failures that hit every instance alike (a client's requests, a shared dependency)
  must not empty the pool;
* it has not asked to be left alone: a 429/503 with `Retry-After` holds it until then. That is
  load, not a fault, so it does not count towards ejection.

When no instance of a role is in rotation, the ones that pass their health check are used anyway
(panic routing, as Envoy does): refusing every request because each instance failed a few times
would turn a blip into an outage. Only when none passes its health check is the request refused.

Membership changes at run time (pdproxy/membership): an instance that leaves is first `draining` (no new
request goes there; those in flight finish) and one its source says is not ready (a pod failing its
readiness probe) is kept but out of rotation. Both are used only when nothing else of the role answers
its health check: removal never fails a request that could be served. The list of instances is replaced,
never changed in place, so a loop over it is never disturbed by a change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import aiohttp

from pdproxy.errors import ProxyError
from pdproxy.policies import REASON_RETRY, Decision, Policy, RequestView, create

log = logging.getLogger("pdproxy.pool")

PREFILL, DECODE = "prefill", "decode"
EJECT_SECONDS = 10.0
MAX_EJECTION_MULTIPLIER = 6
MAX_EJECTION_PERCENT = 50.0  # of a pool (Envoy: 10 %, but it always allows one; P/D pools are small)
MAX_HOLD_SECONDS = 60.0  # a Retry-After of an hour must not take an instance out for an hour


@dataclass(eq=False)
class Instance:
    url: str
    role: str
    inflight: int = 0
    probe_ok: bool = True  # last active health check; stays True when checks are off
    consecutive_failures: int = 0
    ejections: int = 0  # passive ejections in a row; reset by a success after re-admission
    ejected_until: float = 0.0  # monotonic; passively ejected until then
    held_until: float = 0.0  # monotonic; the instance asked (Retry-After) not to get requests until then
    draining: bool = False  # leaving the pool (membership): no new requests
    ready: bool = True  # its membership source says it is ready (a pod's Ready condition)
    host: str = field(init=False)
    port: int = field(init=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def ejected(self) -> bool:
        return time.monotonic() < self.ejected_until

    @property
    def healthy(self) -> bool:
        """Passes its health check and is not passively ejected (what /status and the gauge report)."""
        return self.probe_ok and not self.ejected

    def reserved(self) -> Reserved:
        """`with instance.reserved():` counts a request as in flight here from the moment it is routed here: a
        decode is chosen before the prefill runs, and a burst must see the requests already bound for it."""
        return Reserved(self)

    @property
    def in_rotation(self) -> bool:
        """Not leaving and ready, as far as membership knows (health and ejection aside)."""
        return self.ready and not self.draining

    def available(self, now: float) -> bool:
        return (self.probe_ok and now >= self.ejected_until and now >= self.held_until and self.ready
                and not self.draining)


class Reserved:
    """`Instance.reserved()`'s context manager: a class, compiled, not `contextlib.contextmanager`'s four
    interpreted calls a request."""

    __slots__ = ("instance",)

    def __init__(self, instance: Instance) -> None:
        self.instance = instance

    def __enter__(self) -> None:
        self.instance.inflight += 1

    def __exit__(self, *exc_info: object) -> None:
        self.instance.inflight -= 1


class Pool:
    """The instances of one role, which of them are in rotation, and the policy that picks among those
    (pdproxy/policies/)."""

    def __init__(self, role: str, urls: list[str], policy: str | Policy = "round_robin", eject_after: int = 3,
                 eject_seconds: float = EJECT_SECONDS, max_ejection_percent: float = MAX_EJECTION_PERCENT) -> None:
        self.role = role
        self.instances: list[Instance] = [Instance(url, role) for url in urls]
        self.policy = create(policy) if isinstance(policy, str) else policy
        self.eject_after = eject_after  # 0 disables passive ejection
        self.eject_seconds = eject_seconds
        self.max_ejection_percent = max_ejection_percent
        self.max_ejected = 0
        self._addresses: frozenset[str] = frozenset()
        self._addresses_of: list[Instance] | None = None
        self._resized()

    def __len__(self) -> int:
        return len(self.instances)

    def _resized(self) -> None:
        # instances that may be ejected at once: the share, rounded down, and never all of them
        count = len(self.instances)
        self.max_ejected = max(0, min(count - 1, int(count * self.max_ejection_percent / 100)))

    def has_address(self, address: str) -> bool:
        """Whether an instance of this pool is at `address` (host:port); per KV-event batch, so a set kept
        per version of the list."""
        if self._addresses_of is not self.instances:
            self._addresses = frozenset(i.address for i in self.instances)
            self._addresses_of = self.instances
        return address in self._addresses

    def find(self, url: str) -> Instance | None:
        for instance in self.instances:
            if instance.url == url:
                return instance
        return None

    def add(self, url: str) -> Instance:
        """A new instance in the pool (membership): in rotation once it passes its health check, if checked."""
        instance = Instance(url, self.role)
        self.instances = [*self.instances, instance]
        self._resized()
        return instance

    def remove(self, instance: Instance) -> None:
        """Out of the pool for good; requests still holding it finish there. The policy forgets it."""
        self.instances = [i for i in self.instances if i is not instance]
        self._resized()
        forget = getattr(self.policy, "forget", None)
        if forget is not None:
            forget(instance)

    def choose(self, exclude: Instance | None = None) -> Instance:
        """Pick an instance by load alone; `exclude` steers a retry away from the one that just failed."""
        return self.pick(None, exclude)[0]

    def pick(self, request: RequestView | None, exclude: Instance | None = None) -> tuple[Instance, Decision]:
        """Pick an instance in rotation for `request` (None: nothing known of it) and say why."""
        instance, decision = self.policy.choose(self.candidates(exclude), request)
        if exclude is not None:
            decision.reason = REASON_RETRY
        return cast(Instance, instance), decision  # one of the candidates

    def candidates(self, exclude: Instance | None = None) -> list[Instance]:
        """The instances a policy may choose from: those in rotation, else (panic routing) those that pass their
        health check, leaving or unready ones last; `exclude` only when nothing else is left."""
        now = time.monotonic()
        others = [i for i in self.instances if i is not exclude]
        candidates = [i for i in others if i.available(now)]
        if not candidates:  # panic routing: everything is out of rotation; try what still answers /health
            candidates = [i for i in others if i.probe_ok and i.in_rotation]
        if not candidates:  # ... and then what is leaving or unready but answers: better than refusing
            candidates = [i for i in others if i.probe_ok]
        if not candidates and exclude is not None and exclude.probe_ok:
            candidates = [exclude]
        if not candidates:
            if not self.instances:
                raise ProxyError(503, f"no {self.role} instance (none given or discovered yet)",
                                 error_type="no_healthy_instance", stage=self.role, retry_after=1)
            raise ProxyError(503, f"no healthy {self.role} instance available (all fail their health checks)",
                             error_type="no_healthy_instance", stage=self.role, retry_after=1)
        return candidates

    def start(self, session: aiohttp.ClientSession, headers: dict[str, str]) -> None:
        """Start what the policy runs in the background (load_aware's engine readings of the instances of
        the moment)."""
        if hasattr(self.policy, "start"):
            self.policy.start(lambda: self.instances, session, headers)

    async def stop(self) -> None:
        if hasattr(self.policy, "stop"):
            await self.policy.stop()

    @staticmethod
    def wait_for(instance: Instance) -> float:
        """Seconds until `instance` said it would take requests again (0 when it never said)."""
        return max(0.0, instance.held_until - time.monotonic())

    def succeeded(self, instance: Instance) -> None:
        instance.consecutive_failures = 0
        instance.ejections = 0

    def failed(self, instance: Instance) -> None:
        """A failure the instance is to blame for: eject after `eject_after` in a row, while the share allows."""
        instance.consecutive_failures += 1
        if not self.eject_after or instance.consecutive_failures < self.eject_after:
            return
        now = time.monotonic()
        if now < instance.ejected_until:
            return  # already out (a request that was in flight when it was ejected)
        if sum(now < i.ejected_until for i in self.instances) >= self.max_ejected:
            return  # the share is used up: it stays in, and goes out on its next failure once there is room
        instance.ejections += 1
        period = self.eject_seconds * min(instance.ejections, MAX_EJECTION_MULTIPLIER)
        instance.ejected_until = now + period
        instance.consecutive_failures = 0
        log.warning("ejecting %s instance %s for %.0fs after %d consecutive failures (ejection #%d in a row)",
                    self.role, instance.url, period, self.eject_after, instance.ejections)

    def hold(self, instance: Instance, seconds: float) -> None:
        """The instance answered 429/503 with Retry-After: send it nothing until then."""
        instance.held_until = max(instance.held_until, time.monotonic() + min(seconds, MAX_HOLD_SECONDS))


class HealthChecker:
    """Probes every instance of the given pools and sets their `probe_ok` flag."""

    def __init__(self, pools: list[Pool], session: aiohttp.ClientSession, path: str, interval: float, timeout: float,
                 headers: dict[str, str] | None = None) -> None:
        self.pools = pools
        self.session = session
        self.path = path
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.headers = headers or {}
        self._task: asyncio.Task | None = None
        self._soon: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="health-checker")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._soon) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def probe_soon(self, pool: Pool, inst: Instance) -> None:
        """Check an instance that just joined now, rather than at the next round: it enters rotation as soon
        as it answers."""
        task = asyncio.create_task(self._probe(pool, inst), name=f"health-check {inst.url}")
        self._soon.add(task)
        task.add_done_callback(self._soon.discard)

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
        if ok and not inst.probe_ok:
            log.info("%s instance %s passes its health check again", pool.role, inst.url)
        elif not ok and inst.probe_ok:
            log.warning("%s instance %s failed its health check", pool.role, inst.url)
        inst.probe_ok = ok
