"""One reconciler: every source's desired set, unioned, brought to the live pools.

Level-triggered, as SGLang's model gateway does it: each source publishes its whole set, the reconciler
unions them (by role and URL: one instance found by two sources is one entry) and compares the union with
the live entries, then adds what is new, drains what is gone and updates what changed. Publishing is cheap
and coalesced: a burst of changes is one pass.

* An instance is in the union while at least one source lists it and not as terminating. Sources never
  remove each other's instances: what the flags or the operator gave stays while they say so, whatever
  discovery says.
* Gone from the union: drained. No new request goes there; requests in flight finish, up to `grace`
  seconds; then it is removed everywhere at once (pool, health checks, KV-event subscription and index,
  per-instance series after their retention). Back in the union while draining: restored, nothing lost.
* Listed but not ready (a pod failing its readiness probe): kept, out of rotation, so a flapping probe costs
  no resubscription and no rebuilt index.
* A new incarnation at the same URL (another pod UID) starts its event index again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdproxy.membership.model import SOURCES, Member

log = logging.getLogger("pdproxy.membership")

ACTIVE, DRAINING = "active", "draining"
DRAIN_POLL = 0.1  # seconds between looks at a draining instance's requests in flight
RETRY_AFTER = 5.0  # seconds before a change that failed to apply is tried again
# what a change is counted as, by the source that caused it (pdproxy_membership_changes_total{source, kind})
KINDS = ("added", "draining", "removed", "restored", "replaced", "updated", "ready", "not_ready")


class Cluster(Protocol):
    """What the reconciler changes: the pools and everything that follows an instance (cluster.py)."""

    async def add(self, member: Member, source: str) -> Any: ...

    async def update(self, instance: Any, old: Member, new: Member) -> None: ...

    async def remove(self, instance: Any, member: Member) -> None: ...


@dataclass(eq=False)
class Entry:
    """One live instance: its description, the sources that list it, its pool instance and its state."""

    member: Member
    sources: tuple[str, ...]
    instance: Any
    joined: float = field(default_factory=time.time)  # unix time
    state: str = ACTIVE
    draining_since: float | None = None  # unix time
    drain: asyncio.Task | None = None

    def describe(self) -> dict[str, Any]:
        return {"sources": list(self.sources), "joined": self.joined, "membership": self.state,
                "draining_since": self.draining_since, "identity": self.member.identity,
                "bootstrap_port": self.member.bootstrap_port,
                "kv_events_endpoint": self.member.kv_events_endpoint}


def _rank(source: str) -> int:
    return SOURCES.index(source) if source in SOURCES else len(SOURCES)


class Reconciler:
    def __init__(self, cluster: Cluster, grace: float, counted: Callable[[str, str], None] | None = None,
                 roles: Iterable[str] = ("prefill", "decode")) -> None:
        self.cluster = cluster
        self.grace = grace
        self.roles = frozenset(roles)  # the pools there are: a member of another role is ignored, said once
        self._ignored: set[tuple[str, str]] = set()
        self._retry: asyncio.TimerHandle | None = None
        self.counted = counted or (lambda source, kind: None)
        self.wanted: dict[str, dict[tuple[str, str], Member]] = {}  # source -> its desired members by key
        self.entries: dict[tuple[str, str], Entry] = {}
        self._lock = asyncio.Lock()
        self._pass: asyncio.Task | None = None
        self._dirty = False
        self._published = self._applied = 0  # changes published, and those a finished pass has applied
        self._waiting: list[asyncio.Future[None]] = []  # settled() callers, woken after each pass
        self._drains: set[asyncio.Task] = set()

    # -- what the sources say ----------------------------------------------------------------------

    def publisher(self, source: str) -> Callable[[Iterable[Member]], None]:
        """The `publish` a source calls with its whole set."""
        return lambda members: self.publish(source, members)

    def publish(self, source: str, members: Iterable[Member]) -> None:
        self.wanted[source] = {m.key: m for m in members}
        self._kick()

    def _retried(self) -> None:
        self._retry = None
        self._kick()

    def _kick(self) -> None:
        self._published += 1
        self._dirty = True
        if self._pass is None or self._pass.done():
            self._pass = asyncio.get_running_loop().create_task(self._reconcile(), name="membership-reconcile")

    async def settled(self) -> None:
        """Return once everything published so far is applied (not what is published meanwhile: under churn a
        pass follows another, and waiting for the reconciler to go idle made an admin change wait for later ones)."""
        target = self._published
        while self._applied < target and self._pass is not None and not self._pass.done():
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            await waiter

    def desired(self) -> dict[tuple[str, str], tuple[Member, tuple[str, ...]]]:
        """The union: per key, the description of the highest-ranked source listing it as not terminating,
        and every source that lists it so."""
        out: dict[tuple[str, str], tuple[Member, tuple[str, ...]]] = {}
        for source in sorted(self.wanted, key=_rank):
            for key, member in self.wanted[source].items():
                if member.terminating:
                    continue
                if member.role not in self.roles:
                    if key not in self._ignored:
                        self._ignored.add(key)
                        log.warning("membership: %s lists %s %s, but this proxy has no %s pool (single mode: "
                                    "start it with --vllm-pd-disaggregation or a --prefill instance); ignored",
                                    source, member.role, member.url, member.role)
                    continue
                if key in out:
                    out[key] = (out[key][0], (*out[key][1], source))
                else:
                    out[key] = (member, (source,))
        return out

    # -- bringing the pools in step ----------------------------------------------------------------

    async def _reconcile(self) -> None:
        try:
            while self._dirty:
                self._dirty = False
                published = self._published
                async with self._lock:
                    await self._apply(self.desired())
                self._applied = published
                self._wake()
        finally:
            self._wake()

    def _wake(self) -> None:
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    async def _apply(self, desired: dict[tuple[str, str], tuple[Member, tuple[str, ...]]]) -> None:
        for key, (member, sources) in desired.items():
            entry = self.entries.get(key)
            try:
                if entry is None:
                    instance = await self.cluster.add(member, sources[0])
                    self.entries[key] = Entry(member, sources, instance)
                    self.counted(sources[0], "added")
                    log.info("membership: %s %s joined (from %s)", member.role, member.url, ", ".join(sources))
                else:
                    await self._update(entry, member, sources)
            except Exception:  # one instance's trouble never stops the others' changes; tried again later
                log.exception("membership: applying %s %s failed; trying again in %.0f s", member.role, member.url,
                              RETRY_AFTER)
                if self._retry is None:
                    self._retry = asyncio.get_running_loop().call_later(RETRY_AFTER, self._retried)
        for key, entry in list(self.entries.items()):
            if key not in desired and entry.state == ACTIVE:
                self._start_drain(entry)

    async def _update(self, entry: Entry, member: Member, sources: tuple[str, ...]) -> None:
        old, entry.sources = entry.member, sources
        if entry.state == DRAINING:
            self._stop_drain(entry)
            self.counted(sources[0], "restored")
            log.info("membership: %s %s is listed again (%s): back in rotation", member.role, member.url,
                     ", ".join(sources))
        if member == old:
            return
        entry.member = member
        if old.ready != member.ready:
            entry.instance.ready = member.ready
            self.counted(sources[0], "ready" if member.ready else "not_ready")
            log.info("membership: %s %s %s", member.role, member.url,
                     "is ready again" if member.ready else "is not ready: out of rotation, kept")
        moved = (old.kv_events_endpoint, old.kv_events_replay_endpoint) != (member.kv_events_endpoint,
                                                                            member.kv_events_replay_endpoint)
        replaced = old.identity is not None and member.identity is not None and old.identity != member.identity
        if moved or replaced:
            await self.cluster.update(entry.instance, old, member)
            entry.joined = time.time() if replaced else entry.joined
            self.counted(sources[0], "replaced" if replaced else "updated")
            log.info("membership: %s %s %s", member.role, member.url,
                     "is a new incarnation (identity changed): its event index starts again" if replaced
                     else "changed its KV-event endpoints: subscribed anew")

    def _start_drain(self, entry: Entry) -> None:
        entry.state, entry.draining_since = DRAINING, time.time()
        entry.instance.draining = True
        self.counted(entry.sources[0], "draining")
        log.info("membership: %s %s left its sources (%s): draining, %d in flight, up to %.0f s",
                 entry.member.role, entry.member.url, ", ".join(entry.sources), entry.instance.inflight, self.grace)
        entry.drain = asyncio.get_running_loop().create_task(self._drain(entry), name=f"drain {entry.member.url}")
        self._drains.add(entry.drain)
        entry.drain.add_done_callback(self._drains.discard)

    def _stop_drain(self, entry: Entry) -> None:
        if entry.drain is not None:
            entry.drain.cancel()
        entry.state, entry.draining_since, entry.drain = ACTIVE, None, None
        entry.instance.draining = False

    async def _drain(self, entry: Entry) -> None:
        deadline = time.monotonic() + self.grace
        while entry.instance.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL)
        async with self._lock:
            key = entry.member.key
            if self.entries.get(key) is not entry or entry.state != DRAINING:
                return  # restored meanwhile
            left = entry.instance.inflight
            del self.entries[key]
            entry.drain = None  # this task: not cancelled by its own removal
            await self.cluster.remove(entry.instance, entry.member)
        self.counted(entry.sources[0], "removed")
        log.info("membership: %s %s removed%s", entry.member.role, entry.member.url,
                 f" after the {self.grace:g} s grace period, {left} request(s) still in flight there" if left
                 else ", nothing in flight")

    async def stop(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        tasks = [t for t in (self._pass, *self._drains) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- what an operator sees ---------------------------------------------------------------------

    def entry(self, role: str, url: str) -> Entry | None:
        return self.entries.get((role, url))

    def counts(self) -> dict[str, dict[str, int]]:
        """Live instances by role and membership state."""
        out: dict[str, dict[str, int]] = {}
        for (role, _), entry in self.entries.items():
            by_state = out.setdefault(role, {ACTIVE: 0, DRAINING: 0})
            by_state[entry.state] += 1
        return out
