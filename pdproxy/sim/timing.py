"""How long an engine step and a KV transfer take, and a clock precise enough to wait for them.

The cost model is deliberately small: a step costs the decode time of every sequence in the
batch (a function of the batch size, read off a measured curve) plus the extra time of the
prefill tokens in the step (a function of their sum, read off another measured curve). Both
curves are piecewise linear between measured points and extrapolated with their last slope,
so the simulator reproduces the measurements at the points and stays monotonic in between.

Timers: asyncio (and uvloop) wake up on millisecond ticks, which is 20 % of a 5 ms decode
step. `PreciseClock` waits in a helper thread (`threading.Condition.wait` has ~0.1 ms
precision) and wakes the event loop with `call_soon_threadsafe`, so step boundaries land
where the model puts them.
"""

from __future__ import annotations

import asyncio
import bisect
import fcntl
import heapq
import itertools
import mmap
import os
import random
import struct
import threading
import time
from dataclasses import dataclass
from typing import Protocol

Points = tuple[tuple[float, float], ...]


class PiecewiseLinear:
    """y(x) through measured points; linear between them, last slope beyond the ends."""

    def __init__(self, points: Points) -> None:
        if len(points) < 2:
            raise ValueError("a curve needs at least two points")
        pts = sorted(points)
        self.xs = [float(x) for x, _ in pts]
        self.ys = [float(y) for _, y in pts]
        if len(set(self.xs)) != len(self.xs):
            raise ValueError("curve points must have distinct x values")

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        i = bisect.bisect_right(xs, x) - 1
        i = min(max(i, 0), len(xs) - 2)  # beyond the ends: extend the outer segment
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class CostModel:
    """Durations in seconds, already multiplied by the time scale."""

    decode_step: PiecewiseLinear  # batch size -> ms for one decode token of every sequence
    prefill_extra: PiecewiseLinear  # prefill tokens in the step -> extra ms
    time_scale: float = 1.0
    instant: bool = False

    def step_seconds(self, num_seqs: int, prefill_tokens: int) -> float:
        """One engine iteration with `num_seqs` sequences, `prefill_tokens` of them prompt tokens."""
        if self.instant or num_seqs == 0:
            return 0.0
        ms = self.decode_step(num_seqs)
        if prefill_tokens:
            ms += self.prefill_extra(prefill_tokens)
        return ms * self.time_scale / 1000.0


class KVLinkShape(Protocol):
    """The preset fields a KV transfer's duration depends on."""

    kv_bytes_per_token: int
    kv_bandwidth_gbps: float
    kv_latency_ms: float
    block_size: int


def kv_bytes(shape: KVLinkShape, blocks: int) -> int:
    """Bytes moved for `blocks` KV blocks (NIXL moves whole blocks)."""
    return blocks * shape.block_size * shape.kv_bytes_per_token


def kv_wire_seconds(shape: KVLinkShape, nbytes: int, time_scale: float = 1.0) -> float:
    """The bytes' time on the prefill's outgoing link (0 for an infinite link), latency not included."""
    bandwidth = shape.kv_bandwidth_gbps * 1e9 / time_scale
    return nbytes / bandwidth if bandwidth > 0 else 0.0


def kv_link_seconds(shape: KVLinkShape, tokens: int, time_scale: float = 1.0) -> float:
    """A KV transfer's own time on the link (latency + bytes / bandwidth), without queueing behind others."""
    return shape.kv_latency_ms * time_scale / 1000.0 + kv_wire_seconds(shape, tokens * shape.kv_bytes_per_token,
                                                                       time_scale)


class FrontEndShape(Protocol):
    """The preset fields the API server's time per request depends on."""

    frontend_overhead_ms: float
    frontend_request_ms: float
    frontend_stream_ms: float
    frontend_finish_ms: float
    frontend_jitter_ms: float


class FrontEnd:
    """vLLM's API server in front of one engine: the time from a request's arrival until the engine sees it.

    It grows with the load the server carries (recorded vLLM 0.23, tests/fixtures/vllm023: the API server's
    part of TTFT is ~2 ms for a lone request, 11 ms beside 4 streams and 23 ms beside 16), through two
    mechanisms of one event loop: each request's own intake work (parsing, tokenisation) runs one at a time,
    so requests arriving together wait for each other (`frontend_request_ms`, FIFO); and every stream it is
    serving takes a turn of that loop for its tokens (detokenisation, the SSE write) before the new
    request's next step comes round (`frontend_stream_ms` per request in flight, counted from its intake:
    a request still in prefill is a stream about to start). A lone request takes
    `frontend_overhead_ms`, as calibrated. On the way out, the same loop finishes each stream that ends
    (`frontend_finish_ms`, FIFO with the intake work): streams ending in one engine step reach their clients one
    after another, as vLLM 0.23's did 1.0-1.3 ms apart, and their closed-loop clients' next prompts follow as far
    apart. Each intake may take up to `frontend_jitter_ms` more, drawn from a generator seeded by `seed` (vLLM's
    lone requests' API-server time varies by about a millisecond). The simulator's server and the what-if's
    instances both use it.
    """

    def __init__(self, shape: FrontEndShape, time_scale: float = 1.0, seed: int = 0) -> None:
        scale = time_scale / 1000.0
        self.fixed = shape.frontend_overhead_ms * scale
        self.request = shape.frontend_request_ms * scale
        self.per_stream = shape.frontend_stream_ms * scale
        self.finish = shape.frontend_finish_ms * scale
        self.jitter = shape.frontend_jitter_ms * scale
        self._random = random.Random(seed)
        self.in_flight = 0  # requests between intake and their last chunk: the streams it serves or is about to
        self.busy_until = 0.0  # the loop's serial work queued so far (intakes, finishes) ends then

    def intake(self, now: float) -> float:
        """Seconds from arrival (`now`) until the engine sees the request; queues its intake work."""
        start = max(now, self.busy_until)
        self.busy_until = start + self.request
        jitter = self._random.random() * self.jitter if self.jitter > 0 else 0.0
        return start - now + self.fixed + self.per_stream * self.in_flight + jitter

    def finished(self, now: float) -> float:
        """Seconds a stream's last output, ready at `now`, waits for the loop's earlier work; queues its finishing."""
        if self.finish <= 0:
            return 0.0
        start = max(now, self.busy_until)
        self.busy_until = start + self.finish
        return start - now


