"""Follow every instance's KV-event stream (ZMQ SUB) and keep its `BlockIndex` in step, repairing gaps by replay.

One task per instance, on the proxy's event loop (pyzmq's asyncio API). The stream is kept in sequence:

* on every (re)connection of the SUB socket (start, a dropped connection, an engine restart: the engine's
  socket goes away and comes back) the index is rebuilt from the engine's replay buffer (ROUTER socket,
  from sequence 0; vLLM keeps 10,000 batches) as soon as the connection is made, whether or not the engine
  publishes anything, so a late start catches up before its first request and before its index is trusted;
* a sequence number above the next expected one is a gap: the missing batches are asked for by replay;
* one below it, not explained by a replay that just overlapped the live stream, is an engine restarted
  (sequence back to 0, cache empty): the index is rebuilt the same way;
* a sequence more than `MAX_SEQ_JUMP` (vLLM's replay buffer) away from the next expected one, either way, is
  not believed (counted in `sequence_jumps`) rather than let freeze the index behind a number the engine will
  never reach: on the live stream the index is rebuilt (no replay could repair such a gap, no overlap explains
  it); in a replay's answers it is skipped, as is an answer out of order;
* when nothing arrives for `probe_interval` (and every `BUSY_PROBE_INTERVALS` probe intervals even while
  batches flow), a replay from the next sequence checks that the replay socket answers and repairs a lost tail.

When an index is trusted for routing ("flowing"), and why not (`not_flowing_reason`): it is flowing while the
SUB socket is connected, a rebuild succeeded since the last (re)connection, restart or unrepairable loss,
and, where a replay endpoint is given, the engine was heard within `3 × probe_interval + replay_timeout`:
a live batch in sequence or an answered replay. A live batch in sequence proves the engine is there and
that nothing was missed, so a busy stream stays flowing without any replay. A replay socket that stops
answering is shown at once (`replay_answering`, `replay_failures`) but does not by itself make a busy
stream untrusted: while every batch arrives in sequence the index is exact. What it takes away is repair:
the first gap it cannot repair makes the index not flowing (`rebuild_failed`) until a rebuild from the
replay buffer succeeds (retried with back-off, `REBUILD_BACKOFF`); an idle engine whose replay socket does
not answer is not heard from, and stops being trusted (`replay_unanswered`). An operator sees a broken
replay socket before it costs anything, and routing never trusts an index that is known to be incomplete.

Nothing an engine sends ends the task or stalls the loop: every event's types are checked as it is decoded
(a malformed event is skipped and counted alone); a message above `message_bound(max_blocks)` bytes is
refused by ZMQ before it is kept (`zmq.MAXMSGSIZE`: it drops the connection without retrying, seen here
as `oversized_messages`, and the socket is made anew); the rebuild that follows skips that batch when its
replay comes to it (counted again, and in `gaps_unrepaired`: the index misses its blocks, a lost cache
hit, not a wrong answer) and the index flows again; and at most `receive_hwm` messages wait in each
socket, so what waits is bounded in bytes. Work is counted in
`TURN_BUDGET` units (a token id, a block hash, an event; `MESSAGE_UNITS` for a message or a replay answer,
applied or skipped) and the loop is yielded to after each budget, a huge batch's blocks being stored a
part at a time; a replay gives up after `replay_timeout` per message, or past `MAX_REPLAY_ANSWERS` answers.
"""

from __future__ import annotations

import asyncio
import logging
import select
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdproxy.kvevents.decode import BlockRemoved, BlockStored, DecodeError, Event, EventBatch, decode_batch, parse_seq
from pdproxy.kvevents.index import DEFAULT_MAX_BLOCKS, BlockIndex

log = logging.getLogger("pdproxy.kvevents")

TURN_BUDGET = 4_096  # work units (~0.1 µs each: a token id hashed and indexed) between two yields to the loop
MESSAGE_UNITS = 128  # what receiving one message or replay answer costs, applied or skipped
MAX_SEQ_JUMP = 10_000  # vLLM's replay buffer (buffer_steps): a sequence further away is not believed
MAX_REPLAY_ANSWERS = 10 * MAX_SEQ_JUMP  # more than any engine's buffer holds: the replay is not believed
BUSY_PROBE_INTERVALS = 5  # a busy stream's replay socket is probed every 5 probe intervals
REBUILD_BACKOFF = (0.5, 30.0)  # seconds between rebuild attempts: doubling from the first, reset after the last
BLOCK_BYTES = 96  # a 16-token block at msgpack's widest token ids (5 bytes each) and its 9-byte hash, with slack
MESSAGE_BYTES = (256 << 10, 4 << 20)  # a message's bound: a full index's worth of blocks, within these
QUEUE_BYTES = 64 << 20  # what may wait in one socket's receive queue: its high-water mark counts messages
GAVE_UP_AFTER = 1.0  # a disconnection that ZMQ did not retry within this: it dropped the connection for good
# A replay socket's disconnection not retried within this: dropped for good (ZMQ starts its retry timer as it
# disconnects, so a retry shows at once), looked for every REFUSAL_CHECK seconds of silence in a replay
REFUSAL_GRACE, REFUSAL_CHECK = 0.2, 0.1
MAX_BLIND_SKIPS = 4  # refused answers skipped in a row where their sequence is not known (see _replay)
PUMP_INTERVAL = 0.01  # seconds between the pump's passes over busy instances (the index lags at most this more)
COOL_PASSES = 10  # passes without a message after which an instance's socket is watched by the loop again
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# pyzmq's constants are enums, whose `&` costs microseconds; these are read for every message
_EVENTS, _POLLIN, _RCVMORE, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE), int(zmq.NOBLOCK)
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED

