"""What an instance joining or leaving changes, all together: its pool entry, its first health check, its
KV-event subscription (and the index built from it), and its per-instance metric series.

The reconciler (reconciler.py) decides; this applies. A subscription is per address (an instance given
as both prefill and decode publishes one stream), so it goes when no live instance has that address. A
departed instance's series stay `retention` seconds, so the last scrape sees their final values, then go:
churn does not grow the label sets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from pdproxy.membership.model import Member
from pdproxy.pool import Instance, Pool

log = logging.getLogger("pdproxy.membership")


class Cluster:
    def __init__(self, pools: dict[str, Pool], *, metrics: Any = None, checker: Any = None,
                 events: Callable[[], Any] | None = None, endpoints: Callable[[Member], tuple[str | None, str | None]]
                 | None = None, topic: str = "", retention: float = 300.0, trusted: tuple[str, ...] = ("flags",)) -> None:
        """`events()`: the process's KVEvents, made on first use (None: events cannot be followed);
        `endpoints(member)`: a member's KV-event endpoints where it names none (the --kv-events-endpoint
        template); `trusted`: sources whose instances are in rotation at once, without a first health check."""
        self.pools = pools
        self.metrics = metrics
        self.checker = checker
        self.events = events
        self.endpoints = endpoints or (lambda member: (member.kv_events_endpoint, member.kv_events_replay_endpoint))
        self.topic = topic
        self.retention = retention
        self.trusted = trusted
        self._subscribed: dict[str, int] = {}  # address -> live instances subscribed through it
        self._forget: dict[str, asyncio.TimerHandle] = {}  # address -> its series' removal, pending

    def pool(self, role: str) -> Pool:
        pool = self.pools.get(role)
        if pool is None:
            raise ValueError(f"no {role} pool: this proxy runs without prefill instances (single mode)")
        return pool

    async def add(self, member: Member, source: str) -> Instance:
        pool = self.pool(member.role)
        instance = pool.add(member.url)
        instance.ready = member.ready
        address = instance.address
        handle = self._forget.pop(address, None)
        if handle is not None:
            handle.cancel()  # back before its series went: they go on
        if self.metrics is not None:
            self.metrics.attempts.configure([(member.role, address)])
        if self.checker is not None and source not in self.trusted:
            instance.probe_ok = False  # in rotation once it answers its health check, checked now
            self.checker.probe_soon(pool, instance)
        await self._subscribe(address, member, fresh=False)
        return instance

    async def update(self, instance: Instance, old: Member, new: Member) -> None:
        """New KV-event endpoints, or a new incarnation: subscribed anew, its index starting again."""
        fresh = old.identity != new.identity
        if fresh:  # a new process: its past failures are not its own
            instance.consecutive_failures = instance.ejections = 0
            instance.ejected_until = instance.held_until = 0.0
        if self._subscribed.get(instance.address):
            self._subscribed[instance.address] -= 1
        await self._subscribe(instance.address, new, fresh=True)

    async def remove(self, instance: Instance, member: Member) -> None:
        self.pool(member.role).remove(instance)
        address = instance.address
        if self._live(address):
            return  # the same address serves the other role: its stream and series stay
        events = self._events(create=False)
        if events is not None:
            self._subscribed.pop(address, None)
            await events.remove(address)
        loop = asyncio.get_running_loop()
        self._forget[address] = loop.call_later(self.retention, self._forget_series, address)

    def _live(self, address: str) -> bool:
        return any(i.address == address for pool in self.pools.values() for i in pool.instances)

    def _forget_series(self, address: str) -> None:
        self._forget.pop(address, None)
        if self._live(address):
            return
        if self.metrics is not None:
            self.metrics.forget_instance(address)
        events = self._events(create=False)
        if events is not None:
            events.forget(address)

    async def _subscribe(self, address: str, member: Member, fresh: bool) -> None:
        endpoint, replay = self.endpoints(member)
        if endpoint is None:
            return
        events = self._events(create=True)
        if events is None:
            log.warning("membership: %s names KV-event endpoint %s but KV events are off here", member.url, endpoint)
            return
        from pdproxy.kvevents.subscriber import Source

        self._subscribed[address] = self._subscribed.get(address, 0) + 1
        await events.add(Source(address, endpoint, replay, self.topic), fresh=fresh)

    def _events(self, create: bool) -> Any:
        if self.events is None:
            return None
        return self.events() if create else getattr(self.events, "current", None)

    def cancel(self) -> None:
        for handle in self._forget.values():
            handle.cancel()
        self._forget.clear()
