"""Admission control: a bounded number of requests served at once, a bounded queue behind them.

Beyond the queue a request is refused at once with 503 and Retry-After, so that admitted requests
keep their latency instead of everyone slowing down together. `check()` refuses before the
request body is even read, so a flood costs the proxy a header parse per request, not a body.
"""

from __future__ import annotations

import asyncio

from pdproxy.errors import QUEUE, ProxyError


class Admission:
    def __init__(self, max_inflight: int, max_queue: int, queue_timeout: float) -> None:
        self.max_inflight = max_inflight  # 0 = unlimited
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.inflight = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_inflight) if max_inflight else None

    def check(self) -> None:
        """Refuse now if a request arriving now would be refused by `slot()` anyway."""
        if self._slots is not None and self._slots.locked() and self.waiting >= self.max_queue:
            raise self._full()

    def slot(self) -> Admission:
        """`async with admission.slot():` holds one of the in-flight slots (waiting in the queue for it)."""
        return self  # a plain async context manager: no generator object per request

    async def __aenter__(self) -> None:
        if self._slots is not None:
            await self._acquire(self._slots)
        self.inflight += 1

    async def __aexit__(self, *exc_info: object) -> None:
        self.inflight -= 1
        if self._slots is not None:
            self._slots.release()

    async def _acquire(self, slots: asyncio.Semaphore) -> None:
        if not slots.locked():
            await slots.acquire()
            return
        if self.waiting >= self.max_queue:
            raise self._full()
        self.waiting += 1
        try:
            async with asyncio.timeout(self.queue_timeout):  # no task per waiter, unlike wait_for
                await slots.acquire()
        except TimeoutError:
            raise ProxyError(503, f"no capacity within {self.queue_timeout:g}s; retry later",
                             error_type="queue_timeout", stage=QUEUE, retry_after=1) from None
        finally:
            self.waiting -= 1

    def _full(self) -> ProxyError:
        return ProxyError(503, f"pdproxy is at capacity ({self.max_inflight} in flight, {self.waiting} queued); "
                               "retry later", error_type="overloaded", stage=QUEUE, retry_after=1)
