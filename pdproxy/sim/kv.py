"""KV-cache blocks, NIXL-style leases on the prefill side, the transfer link, and the pull.

The protocol imitates vLLM's NixlConnector in pull mode:

* A prefill instance that finishes a request with ``do_remote_decode`` keeps the request's
  blocks and returns ``kv_transfer_params`` naming itself (host, port, engine id, request id,
  block ids). The blocks are held for a lease (30 s by default); a decode that is still
  queued extends it with heartbeats, as vLLM 0.33 does. When the lease runs out the blocks are
  freed and ``vllm:nixl_num_kv_expired_reqs`` counts it.
* A decode instance that gets those params allocates local blocks, then "reads" the remote
  blocks: an HTTP ``POST /sim/kv/pull`` to the named host and port. The prefill checks the
  engine id, the request id, the block ids and the lease, then moves the bytes over its
  outgoing link, which carries one transfer at a time (FIFO), so concurrent pulls queue and
  the link saturates when the offered KV bytes exceed its bandwidth. When the transfer is done
  the prefill frees the blocks (NIXL's "done reading" notification).
* A second read of blocks that were already read and freed succeeds, as on vLLM 0.23 (facts file,
  fact 2): the prefill only logs "Potentially invalid KV blocks for unrecognized request … may have
  expired", and the decode generates from whatever the blocks hold now (a corrupted context).
"""

from __future__ import annotations

import asyncio
import collections
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import logging

import aiohttp

from pdproxy.sim.metrics import SimMetrics
from pdproxy.sim.settings import SimSettings
from pdproxy.sim.timing import PreciseClock, SharedGPU

PULL_PATH = "/sim/kv/pull"
HEARTBEAT_PATH = "/sim/kv/heartbeat"
log = logging.getLogger("pdproxy.sim.kv")
REQUIRED_REMOTE_FIELDS = ("remote_engine_id", "remote_block_ids", "remote_request_id", "remote_host", "remote_port")


