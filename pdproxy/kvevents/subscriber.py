"""Follow every instance's KV-event stream (ZMQ SUB) and keep its `BlockIndex` in step, repairing gaps by replay.

One task per instance, on the proxy's event loop (pyzmq's asyncio API). The stream is kept in sequence:

* on every (re)connection of the SUB socket (start, a dropped connection, an engine restart: the engine's
  socket goes away and comes back) the index is rebuilt from the engine's replay buffer (ROUTER socket,
  from sequence 0; vLLM keeps 10,000 batches), so a late start catches up before its index is trusted;
* a sequence number above the next expected one is a gap: the missing batches are asked for by replay;
* one below it, not explained by a replay that just overlapped the live stream, is an engine restarted
  (sequence back to 0, cache empty): the index is rebuilt the same way;
* when nothing arrives for `probe_interval`, a replay from the next sequence checks that the engine is
  still there and repairs a lost tail.

Nothing blocks the loop: the socket's receive high-water mark bounds what waits, at most `MAX_PER_TICK`
batches are applied before yielding, a replay yields every `REPLAY_YIELD` batches and gives up after
`replay_timeout` per message. An instance's index is "flowing" (trusted for routing) while its SUB socket
is connected, no rebuild is under way and, where a replay endpoint is given, the engine answered a replay
within the last three probe intervals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdproxy.kvevents.decode import DecodeError, EventBatch, decode_batch, parse_seq
from pdproxy.kvevents.index import DEFAULT_MAX_BLOCKS, BlockIndex

log = logging.getLogger("pdproxy.kvevents")

MAX_PER_TICK = 64
REPLAY_YIELD = 64
RECEIVE_HWM = 10_000  # batches waiting in the SUB socket; beyond, ZMQ drops and the gap is replayed
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# (instance address, batch, live): called for every batch applied, after the index took it
Listener = Callable[[str, EventBatch, bool], None]


@dataclass(frozen=True, slots=True)
class Source:
    """Where one instance publishes: its address as pdproxy names it, the PUB and replay endpoints."""

    address: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class Subscription:
    """One instance's stream, sequence state, index and counters."""

    def __init__(self, source: Source, max_blocks: int, probe_interval: float, replay_timeout: float) -> None:
        self.source = source
        self.index = BlockIndex(max_blocks)
        self.probe_interval, self.replay_timeout = probe_interval, replay_timeout
        self.next_seq: int | None = None
        self.connected = False
        self.rebuilding = False
        self._resync = True  # rebuild from replay before trusting anything
        self._floor = 0  # live batches below next_seq but at or above this are replay overlaps, not a restart
        self.last_replay_ok = float("-inf")  # monotonic
        self.last_batch_at: float | None = None  # monotonic
        self.counts = {"batches": 0, "events": 0, "gaps": 0, "gaps_unrepaired": 0, "replays": 0,
                       "replay_failures": 0, "replayed_batches": 0, "decode_errors": 0, "resyncs": 0,
                       "restarts": 0, "duplicates": 0, "unknown_events": 0}
        self.lag_buckets = [0] * (len(LAG_BUCKETS) + 1)
        self.lag_sum = 0.0
        self.listeners: list[Listener] = []
        self._dealer: zmq.asyncio.Socket | None = None

    @property
    def flowing(self) -> bool:
        if not self.connected or self.rebuilding or self._resync:
            return False
        if self.source.replay_endpoint is None:
            return True
        return time.monotonic() - self.last_replay_ok < 3 * self.probe_interval + self.replay_timeout

    def status(self) -> dict:
        return {"endpoint": self.source.endpoint, "replay_endpoint": self.source.replay_endpoint,
                "connected": self.connected, "flowing": self.flowing, "next_seq": self.next_seq,
                "blocks": len(self.index), "block_size": self.index.block_size,
                "orphan_blocks": self.index.orphans, "evicted_blocks": self.index.evicted, **self.counts,
                "last_batch_age_seconds": None if self.last_batch_at is None
                else round(time.monotonic() - self.last_batch_at, 3)}

    # -- the stream ---------------------------------------------------------------------------

    async def run(self, ctx: zmq.asyncio.Context) -> None:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        watcher = asyncio.create_task(self._watch(monitor), name=f"kv-events-monitor {self.source.address}")
        try:
            while True:
                if self._resync and self.connected:
                    await self._rebuild()
                try:
                    frames = await asyncio.wait_for(sub.recv_multipart(), self.probe_interval)
                except TimeoutError:
                    if self.connected and not self._resync and self.source.replay_endpoint:
                        await self._replay(self.next_seq or 0)  # still there? and a lost tail repaired
                    continue
                await self._live(frames)
                for _ in range(MAX_PER_TICK - 1):
                    try:
                        frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self._live(frames)
                await asyncio.sleep(0)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            if self._dealer is not None:
                self._dealer.close(0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected, self._resync = True, True
                log.info("kv events: connected to %s (%s)", self.source.address, self.source.endpoint)
            elif event == zmq.EVENT_DISCONNECTED:
                if self.connected:
                    log.warning("kv events: %s disconnected; routing falls back until it is back and resynced",
                                self.source.address)
                self.connected = False

    async def _live(self, frames: list[bytes]) -> None:
        if self._resync and self.connected:
            await self._rebuild()
        try:
            if len(frames) != 3:
                raise DecodeError(f"{len(frames)} frames")
            seq = parse_seq(frames[1])
        except DecodeError:
            self.counts["decode_errors"] += 1
            return
        expected = self.next_seq
        if expected is not None and seq > expected:
            self.counts["gaps"] += 1
            await self._replay(expected)
            expected = self.next_seq
            if expected is not None and seq > expected:
                self.counts["gaps_unrepaired"] += 1  # the engine no longer has them: accepted as lost
                expected = None
        elif expected is not None and seq < expected:
            if seq >= self._floor:
                self.counts["duplicates"] += 1
                return
            self.counts["restarts"] += 1
            log.warning("kv events: %s restarted (sequence %d after %d); rebuilding its index",
                        self.source.address, seq, expected - 1)
            await self._rebuild()
            if self.next_seq is not None and seq < self.next_seq:
                return  # the rebuild's replay already had it
            expected = None
        if expected is None or seq == expected:
            self._apply(seq, frames[2], live=True)
            self._floor = seq + 1

    def _apply(self, seq: int, payload: bytes, live: bool) -> None:
        self.next_seq = seq + 1
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            self.counts["decode_errors"] += 1
            log.debug("kv events: undecodable batch %d from %s: %s", seq, self.source.address, exc)
            return
        index = self.index
        for event in batch.events:
            index.apply(event)
        counts = self.counts
        counts["batches"] += 1
        counts["events"] += len(batch.events)
        counts["unknown_events"] += batch.unknown
        self.last_batch_at = time.monotonic()
        if live:
            lag = max(0.0, time.time() - batch.ts)
            self.lag_buckets[bisect_left(LAG_BUCKETS, lag)] += 1
            self.lag_sum += lag
        for listener in self.listeners:
            try:
                listener(self.source.address, batch, live)
            except Exception:  # a listener's failure never stops the stream
                log.exception("kv events listener failed")

    async def _rebuild(self) -> None:
        """Forget the index and take the engine's whole replay buffer (or, without one, start from now)."""
        self._resync = False
        self.rebuilding = True
        self.counts["resyncs"] += 1
        try:
            self.index.clear()
            self.next_seq = None
            self._floor = 0
            if self.source.replay_endpoint:
                await self._replay(0)
        finally:
            self.rebuilding = False

    async def _replay(self, start: int) -> bool:
        """Apply the engine's buffered batches from `start`; False when it did not answer in time."""
        if not self.source.replay_endpoint:
            return False
        self.counts["replays"] += 1
        dealer = self._dealer
        if dealer is None:
            dealer = self._dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.source.replay_endpoint)
        applied = 0
        try:
            await asyncio.wait_for(dealer.send_multipart((b"", start.to_bytes(8, "big"))), self.replay_timeout)
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout)
                if len(frames) != 3:
                    self.counts["decode_errors"] += 1
                    continue
                seq = parse_seq(frames[1])
                if seq < 0:
                    break
                if self.next_seq is None or seq >= self.next_seq:
                    if self.next_seq is not None and seq > self.next_seq:
                        self.counts["gaps_unrepaired"] += 1
                    self._apply(seq, frames[2], live=False)
                    applied += 1
                    if applied % REPLAY_YIELD == 0:
                        await asyncio.sleep(0)
        except (TimeoutError, DecodeError, zmq.ZMQError) as exc:
            self.counts["replay_failures"] += 1
            log.debug("kv events: replay from %s failed: %s", self.source.address, exc)
            dealer.close(0)  # a late answer must not be read as the next replay's
            self._dealer = None
            return False
        if self.next_seq is None and start == 0:
            self.next_seq = 0  # an engine that has published nothing yet
        self.counts["replayed_batches"] += applied
        if applied:
            self._floor = start
        self.last_replay_ok = time.monotonic()
        return True


class KVEvents:
    """Every instance's subscription, for one pdproxy process (workers and replicas each run their own)."""

    def __init__(self, sources: Iterable[Source], max_blocks: int = DEFAULT_MAX_BLOCKS,
                 probe_interval: float = 2.0, replay_timeout: float = 2.0) -> None:
        self.subscriptions = {s.address: Subscription(s, max_blocks, probe_interval, replay_timeout)
                              for s in sources}
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []

    def get(self, address: str) -> Subscription | None:
        return self.subscriptions.get(address)

    def add_listener(self, listener: Listener) -> None:
        for sub in self.subscriptions.values():
            sub.listeners.append(listener)

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._tasks = [asyncio.create_task(self._keep(sub), name=f"kv-events {sub.source.address}")
                       for sub in self.subscriptions.values()]

    async def _keep(self, sub: Subscription) -> None:
        assert self._ctx is not None
        while True:
            try:
                await sub.run(self._ctx)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one instance's stream die for good
                log.exception("kv events: subscription to %s failed; restarting it", sub.source.address)
                sub.connected, sub._resync = False, True
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def status(self) -> dict[str, dict]:
        return {address: sub.status() for address, sub in self.subscriptions.items()}