class PreciseClock:
    """`await clock.sleep_until(t)` on the `time.perf_counter()` timeline with sub-ms accuracy.

    One daemon thread serves every waiter of the process through a heap of deadlines.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._serve, name="sim-clock", daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    async def sleep_until(self, deadline: float) -> None:
        if deadline <= time.perf_counter():
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), loop, fut))
            self._cond.notify()
        await fut

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await self.sleep_until(time.perf_counter() + seconds)

    def _serve(self) -> None:
        with self._cond:
            while True:
                if not self._heap:
                    self._cond.wait()
                    continue
                remaining = self._heap[0][0] - time.perf_counter()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                _, _, loop, fut = heapq.heappop(self._heap)
                try:
                    loop.call_soon_threadsafe(_resolve, fut)
                except RuntimeError:  # loop closed during shutdown
                    pass


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class SharedGPU:
    """Instances time-sharing one GPU's compute: a step is stretched by every other instance stepping meanwhile.

    `weight` is how much one other busy instance stretches a step (0: each instance has the GPU to itself;
    1: full time-slicing, two busy instances each at half speed). Seen in the recorded runs of four vLLM
    instances on one H200 (tests/fixtures/real-xpyd-2026-12-01b), where every figure is slower than one
    instance alone; `pdproxy whatif --fit-run` fits the weight to a recording. In one process (the what-if's
    virtual cluster) the instances share this object; `pdproxy sim` processes share a file (`GPUShareFile`).
    """

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.busy_until: dict[int, float] = {}

    def slot(self) -> int:
        n = len(self.busy_until)
        self.busy_until[n] = 0.0
        return n

    def others_busy(self, slot: int, now: float) -> int:
        return sum(1 for s, until in self.busy_until.items() if s != slot and until > now)

    def mark(self, slot: int, until: float) -> None:
        """An instance's steps and the KV it copies in share its slot: busy until the later of the two."""
        self.busy_until[slot] = max(self.busy_until.get(slot, 0.0), until)

    def leave(self, slot: int, now: float) -> None:
        """The instance in `slot` stopped (the what-if's replay of a killed instance): from `now` on it stretches
        no one's steps."""
        self.busy_until[slot] = min(self.busy_until.get(slot, 0.0), now)

    def stretch(self, slot: int, now: float, seconds: float) -> float:
        """The step's duration on the shared GPU, starting `now`; marks this instance busy for it."""
        if seconds <= 0:
            return seconds
        seconds *= 1.0 + self.weight * self.others_busy(slot, now)
        self.mark(slot, now + seconds)
        return seconds


class GPUShareFile(SharedGPU):
    """`SharedGPU` across `pdproxy sim` processes on one host: each holds a slot of a small file (its pid and
    when its current step ends, on the host-wide monotonic clock `time.perf_counter` reads on Linux)."""

    SLOTS = 64
    _SLOT = struct.Struct("<qd")  # pid, busy until

    def __init__(self, path: str, weight: float) -> None:
        super().__init__(weight)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        size = self.SLOTS * self._SLOT.size
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
            self._slot = self._claim()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _claim(self) -> int:
        for i in range(self.SLOTS):
            pid, _ = self._SLOT.unpack_from(self._map, i * self._SLOT.size)
            if pid == 0 or not _alive(pid):
                self._SLOT.pack_into(self._map, i * self._SLOT.size, os.getpid(), 0.0)
                return i
        raise ValueError(f"more than {self.SLOTS} instances share the GPU file")

    def slot(self) -> int:
        return self._slot

    def others_busy(self, slot: int, now: float) -> int:
        busy = 0
        for i in range(self.SLOTS):
            pid, until = self._SLOT.unpack_from(self._map, i * self._SLOT.size)
            busy += i != slot and pid != 0 and until > now
        return busy

    def mark(self, slot: int, until: float) -> None:
        """The process's steps and the KV it sends share its slot: busy until the later of the two."""
        _, current = self._SLOT.unpack_from(self._map, slot * self._SLOT.size)
        self._SLOT.pack_into(self._map, slot * self._SLOT.size, os.getpid(), max(current, until))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