class BlockPool:
    """Block ids of one instance's KV cache. `total == 0` means unbounded (the instant preset)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free: list[int] = []  # released ids, reused first
        self._next = 0  # ids never handed out yet start here
        self.used = 0

    @property
    def num_free(self) -> int:
        return sys.maxsize if self.total == 0 else self.total - self.used

    @property
    def usage(self) -> float:
        return 0.0 if self.total == 0 else self.used / self.total

    def allocate(self, n: int) -> list[int]:
        """n block ids; the caller checked `num_free` first."""
        if n <= 0:
            return []
        if self.total and n > self.total - self.used:
            raise RuntimeError(f"allocating {n} blocks with {self.total - self.used} free")
        out = self._free[-n:] if n <= len(self._free) else self._free[:]
        del self._free[len(self._free) - len(out):]
        missing = n - len(out)
        if missing:
            out.extend(range(self._next, self._next + missing))
            self._next += missing
        self.used += n
        return out

    def free(self, ids: list[int]) -> None:
        if ids:
            self._free.extend(ids)
            self.used -= len(ids)


@dataclass
class Lease:
    request_id: str
    blocks: list[int]
    num_tokens: int
    expires_at: float  # time.monotonic()
    handle: asyncio.TimerHandle | None = None
    pulling: bool = False
    stale: bool = False  # its blocks were already read and freed: whatever they hold now is read
    read: int | None = None  # blocks the decode reads (the ones its prefix cache lacks); None: all

    @property
    def blocks_read(self) -> int:
        return len(self.blocks) if self.read is None else self.read


class PullRejected(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


class KVLeases:
    """KV blocks a prefill instance keeps for decodes to read (the producer side of NIXL)."""

    EXPIRED_MEMORY = 10_000  # expired request ids remembered, to tell "expired" from "unknown"

    def __init__(self, engine_id: str, pool: BlockPool, lease_seconds: float, metrics: SimMetrics,
                 on_free: Any = None) -> None:
        self.engine_id = engine_id
        self.pool = pool
        self.lease_seconds = lease_seconds
        self.metrics = metrics
        self.on_free = on_free  # called after blocks return to the pool (wakes a waiting engine)
        self.held: dict[str, Lease] = {}
        self.expired: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.expired_total = 0
        self.pulled: collections.OrderedDict[str, None] = collections.OrderedDict()  # read, then freed
        self.stale_reads = 0

    def hold(self, request_id: str, blocks: list[int], num_tokens: int) -> None:
        lease = Lease(request_id, blocks, num_tokens, time.monotonic() + self.lease_seconds)
        lease.handle = asyncio.get_running_loop().call_later(self.lease_seconds, self._expire, request_id)
        self.held[request_id] = lease

    def heartbeat(self, engine_id: str, request_id: str) -> bool:
        lease = self.held.get(request_id)
        if engine_id != self.engine_id or lease is None or lease.pulling:
            return False
        if lease.handle:
            lease.handle.cancel()
        lease.expires_at = time.monotonic() + self.lease_seconds
        lease.handle = asyncio.get_running_loop().call_later(self.lease_seconds, self._expire, request_id)
        return True

    def claim(self, engine_id: str, request_id: str, block_ids: list[int]) -> Lease:
        """Start a read of a held request's blocks, or say precisely why it cannot be read."""
        if engine_id != self.engine_id:
            raise PullRejected(404, "unknown_engine",
                               f"engine {engine_id!r} is not served here (this is {self.engine_id!r})")
        lease = self.held.get(request_id)
        if lease is None and request_id in self.pulled:
            self.stale_reads += 1
            log.error("Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode worker. "
                      "They may have expired.", request_id)
            return Lease(request_id, list(block_ids), 0, 0.0, pulling=True, stale=True)
        if lease is None:
            if request_id in self.expired:
                raise PullRejected(410, "lease_expired",
                                   f"KV blocks of {request_id} were released when their lease expired")
            raise PullRejected(404, "unknown_request", f"no KV blocks held for request {request_id}")
        if lease.pulling:
            raise PullRejected(409, "already_pulling", f"KV blocks of {request_id} are already being read")
        if not set(block_ids) <= set(lease.blocks):
            # a decode whose prefix cache holds the prompt's first blocks reads only the rest (vLLM 0.23's
            # NIXL worker `_apply_prefix_caching`: "Partial prefix cache hit: just read uncomputed blocks")
            raise PullRejected(404, "unknown_blocks",
                               f"block ids do not match the {len(lease.blocks)} blocks held for {request_id} (nor a "
                               "part of them)")
        lease.pulling = True
        if lease.handle:
            lease.handle.cancel()
            lease.handle = None
        lease.read = len(block_ids)
        return lease

    def release(self, request_id: str) -> None:
        lease = self.held.pop(request_id, None)
        if lease is not None and lease.pulling:
            self.pulled[request_id] = None
            while len(self.pulled) > self.EXPIRED_MEMORY:
                self.pulled.popitem(last=False)
        if lease is not None:
            if lease.handle:
                lease.handle.cancel()
            self.pool.free(lease.blocks)
            if self.on_free:
                self.on_free()

    def release_all(self) -> None:
        for request_id in list(self.held):
            self.release(request_id)

    def _expire(self, request_id: str) -> None:
        lease = self.held.get(request_id)
        if lease is None or lease.pulling:
            return
        self.release(request_id)
        self.expired[request_id] = time.monotonic()
        while len(self.expired) > self.EXPIRED_MEMORY:
            self.expired.popitem(last=False)
        self.expired_total += 1
        self.metrics.nixl_expired.inc()


