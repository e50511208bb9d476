"""Admission control: a bounded number of requests served at once, a bounded queue behind them.

Beyond the queue a request is refused at once with 503 and Retry-After, so that admitted requests
keep their latency instead of everyone slowing down together.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pdproxy.errors import QUEUE, ProxyError


class Admission:
    def __init__(self, max_inflight: int, max_queue: int, queue_timeout: float) -> None:
        self.max_inflight = max_inflight  # 0 = unlimited
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.inflight = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_inflight) if max_inflight else None

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._slots is not None:
            await self._acquire(self._slots)
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1
            if self._slots is not None:
                self._slots.release()

    async def _acquire(self, slots: asyncio.Semaphore) -> None:
        if not slots.locked():
            await slots.acquire()
            return
        if self.waiting >= self.max_queue:
            raise ProxyError(503, "pdproxy is at capacity and its queue is full; retry later",
                             error_type="overloaded", stage=QUEUE, retry_after=1)
        self.waiting += 1
        try:
            await asyncio.wait_for(slots.acquire(), self.queue_timeout)
        except TimeoutError:
            raise ProxyError(503, f"no capacity within {self.queue_timeout:g}s; retry later",
                             error_type="queue_timeout", stage=QUEUE, retry_after=1) from None
        finally:
            self.waiting -= 1
