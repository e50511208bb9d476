"""The process's membership: its sources, the reconciler, and what /status and /metrics say of them.

Sources: the flags and the admin API always; a file, DNS and Kubernetes when configured (each module's
`from_settings` says, None when off). Each runs as a task of its own, restarted if it fails; start-up logs one
line per source, and the proxy starts serving once the flags' instances are in the pools (discovery follows:
a source that cannot reach what it watches at start leaves the pools to the others, and says so).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
from typing import Any

from pdproxy.config import Settings
from pdproxy.membership import given
from pdproxy.membership.cluster import Cluster
from pdproxy.membership.model import Member, Source
from pdproxy.membership.reconciler import KINDS, Entry, Reconciler

log = logging.getLogger("pdproxy.membership")

# sources configured by settings, each a module with from_settings(settings) -> Source | None
DISCOVERY = ("pdproxy.membership.files", "pdproxy.membership.dns", "pdproxy.membership.kubernetes")
RESTART_DELAY = (1.0, 30.0)  # a source's run that failed is started again after this, doubling


def discovery_sources(settings: Settings) -> list[Source]:
    sources = []
    for name in DISCOVERY:
        if importlib.util.find_spec(name) is None:
            continue
        source = importlib.import_module(name).from_settings(settings)
        if source is not None:
            sources.append(source)
    return sources


class Membership:
    def __init__(self, settings: Settings, cluster: Cluster) -> None:
        self.settings = settings
        self.cluster = cluster
        self.changes: dict[tuple[str, str], int] = {}  # (source, kind) -> count
        roles = tuple(cluster.pools)
        self.reconciler = Reconciler(cluster, settings.drain_timeout, self._count, roles)
        self.flags = given.flags(settings)
        self.admin = given.Given("admin")
        self.sources: list[Any] = [self.flags, self.admin, *discovery_sources(settings)]
        self._tasks: list[asyncio.Task] = []

    def _count(self, source: str, kind: str) -> None:
        self.changes[(source, kind)] = self.changes.get((source, kind), 0) + 1

    async def start(self) -> None:
        """Start every source; return once the flags' instances are in the pools."""
        for source in self.sources:
            log.info("membership source %s: %s", source.name, _summary(source))
            self._tasks.append(asyncio.create_task(self._keep(source), name=f"membership {source.name}"))
        await asyncio.sleep(0)  # the given sets publish at once
        await self.reconciler.settled()

    async def _keep(self, source: Any) -> None:
        publish = self.reconciler.publisher(source.name)
        delay = RESTART_DELAY[0]
        while True:
            try:
                await source.run(publish)
                return  # a source that has said all it will (the given sets)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("membership source %s failed; its last set stays, restarting it in %.0f s",
                              source.name, delay)
            await asyncio.sleep(delay)
            delay = min(RESTART_DELAY[1], 2 * delay)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.reconciler.stop()
        self.cluster.cancel()

    # -- what an operator sees ---------------------------------------------------------------------

    def entry(self, role: str, url: str) -> Entry | None:
        return self.reconciler.entry(role, url)

    def describe(self, instance: Any) -> dict[str, Any]:
        """An instance's membership for /status: its sources, when it joined, its state."""
        entry = self.reconciler.entry(instance.role, instance.url)
        if entry is None:
            return {"sources": [], "membership": "removed"}
        out = entry.describe()
        out["state"] = state_of(instance, entry)
        return out

    def status(self) -> dict[str, Any]:
        return {"sources": {s.name: s.status() for s in self.sources},
                "instances": self.reconciler.counts(),
                "changes": [{"source": s, "kind": k, "count": n} for (s, k), n in sorted(self.changes.items())],
                "drain_timeout": self.settings.drain_timeout}

    def members(self) -> list[tuple[Member, Entry]]:
        return [(e.member, e) for e in self.reconciler.entries.values()]


def state_of(instance: Any, entry: Entry | None) -> str:
    """One word for an instance: draining, not_ready, unhealthy (failing its health check, or not yet passed
    its first after joining), ejected or active."""
    if entry is not None and entry.state != "active":
        return entry.state
    if not instance.ready:
        return "not_ready"
    if not instance.probe_ok:
        return "unhealthy"
    if instance.ejected:
        return "ejected"
    return "active"


def _summary(source: Any) -> str:
    status = source.status()
    return ", ".join(f"{k} {v}" for k, v in status.items() if v not in (None, [], {}, ""))


__all__ = ["KINDS", "Membership", "discovery_sources", "state_of"]