class TransferLink:
    """The prefill instance's outgoing KV path: one transfer at a time at `bandwidth` bytes/s."""

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float, clock: PreciseClock) -> None:
        self.bandwidth = bandwidth_bytes_per_s  # 0 = infinite
        self.latency = latency_s
        self.clock = clock
        self._busy_until = 0.0
        self.in_flight = 0
        self.bytes_total = 0
        # same-GPU NIXL: a transfer's copies time-share the GPU like an instance's steps (SharedGPU)
        self.gpu: SharedGPU | None = None
        self.gpu_slot = 0

    @classmethod
    def outgoing(cls, settings: SimSettings, clock: PreciseClock, gpu: SharedGPU | None) -> TransferLink:
        """A prefill instance's link for the KV it sends, at the preset's rate and latency; its copies share
        the instance's GPU unless the preset says they do not (`kv_link_shares_gpu`)."""
        bandwidth = settings.preset.kv_bandwidth_gbps * 1e9
        link = cls(0.0 if settings.instant or bandwidth <= 0 else bandwidth / settings.time_scale,
                   settings.scaled(settings.preset.kv_latency_ms), clock)
        if settings.preset.kv_link_shares_gpu:
            link.share_gpu(gpu)
        return link

    def share_gpu(self, gpu: SharedGPU | None, slot: int | None = None) -> None:
        """Copies on `gpu`, under an instance's own `slot` (a decode's intake: its copies do not stretch its
        own steps, as between `pdproxy sim` processes) or a slot of their own."""
        if gpu is not None and gpu.weight > 0:
            self.gpu, self.gpu_slot = gpu, gpu.slot() if slot is None else slot

    @property
    def busy_until(self) -> float:
        """When the transfers already queued on the link are through (latency not included)."""
        return self._busy_until

    def duration(self, nbytes: int) -> float:
        return nbytes / self.bandwidth if self.bandwidth > 0 else 0.0

    async def transfer(self, nbytes: int) -> tuple[float, float]:
        """Wait for the link, occupy it for the bytes, add the latency; returns (queued, total) s."""
        start_wait = self.clock.now()
        start = max(start_wait, self._busy_until)
        if self.gpu is not None:  # the copies run at the GPU's shared pace, and hold its share meanwhile
            end = start + self.gpu.stretch(self.gpu_slot, start, self.duration(nbytes))
        else:
            end = start + self.duration(nbytes)
        self._busy_until = end  # reserved at arrival: transfers leave in FIFO order
        self.in_flight += 1
        try:
            await self.clock.sleep_until(end + self.latency)
        finally:
            self.in_flight -= 1
        self.bytes_total += nbytes
        return start - start_wait, self.clock.now() - start_wait


class _Copy:
    """One KV read on a `SharedKVPath`: its link, the decode reading it, the bytes left."""

    __slots__ = ("link", "reader", "lane", "left", "rate", "done", "arrived", "started")

    def __init__(self, link: TransferLink, reader: str, nbytes: int, now: float) -> None:
        self.link, self.reader, self.lane, self.left, self.rate = link, reader, (id(link), reader), float(nbytes), 0.0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.arrived, self.started = now, None  # type: float, float | None