# (instance address, batch, live): called for every batch applied, after the index took it
Listener = Callable[[str, EventBatch, bool], None]


def message_bound(max_blocks: int) -> int:
    """The largest message taken from an engine: more blocks than the index holds are of no use to it, and
    4 MiB (some 900,000 token ids, far more than one engine step stores) takes ~0.1 s of the loop to decode."""
    return min(MESSAGE_BYTES[1], max(MESSAGE_BYTES[0], max_blocks * BLOCK_BYTES))


def receive_hwm(max_message: int) -> int:
    """Messages that may wait in a socket (beyond, ZMQ pushes back on the engine's socket, whose own
    high-water mark then drops, and the gap is replayed)."""
    return min(1000, max(16, QUEUE_BYTES // max_message))


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
        self.max_message = message_bound(max_blocks)
        self.next_seq: int | None = None
        self.connected = False
        self.rebuilding = False
        self.rebuild_failed = False
        self._resync = True  # rebuild from replay before trusting anything
        self._floor = 0  # live batches below next_seq but at or above this are replay overlaps, not a restart
        self._rebuild_at = float("-inf")  # monotonic: no rebuild attempt before then (back-off)
        self._backoff = 0.0
        self._budget = TURN_BUDGET
        self.last_heard = float("-inf")  # monotonic: a live batch in sequence or an answered replay
        self.last_replay_ok = float("-inf")  # monotonic
        self.last_replay_at = float("-inf")  # monotonic: the last replay asked for
        self.replay_answering: bool | None = None  # did the last replay answer in full? (None: none asked yet)
        self.last_batch_at: float | None = None  # monotonic
        self.counts = {"batches": 0, "events": 0, "gaps": 0, "gaps_unrepaired": 0, "replays": 0,
                       "replay_failures": 0, "replayed_batches": 0, "decode_errors": 0, "resyncs": 0,
                       "restarts": 0, "duplicates": 0, "unknown_events": 0, "malformed_events": 0,
                       "sequence_jumps": 0, "rebuild_failures": 0, "disconnects": 0, "oversized_messages": 0}
        self.lag_buckets = [0] * (len(LAG_BUCKETS) + 1)
        self.lag_sum = 0.0
        self.listeners: list[Listener] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._dealer_monitor: zmq.asyncio.Socket | None = None  # its connection's events: a refused answer
        self._dealer_sync: zmq.Socket | None = None  # the same replay socket, read without asyncio
        self._dropped_at: float | None = None  # monotonic: the replay socket disconnected, not retried since
        self._woken: asyncio.Future[None] | None = None  # wakes the task: (re)connected, a message, a hand-over
        self._sub: zmq.Socket | None = None
        self._pump: Pump | None = None  # the process's (KVEvents'): applies live batches while this is parked
        self._parked = False
        self._fd: int | None = None  # the SUB socket's descriptor (ZMQ's signal that messages may wait)
        self._watched = False  # whether the loop watches it (not while the pump polls this instance: `Pump`)
        self._held: deque[list[bytes]] = deque()  # messages the pump handed to the task, in order
        self._last_message = float("-inf")  # monotonic: the last message received (an idle stream is probed)

    @property
    def not_flowing_reason(self) -> str | None:
        """Why the index is not trusted for routing now (None: it is)."""
        if not self.connected:
            return "disconnected"
        if self._resync:
            return "rebuild_failed" if self.rebuild_failed and not self.rebuilding else "rebuilding"
        if self.source.replay_endpoint is not None and \
                time.monotonic() - self.last_heard >= 3 * self.probe_interval + self.replay_timeout:
            return "replay_unanswered"
        return None

    @property
    def flowing(self) -> bool:
        return self.not_flowing_reason is None

    def status(self) -> dict:
        now = time.monotonic()
        return {"endpoint": self.source.endpoint, "replay_endpoint": self.source.replay_endpoint,
                "connected": self.connected, "flowing": self.flowing, "not_flowing_reason": self.not_flowing_reason,
                "next_seq": self.next_seq, "blocks": len(self.index), "block_size": self.index.block_size,
                "orphan_blocks": self.index.orphans, "evicted_blocks": self.index.evicted,
                "replay_answering": self.replay_answering, "max_message_bytes": self.max_message, **self.counts,
                "last_batch_age_seconds": None if self.last_batch_at is None else round(now - self.last_batch_at, 3),
                "last_replay_ok_age_seconds": None if self.last_replay_ok == float("-inf")
                else round(now - self.last_replay_ok, 3)}

    # -- the sockets ----------------------------------------------------------------------------

    async def run(self, ctx: zmq.asyncio.Context) -> None:
        """Follow the stream until cancelled, or until ZMQ dropped the connection for good (then return:
        the caller makes a new socket)."""
        self._ctx = ctx
        loop = asyncio.get_running_loop()
        self._woken = loop.create_future()
        sub = self._socket(zmq.SUB, zmq.Socket)  # a plain socket: its readiness is followed here (_readable)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(_MONITORED)
        fd = self._fd = sub.getsockopt(zmq.FD)
        self._sub = sub
        self._watch_fd(True)
        sub.connect(self.source.endpoint)
        name = self.source.address
        tasks = (asyncio.create_task(self._stream(), name=f"kv-events stream {name}"),
                 asyncio.create_task(self._watch(monitor), name=f"kv-events monitor {name}"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._unpark()
            self._watch_fd(False)
            self._sub = self._fd = None
            self._held.clear()
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            self._close_dealer()  # a restarted task's replay must not use a closed socket
            self.connected, self._resync = False, True

    def _socket(self, kind: int, socket_class: type | None = None) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(kind, socket_class=socket_class)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:5557 (IPv4 addresses still work)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message)
        sock.setsockopt(zmq.RCVHWM, receive_hwm(self.max_message))
        return sock

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Follow the SUB socket's connection; return when ZMQ dropped it without retrying (it does so for a
        message over MAXMSGSIZE, or another protocol error, and never reconnects that socket)."""
        retrying = True
        while True:
            try:
                frames = await asyncio.wait_for(monitor.recv_multipart(), None if retrying else GAVE_UP_AFTER)
            except TimeoutError:
                self.counts["oversized_messages"] += 1
                log.warning("kv events: %s sent a message over %d bytes (or broke the protocol); ZMQ dropped the "
                            "connection; connecting anew", self.source.address, self.max_message)
                return
            event = parse_monitor_message(frames)["event"]
            retrying = event != zmq.EVENT_DISCONNECTED
            if event == zmq.EVENT_CONNECTED:
                self.connected, self._resync = True, True
                if self._woken is not None and not self._woken.done():
                    self._woken.set_result(None)  # the stream rebuilds now, not at its next message
                log.info("kv events: connected to %s (%s)", self.source.address, self.source.endpoint)
            elif event == zmq.EVENT_DISCONNECTED:
                self.counts["disconnects"] += 1
                if self.connected:
                    log.warning("kv events: %s disconnected; routing falls back until it is back and resynced",
                                self.source.address)
                self.connected = False

    # -- the stream -----------------------------------------------------------------------------

    async def _stream(self) -> None:
        while True:
            timeout = self.probe_interval
            if self._resync and self.connected:
                wait = self._rebuild_at - time.monotonic()
                if wait <= 0:
                    await self._try_rebuild()
                    continue
                timeout = min(timeout, wait)
            frames = self._held.popleft() if self._held else await self._receive(timeout)
            if frames is None:
                idle = time.monotonic() - self._last_message >= self.probe_interval
                if self._probe_due(idle=idle):
                    await self._replay(self.next_seq or 0)  # still there? and a lost tail repaired
                continue
            await self._live(frames)
            while self._budget > 0 and not self._held:  # what already waits, within this turn's budget
                frames = self._next_message()
                if frames is None:
                    break
                await self._live(frames)
            if self._probe_due(idle=False):
                await self._replay(self.next_seq or 0)
            self._budget = TURN_BUDGET
            await asyncio.sleep(0)  # a receive that had finished already does not yield (Python 3.12)

    def _next_message(self) -> list[bytes] | None:
        """The next message waiting in the SUB socket, without waiting (None: none)."""
        sub = self._sub
        if sub is None or not sub.getsockopt(_EVENTS) & _POLLIN:
            return None
        try:
            frames = [sub.recv(_NOBLOCK)]
            while sub.getsockopt(_RCVMORE):
                frames.append(sub.recv(_NOBLOCK))
        except zmq.Again:
            return None
        return frames

    def _readable(self) -> None:
        """The SUB socket's descriptor is readable (the event loop calls this): ZMQ's signal is taken (reading
        EVENTS does it; it is raised again only once the socket has been read empty), and a message waiting is
        handed to the pump while parked, else to this instance's own task."""
        sub = self._sub
        if sub is None:
            return
        try:
            waiting = sub.getsockopt(_EVENTS) & _POLLIN
        except zmq.ZMQError:
            return
        if not waiting:
            return
        if self._parked:
            assert self._pump is not None
            self._pump.hot(self)
        elif self._woken is not None and not self._woken.done():
            self._woken.set_result(None)

    async def _receive(self, timeout: float) -> list[bytes] | None:
        """The next message within `timeout` seconds; None when none came, or as soon as the socket (re)connects:
        the index is rebuilt from the replay buffer then, whether or not the engine sends anything (a replica
        started, or an engine restarted, in a quiet hour routes precisely from its first request).

        In step (connected, rebuilt, in sequence), the task parks: the process's pump (`Pump`) applies the
        live batches that follow in sequence for every parked instance in one pass, and hands this task what
        it cannot apply at once (a gap, a restart, a big batch); the task wakes for that, a (re)connection, or
        its probe's time."""
        frames = self._next_message()
        if frames is not None:
            return frames
        woken = self._woken
        if woken is None or woken.done():
            woken = self._woken = asyncio.get_running_loop().create_future()
        park = self._pump is not None and self.connected and not self._resync and self.next_seq is not None
        if park:
            since = time.monotonic() - self._last_message
            probe = self.probe_interval - since if since < self.probe_interval else self.probe_interval
            if self.source.replay_endpoint:
                busy = self.last_replay_at + BUSY_PROBE_INTERVALS * self.probe_interval - time.monotonic()
                probe = min(probe, busy)
            timeout = min(timeout, max(0.0, probe))
            self._parked = True  # (the socket was read empty just above: its next message signals _readable)
        try:
            await asyncio.wait((woken,), timeout=timeout)
        finally:
            if park:
                self._unpark()
        if self._held:
            return self._held.popleft()
        return self._next_message()

    def _watch_fd(self, on: bool) -> None:
        """Have the loop watch the SUB socket's descriptor (call `_readable`), or stop."""
        if on != self._watched and self._fd is not None:
            loop = asyncio.get_running_loop()
            if on:
                loop.add_reader(self._fd, self._readable)
            else:
                loop.remove_reader(self._fd)
            self._watched = on

    def waiting(self) -> bool:
        """Whether a message waits in the SUB socket (reading this takes ZMQ's signal)."""
        sub = self._sub
        try:
            return sub is not None and bool(sub.getsockopt(_EVENTS) & _POLLIN)
        except zmq.ZMQError:
            return False

    def _unpark(self) -> None:
        if self._parked:
            self._parked = False
            if self._pump is not None:
                self._pump.forget(self)

    def pumped(self, budget: int) -> int:
        """The pump's pass over this parked instance: live batches in sequence applied at once, up to `budget`
        units; the first message that needs more (out of sequence, too big, not in step) is handed to this
        instance's task, which wakes. The units spent; negative: more messages wait (the pump comes back)."""
        spent = 0
        sub = self._sub
        while self._parked and sub is not None:
            if spent >= budget:
                return -spent
            try:  # (not ZMQ_EVENTS first: reading it costs two system calls whenever nothing waits)
                frames = [sub.recv(_NOBLOCK)]
                while sub.getsockopt(_RCVMORE):
                    frames.append(sub.recv(_NOBLOCK))
            except zmq.Again:
                break
            units = self._take(frames)
            if units is None:
                self._held.append(frames)
                self.hand_back()
                break
            spent += units
        return spent

    def hand_back(self) -> None:
        """Unpark and wake the task (the pump could not go on with this instance)."""
        self._unpark()
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)

    def _take(self, frames: list[bytes]) -> int | None:
        """A live message applied synchronously when it is the next in sequence, small, and the index is in
        step (the units spent); None: the task's `_live` must handle it."""
        if len(frames) != 3 or len(frames[2]) > TURN_BUDGET or self._resync or not self.connected:
            return None
        seq_frame = frames[1]
        if len(seq_frame) != 8 or int.from_bytes(seq_frame, "big", signed=True) != self.next_seq:
            return None
        seq = self.next_seq
        self._last_message = time.monotonic()
        batch = self._decoded(seq, frames[2])
        units = MESSAGE_UNITS
        if batch is not None:
            units += self.index.apply_all(batch.events)
            self._applied(batch, live=True)
        self._floor = seq + 1
        self.last_heard = time.monotonic()
        return units

    def _probe_due(self, idle: bool) -> bool:
        if not self.connected or self._resync or not self.source.replay_endpoint:
            return False
        return idle or time.monotonic() - self.last_replay_at >= BUSY_PROBE_INTERVALS * self.probe_interval

    async def _spend(self, units: int) -> None:
        """Count work done; yield to the loop each time a turn's budget is spent."""
        self._budget -= units
        if self._budget <= 0:
            self._budget = TURN_BUDGET
            await asyncio.sleep(0)

    async def _live(self, frames: list[bytes]) -> None:
        self._last_message = time.monotonic()
        await self._spend(MESSAGE_UNITS)
        try:
            if len(frames) != 3:
                raise DecodeError(f"{len(frames)} frames")
            seq = parse_seq(frames[1])
        except DecodeError:
            self.counts["decode_errors"] += 1
            return
        if self._resync and not await self._try_rebuild():
            return  # not trusted before a rebuild; the rebuild's replay will bring this batch
        expected = self.next_seq
        if expected is not None and seq != expected:
            jumped = abs(seq - expected) > MAX_SEQ_JUMP
            if jumped or seq < self._floor:
                if jumped:
                    self.counts["sequence_jumps"] += 1
                    log.warning("kv events: %s sent sequence %d, expected %d; not believed, rebuilding its index",
                                self.source.address, seq, expected)
                else:
                    self.counts["restarts"] += 1
                    log.warning("kv events: %s restarted (sequence %d after %d); rebuilding its index",
                                self.source.address, seq, expected - 1)
                self._resync = True
                if not await self._try_rebuild():
                    return
                expected = self.next_seq
            elif seq > expected:
                self.counts["gaps"] += 1
                if not await self._replay(expected):
                    self.counts["gaps_unrepaired"] += seq - expected
                    self._resync = True  # batches lost while the replay does not answer: not trusted until rebuilt
                    log.warning("kv events: %s: batches %d-%d lost and the replay did not answer; rebuilding",
                                self.source.address, expected, seq - 1)
                    return
                expected = self.next_seq
                if expected is not None and seq > expected:
                    self.counts["gaps_unrepaired"] += seq - expected  # the engine no longer had them: accepted as lost
                    expected = seq
            else:
                self.counts["duplicates"] += 1
                return
        if expected is None or seq == expected:
            await self._apply(seq, frames[2], live=True)
            self._floor = seq + 1
            self.last_heard = time.monotonic()
        # else a replay just brought it, or (after a rebuild) the next repair will

    async def _apply(self, seq: int, payload: bytes, live: bool) -> None:
        batch = self._decoded(seq, payload)
        if batch is None:
            return
        if len(payload) <= TURN_BUDGET:  # (a payload holds at least a byte per token id and hash: a turn at most)
            await self._spend(self.index.apply_all(batch.events))
        else:
            for event in batch.events:
                await self._index(event)
        self._applied(batch, live)

    def _decoded(self, seq: int, payload: bytes) -> EventBatch | None:
        """Batch `seq` decoded and counted (None: undecodable, counted); the next expected is the one after."""
        self.next_seq = seq + 1
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            self.counts["decode_errors"] += 1
            log.debug("kv events: undecodable batch %d from %s: %s", seq, self.source.address, exc)
            return None
        counts = self.counts
        counts["batches"] += 1
        counts["events"] += len(batch.events)
        if batch.unknown:
            counts["unknown_events"] += batch.unknown
        if batch.malformed:
            if not counts["malformed_events"]:
                log.warning("kv events: %s sent malformed events (skipped, counted in malformed_events)",
                            self.source.address)
            counts["malformed_events"] += batch.malformed
        return batch

    def _applied(self, batch: EventBatch, live: bool) -> None:
        """What follows a batch in the index: its time, its lag, the listeners."""
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

    async def _index(self, event: Event) -> None:
        """Apply one event, a huge store a part at a time (the index may be read between parts: harmless)."""
        if not isinstance(event, BlockStored):
            self.index.apply(event)
            await self._spend(len(event.block_hashes) + 1 if isinstance(event, BlockRemoved) else 1)
            return
        size, hashes, tokens = event.block_size, event.block_hashes, event.token_ids
        step = max(1, TURN_BUDGET // (size + 1))
        if len(hashes) <= step:
            self.index.store(event)
            await self._spend(len(tokens) + len(hashes))
            return
        parent = event.parent_block_hash
        for start in range(0, len(hashes), step):
            part = hashes[start:start + step]
            self.index.store(BlockStored(part, parent, tokens[start * size:(start + len(part)) * size], size,
                                         event.medium))
            parent = part[-1]
            await self._spend(len(part) * (size + 1))

    # -- rebuild and replay ---------------------------------------------------------------------

    def _open_dealer(self, endpoint: str) -> zmq.asyncio.Socket:
        """The replay socket, and a monitor of its connection (how a refused answer is told from silence)."""
        dealer = self._dealer = self._socket(zmq.DEALER)
        self._dealer_sync = zmq.Socket.shadow(dealer.underlying)  # (read directly while answers wait)
        self._dealer_monitor = dealer.get_monitor_socket(_MONITORED)
        self._dropped_at = None
        dealer.connect(endpoint)
        return dealer

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            if self._dealer_monitor is not None:
                self._dealer.disable_monitor()
                self._dealer_monitor.close(0)
            self._dealer.close(0)
        self._dealer = self._dealer_monitor = self._dealer_sync = None

    async def _answer(self, dealer: zmq.asyncio.Socket) -> list[bytes]:
        """The replay's next answer. TimeoutError after `replay_timeout` of silence; _Refused as soon as ZMQ has
        dropped the connection for good instead (an answer over MAXMSGSIZE, refused before it is kept)."""
        waiting = self._dealer_sync
        if waiting is not None:  # an answer already here (a replay's come in a burst): no future, no timer
            try:
                frames = [waiting.recv(_NOBLOCK)]
                while waiting.getsockopt(_RCVMORE):
                    frames.append(waiting.recv(_NOBLOCK))
                return frames
            except zmq.Again:
                pass
        deadline = time.monotonic() + self.replay_timeout
        while True:
            try:
                return await asyncio.wait_for(dealer.recv_multipart(),
                                              max(0.0, min(REFUSAL_CHECK, deadline - time.monotonic())))
            except TimeoutError:
                if await self._refused():
                    raise _Refused from None
                if time.monotonic() >= deadline:
                    raise

    async def _refused(self) -> bool:
        """Whether the replay socket's connection was dropped and not retried (ZMQ retries any other loss at once)."""
        monitor = self._dealer_monitor
        if monitor is None:
            return False
        while True:
            try:
                frames = await monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if parse_monitor_message(frames)["event"] != zmq.EVENT_DISCONNECTED:
                self._dropped_at = None  # retried or connected again
            elif self._dropped_at is None:
                self._dropped_at = time.monotonic()
        return self._dropped_at is not None and time.monotonic() - self._dropped_at >= REFUSAL_GRACE

    async def _try_rebuild(self) -> bool:
        """Rebuild the index from the replay buffer (or, without one, start from now) unless backing off;
        True when it is rebuilt and in sequence again."""
        now = time.monotonic()
        if now < self._rebuild_at:
            return False
        if now - self._rebuild_at > REBUILD_BACKOFF[1]:
            self._backoff = 0.0  # the last rebuild is long past: no back-off
        self.rebuilding = True
        self.counts["resyncs"] += 1
        try:
            self.index.clear()
            self.next_seq = None
            self._floor = 0
            ok = await self._replay(0) if self.source.replay_endpoint else True
        finally:
            self.rebuilding = False
        self._backoff = min(REBUILD_BACKOFF[1], max(REBUILD_BACKOFF[0], 2 * self._backoff))
        self._rebuild_at = time.monotonic() + self._backoff
        self._resync, self.rebuild_failed = not ok, not ok
        if not ok:
            self.counts["rebuild_failures"] += 1
            log.warning("kv events: rebuilding %s's index failed (its replay did not answer in full); retrying in "
                        "%.1f s, routing falls back meanwhile", self.source.address, self._backoff)
        return ok

    async def _replay(self, start: int) -> bool:
        """Apply the engine's buffered batches from `start`; False when it did not answer in time and in full.

        The engine's ROUTER socket drops answers while its queue to us is full (a long replay read more slowly
        than it is sent), the end marker included: a replay that breaks off after some progress (an answer
        missing in the middle, or silence) is resumed from the next sequence on a new socket, so nothing the
        engine still holds is lost, and a long buffer comes in rounds.

        An answer over the size bound is refused by ZMQ, which drops the connection: that batch is skipped
        (counted in `oversized_messages` and `gaps_unrepaired`; the index misses its blocks, which costs a cache
        hit, not a wrong answer) and the replay goes on after it, so one huge batch in the engine's buffer does
        not keep the index from ever being rebuilt. Its sequence is the one after the last answer applied or
        skipped, or the one asked for when it came first. Only at the start of a rebuild is that not known: the
        engine's buffer begins at 0 until it has published 10,000 batches, later after; there up to
        `MAX_BLIND_SKIPS` are skipped in a row, then the replay fails as a silent one does (retried with
        back-off: the engine's next batch pushes its oldest out of the buffer)."""
        if not self.source.replay_endpoint:
            return False
        applied = answers = 0
        since = start
        located, blind = start > 0, 0  # whether the engine holds `since` (it held the one before); skips not so
        while True:
            self.counts["replays"] += 1
            self.last_replay_at = time.monotonic()
            dealer = self._dealer if self._dealer is not None else self._open_dealer(self.source.replay_endpoint)
            in_round, previous = 0, since - 1
            try:
                await asyncio.wait_for(dealer.send_multipart((b"", since.to_bytes(8, "big"))), self.replay_timeout)
                while True:
                    frames = await self._answer(dealer)
                    await self._spend(MESSAGE_UNITS)
                    answers += 1
                    if len(frames) != 3:
                        raise DecodeError(f"replay answer of {len(frames)} frames")
                    seq = parse_seq(frames[1])
                    if seq < 0:
                        break
                    if answers > MAX_REPLAY_ANSWERS:
                        raise DecodeError(f"more than {MAX_REPLAY_ANSWERS} replay answers")
                    expected = self.next_seq
                    if seq <= previous or (expected is not None and seq - expected > MAX_SEQ_JUMP):
                        self.counts["sequence_jumps"] += 1  # out of order, or far ahead: skipped, not believed
                        continue
                    if expected is not None and seq > expected:
                        if in_round:
                            raise _BrokenOff(f"answer {seq} after {expected - 1}")
                        self.counts["gaps_unrepaired"] += seq - expected  # the engine no longer had them
                    previous = seq
                    await self._apply(seq, frames[2], live=False)
                    applied += 1
                    in_round += 1
            except _Refused:
                self._close_dealer()  # ZMQ will not use that connection again
                skipped = self.next_seq if in_round and self.next_seq is not None else since
                located = located or in_round > 0
                blind = 0 if located else blind + 1
                if blind > MAX_BLIND_SKIPS:
                    self.counts["replay_failures"] += 1
                    self.counts["replayed_batches"] += applied
                    self.replay_answering = False
                    return False
                self.counts["oversized_messages"] += 1
                self.counts["gaps_unrepaired"] += 1
                log.warning("kv events: %s's batch %d is over %d bytes; skipped (its blocks are missing from the "
                            "index), the replay goes on after it", self.source.address, skipped, self.max_message)
                self.next_seq = since = skipped + 1
                continue
            except (TimeoutError, _BrokenOff, DecodeError, zmq.ZMQError) as exc:
                self._close_dealer()  # a late answer must not be read as the next replay's
                if in_round and self.next_seq is not None and not isinstance(exc, (DecodeError, zmq.ZMQError)):
                    log.debug("kv events: replay from %s broke off (%s); resuming", self.source.address, exc)
                    since = self.next_seq
                    continue
                self.counts["replay_failures"] += 1
                self.counts["replayed_batches"] += applied
                log.debug("kv events: replay from %s failed: %s", self.source.address, exc)
                self.replay_answering = False
                return False
            break
        if self.next_seq is None and start == 0:
            self.next_seq = 0  # an engine that has published nothing yet
        self.counts["replayed_batches"] += applied
        if applied:
            self._floor = start
        self.last_replay_ok = self.last_heard = time.monotonic()
        self.replay_answering = True
        return True


class _BrokenOff(Exception):
    """A replay whose answers stopped following each other: the engine dropped some on the way."""


class _Refused(Exception):
    """ZMQ refused a replay answer over the size bound and dropped the connection for good."""


class Pump:
    """Applies the live batches of every parked subscription (one in step: connected, rebuilt, in sequence) in
    passes, so that the event loop wakes once for many engines' batches instead of once per batch.

    A parked instance's first message (the loop sees its socket's descriptor) makes it hot: the loop stops
    watching the descriptor, the pump's own epoll set watches it instead, and a pass every `PUMP_INTERVAL`
    drains the sockets whose descriptor says a message came (one system call for them all: asking a ZMQ socket
    that has nothing costs two), a turn's budget (`TURN_BUDGET` units) at a time, the rest after the loop's other
    work. An instance that sent nothing for `COOL_PASSES` passes is watched by the loop again. At 100 engines'
    rate (~3,700 batches/s, each engine one every ~27 ms) the loop then wakes ~100 times a second instead of
    ~3,700. What a pass cannot apply at once (a gap, a restart, a big batch) it hands to the instance's own task
    (`Subscription.pumped`)."""

    def __init__(self) -> None:
        self._hot: dict[Subscription, int] = {}  # parked instances the passes drain -> passes without a message
        self._fds: dict[int, Subscription] = {}  # their descriptors, in `_epoll`
        self._undrained: set[Subscription] = set()  # left with messages by a spent budget (no new signal comes)
        self._epoll: select.epoll | None = None
        self._handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self.passes = 0

    def hot(self, sub: Subscription) -> None:
        """A parked instance has a message: drained by the passes from now on."""
        fd = sub._fd
        if fd is None:
            return
        sub._watch_fd(False)
        if self._epoll is None:
            self._epoll = select.epoll()
        self._hot[sub] = 0
        self._fds[fd] = sub
        self._epoll.register(fd, select.EPOLLIN)
        self._undrained.add(sub)  # (its message is waiting now: the descriptor's signal was taken)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(PUMP_INTERVAL, self._pass)

    def forget(self, sub: Subscription) -> None:
        """No longer parked: its task reads it (and the loop watches its descriptor)."""
        if self._cool(sub):
            sub._watch_fd(True)

    def _cool(self, sub: Subscription) -> bool:
        if self._hot.pop(sub, None) is None:
            return False
        self._undrained.discard(sub)
        fd = sub._fd
        if fd is not None and self._fds.pop(fd, None) is not None and self._epoll is not None:
            self._epoll.unregister(fd)
        return True

    def _pass(self) -> None:
        self._handle = None
        self.passes += 1
        budget = TURN_BUDGET
        hot, fds = self._hot, self._fds
        if self._epoll is None:
            return  # stopped
        signalled = {fds[fd] for fd, _ in self._epoll.poll(0) if fd in fds}
        due, self._undrained = signalled | self._undrained, set()
        for sub in list(hot):
            if sub not in due:
                if hot[sub] + 1 < COOL_PASSES:
                    hot[sub] += 1
                else:  # quiet: the loop watches it again (a message that came meanwhile signals it there)
                    self._cool(sub)
                    sub._watch_fd(True)
                    if sub.waiting():  # (reading ZMQ_EVENTS takes a signal the loop would not see again)
                        self.hot(sub)
                continue
            if budget <= 0:
                self._undrained.add(sub)
                continue
            try:
                spent = sub.pumped(budget)
            except Exception:  # never let one instance's trouble stop the others: its own task takes over
                log.exception("kv events: applying %s's batches failed; its stream restarts", sub.source.address)
                sub.hand_back()
                continue
            if sub not in hot:
                continue  # handed to its task
            hot[sub] = 0
            if spent < 0:
                self._undrained.add(sub)
            budget -= abs(spent)
        if hot and self._handle is None:  # (a pass may have been scheduled above, by hot())
            loop = asyncio.get_running_loop()
            self._handle = loop.call_soon(self._pass) if self._undrained else loop.call_later(PUMP_INTERVAL,
                                                                                                 self._pass)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        for sub in list(self._hot):
            self._cool(sub)
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None


class KVEvents:
    """Every instance's subscription, for one pdproxy process (workers and replicas each run their own).

    Instances come and go at run time (pdproxy/membership): `add` subscribes to a new one (or anew to one whose
    endpoint or incarnation changed), `remove` closes its sockets and drops its index, so the streams followed
    are always the pools' instances."""

    def __init__(self, sources: Iterable[Source] = (), max_blocks: int = DEFAULT_MAX_BLOCKS,
                 probe_interval: float = 2.0, replay_timeout: float = 2.0) -> None:
        self.max_blocks, self.probe_interval, self.replay_timeout = max_blocks, probe_interval, replay_timeout
        self.subscriptions: dict[str, Subscription] = {}
        self.retired: dict[str, Subscription] = {}  # removed, counters still shown until `forget`
        self._listeners: list[Listener] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self.pump = Pump()
        for source in sources:
            self.subscriptions[source.address] = self._subscription(source)

    def _subscription(self, source: Source) -> Subscription:
        sub = Subscription(source, self.max_blocks, self.probe_interval, self.replay_timeout)
        sub.listeners.extend(self._listeners)
        sub._pump = self.pump
        return sub

    def get(self, address: str) -> Subscription | None:
        return self.subscriptions.get(address)

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)
        for sub in self.subscriptions.values():
            sub.listeners.append(listener)

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        for sub in self.subscriptions.values():
            self._follow(sub)

    def _follow(self, sub: Subscription) -> None:
        address = sub.source.address
        self._tasks[address] = asyncio.create_task(self._keep(sub), name=f"kv-events {address}")

    async def add(self, source: Source, fresh: bool = False) -> Subscription:
        """Follow `source` (already followed at the same endpoints: kept as it is, unless `fresh`: a new
        incarnation of the instance, whose index starts again)."""
        current = self.subscriptions.get(source.address)
        if current is not None:
            if current.source == source and not fresh:
                return current
            await self.remove(source.address)
        sub = self.subscriptions[source.address] = self._subscription(source)
        if self._ctx is not None:
            self._follow(sub)
        return sub

    async def remove(self, address: str) -> None:
        """Stop following `address`: its sockets closed, its index dropped (its counters stay in /metrics
        until `forget`, so a scrape sees their last values)."""
        sub = self.subscriptions.pop(address, None)
        task = self._tasks.pop(address, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if sub is not None:
            sub.index.clear()
            self.retired[address] = sub

    def forget(self, address: str) -> None:
        """A removed instance's counters leave /metrics."""
        self.retired.pop(address, None)

    async def _keep(self, sub: Subscription) -> None:
        assert self._ctx is not None
        while True:
            try:
                await sub.run(self._ctx)  # returns when ZMQ dropped the connection for good
                delay = REBUILD_BACKOFF[0]
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one instance's stream die for good
                log.exception("kv events: subscription to %s failed; restarting it", sub.source.address)
                delay = 1.0
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = {}
        self.pump.stop()

    def status(self) -> dict[str, dict]:
        return {address: sub.status() for address, sub in self.subscriptions.items()}