class SharedKVPath:
    """The KV reads between instances on one GPU (the what-if's cluster in one process): each prefill sends to each
    decode one KV at a time at its link's rate; while several decodes read, all the reads on the GPU share one
    rate between them.

    Recorded on one H200 with four vLLM 0.23 instances (tests/fixtures/real-ratios-2026-12-01, real-xpyd-2026-12-01b,
    xpyd; docs/explanation/whatif.md "One GPU, several decodes"): one decode read from three prefills side by side (3P1D: the
    first KVs of each prefill released per prefill, ~0.55 GB/s in all, where one read alone moves ~0.34 GB/s);
    with two or three decodes reading, ~0.1 GB/s moved in all, over two prefills (2P2D) as over one (1P3D); run B's
    decodes, each fed by its own prefill, ~0.1 GB/s in all while both read, and decode-0 0.27 GB/s from two prefills
    once the other had died. Reads of one decode from one prefill queue (vllm023's 1-GPU 1P1D: short KVs landing
    behind a 4.5k-token one come out after it). Rates are recomputed at every read's start and end (a fluid model),
    so a read slows and speeds up as other decodes start and stop reading.
    """

    def __init__(self, together_bytes_per_s: float, clock: PreciseClock, gpu: SharedGPU | None = None,
                 pair_bytes_per_s: float = 0.0) -> None:
        self.together = together_bytes_per_s  # all reads at once while several decodes read (0: no such limit)
        self.pair = pair_bytes_per_s  # one decode's reads from one prefill (0: the prefill link's bandwidth)
        # the copies take their share of the GPU: each prefill sending counts as one more instance busy (SharedGPU)
        self.gpu = gpu if gpu is not None and gpu.weight > 0 else None
        self._slots: dict[int, int] = {}  # link id -> its GPU slot
        self.clock = clock
        self.active: list[_Copy] = []  # the head read of each busy lane
        self.queued: dict[tuple[int, str], collections.deque[_Copy]] = {}  # lane -> reads behind its head
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    async def transfer(self, link: TransferLink, reader: str, nbytes: int) -> tuple[float, float]:
        """Read `nbytes` over `link` into decode `reader`; returns (queued, total) s as `TransferLink.transfer`."""
        now = self.clock.now()
        copy = _Copy(link, reader, nbytes, now)
        self._advance(now)
        if any(c.lane == copy.lane for c in self.active):
            self.queued.setdefault(copy.lane, collections.deque()).append(copy)
        else:
            self._start(copy, now)
        self._reschedule(now)
        link.in_flight += 1
        try:
            await copy.done
            await self.clock.sleep(link.latency)
        except asyncio.CancelledError:  # the reader went away (its instance died): its read stops
            self._drop(copy)
            raise
        finally:
            link.in_flight -= 1
        link.bytes_total += nbytes
        started = copy.started if copy.started is not None else copy.arrived
        return started - copy.arrived, self.clock.now() - copy.arrived

    def _drop(self, copy: _Copy) -> None:
        now = self.clock.now()
        self._advance(now)
        waiting = self.queued.get(copy.lane)
        if copy in self.active:
            self.active.remove(copy)
            if waiting:
                self._start(waiting.popleft(), now)
        elif waiting and copy in waiting:
            waiting.remove(copy)
        self._reschedule(now)

    def _start(self, copy: _Copy, now: float) -> None:
        copy.started = now
        self.active.append(copy)

    def _advance(self, now: float) -> None:
        elapsed = now - self._last
        if elapsed > 0:
            for c in self.active:
                c.left -= c.rate * elapsed
        self._last = now

    def _reschedule(self, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.active:
            if self.gpu is not None:
                for slot in self._slots.values():
                    self.gpu.leave(slot, now)
            return
        # a decode with a read queued is a decode reading (its engine waits on the KV all the same)
        readers = {c.reader for c in self.active} | {c.reader for q in self.queued.values() for c in q}
        share = self.together / len(self.active) if len(readers) > 1 and self.together > 0 else math.inf
        for c in self.active:
            lane = self.pair if self.pair > 0 else c.link.bandwidth if c.link.bandwidth > 0 else math.inf
            c.rate = min(lane, share)
        soonest = min(max(c.left, 0.0) / c.rate if c.rate < math.inf else 0.0 for c in self.active)
        self._timer = asyncio.get_running_loop().call_later(soonest, self._tick)
        if self.gpu is not None:  # each sending link busy until the next change, then marked again
            sending = {id(c.link) for c in self.active}
            for link_id in sending | set(self._slots):
                slot = self._slots.get(link_id)
                if slot is None:
                    slot = self._slots[link_id] = self.gpu.slot()
                if link_id in sending:
                    self.gpu.mark(slot, now + soonest)
                else:
                    self.gpu.leave(slot, now)

    def _tick(self) -> None:
        self._timer = None
        now = self.clock.now()
        self._advance(now)
        for c in [c for c in self.active if c.left <= 1.0 or c.rate == math.inf]:  # within a byte: done
            self.active.remove(c)
            if not c.done.done():
                c.done.set_result(None)
            waiting = self.queued.get(c.lane)
            if waiting:
                self._start(waiting.popleft(), now)
        self._reschedule(now)


@dataclass(frozen=True)
class RemoteKV:
    """The `kv_transfer_params` a decode received: where to read the prompt's KV from."""

    engine_id: str
    request_id: str
    block_ids: list[int]
    host: str
    port: int
    num_tokens: int | None
    tp_size: int | None
    read_blocks: int | None = None  # the decode reads this many blocks (its prefix cache holds the rest); None: all

    @classmethod
    def parse(cls, params: dict[str, Any]) -> RemoteKV:
        """Raises ValueError with a message fit for a 400 when a field vLLM needs is missing."""
        missing = [f for f in REQUIRED_REMOTE_FIELDS if params.get(f) is None]
        if missing:
            raise ValueError(f"kv_transfer_params with do_remote_prefill needs {', '.join(missing)}")
        blocks = params["remote_block_ids"]
        if isinstance(blocks, list) and blocks and all(isinstance(g, list) for g in blocks):
            blocks = [b for group in blocks for b in group]  # v0.33: one list per KV-cache group
        if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
            raise ValueError("kv_transfer_params.remote_block_ids must be a list of block ids")
        port = params["remote_port"]
        if isinstance(port, bool) or not isinstance(port, (int, str)) or not str(port).isdigit():
            raise ValueError("kv_transfer_params.remote_port must be a port number")
        num_tokens = params.get("remote_num_tokens")
        tp = params.get("tp_size")
        return cls(
            engine_id=str(params["remote_engine_id"]),
            request_id=str(params["remote_request_id"]),
            block_ids=blocks,
            host=str(params["remote_host"]),
            port=int(port),
            num_tokens=num_tokens if isinstance(num_tokens, int) else None,
            tp_size=tp if isinstance(tp, int) else None,
        )

    def url(self, path: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{path}"


@dataclass(frozen=True)
class PullOutcome:
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    reason: str = ""
    message: str = ""
    stale: bool = False  # read blocks that no longer held this prompt (see the module docstring)


class KVPuller:
    """The consumer side: reads remote blocks over HTTP and records vLLM's NIXL metrics."""

    def __init__(self, engine_id: str, metrics: SimMetrics, clock: PreciseClock, overhead_s: float,
                 lease_seconds: float) -> None:
        self.engine_id = engine_id
        self.metrics = metrics
        self.clock = clock
        self.overhead = overhead_s
        self.heartbeat_interval = lease_seconds / 6  # vLLM: heartbeat every lease/6 while waiting
        self._session: aiohttp.ClientSession | None = None
        self.active = 0

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def pull(self, remote: RemoteKV, fail: bool = False) -> PullOutcome:
        """Read the blocks; `fail` is an injected load failure (the read errors out)."""
        self.active += 1
        try:
            await self.clock.sleep(self.overhead)
            started = self.clock.now()
            if fail:
                self.metrics.nixl_failed.inc()
                return PullOutcome(False, reason="injected", message="KV transfer failed (injected fault)")
            body = {"remote_engine_id": remote.engine_id, "remote_request_id": remote.request_id,
                    "remote_block_ids": remote.block_ids, "requester_engine_id": self.engine_id}
            try:
                async with self.session().post(remote.url(PULL_PATH), json=body) as resp:
                    answer = await resp.json(content_type=None)
                    status = resp.status
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                self.metrics.nixl_failed.inc()
                return PullOutcome(False, reason="unreachable",
                                   message=f"cannot read KV from {remote.host}:{remote.port}: {exc!r}")
            if status != 200 or not isinstance(answer, dict):
                self.metrics.nixl_failed.inc()
                reason = answer.get("reason", "rejected") if isinstance(answer, dict) else "rejected"
                message = answer.get("message", "") if isinstance(answer, dict) else str(answer)
                return PullOutcome(False, reason=reason, message=f"remote engine {remote.engine_id} refused the "
                                                                 f"KV read ({status}): {message}")
            # NIXL times the read itself (post -> completion), so this is the prefill link's time for
            # it, queueing included; the simulated read's HTTP round trip belongs to the hand-off.
            seconds = float(answer.get("transfer_seconds", self.clock.now() - started))
            nbytes = int(answer.get("bytes", 0))
            self.metrics.nixl_xfer_time.observe(seconds)
            self.metrics.nixl_bytes.observe(nbytes)
            return PullOutcome(True, nbytes=nbytes, seconds=seconds, stale=bool(answer.get("stale")))
        finally:
            self.active -= 1

    async def keep_alive(self, remote: RemoteKV, started: asyncio.Event) -> None:
        """Extend the prefill's lease while this request waits for local blocks."""
        while True:
            try:
                await asyncio.wait_for(started.wait(), self.heartbeat_interval)
                return
            except TimeoutError:
                pass
            try:
                body = {"remote_engine_id": remote.engine_id, "remote_request_id": remote.request_id}
                async with self.session().post(remote.url(HEARTBEAT_PATH), json=body) as resp:
                    await resp.read()
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass  # the pull will report the failure
