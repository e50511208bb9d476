"""Admission control: a bounded number of requests served at once, a bounded queue behind them.

Beyond the queue a request is refused at once with 503 and Retry-After, so that admitted requests
keep their latency instead of everyone slowing down together. `check()` refuses before the
request body is even read, so a flood costs the proxy a header parse per request, not a body.

A free slot is taken without a coroutine (`take()`), and given back by a plain `with` block:
every `async` layer on the request path is resumed at each wake-up of the request's innermost
await, so only a request that has to queue pays for one (`queue()`). A released slot goes straight
to the longest-waiting request (first come, first served; a newcomer cannot take it first).
"""

from __future__ import annotations

import asyncio
from collections import deque

from pdproxy.errors import QUEUE, ProxyError


class Admission:
    """`with admission.take() or await admission.queue():` holds one of the in-flight slots."""

    def __init__(self, max_inflight: int, max_queue: int, queue_timeout: float) -> None:
        self.max_inflight = max_inflight  # 0 = unlimited
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.inflight = 0  # slots held, including one just handed to a queued request not yet resumed
        self.waiting = 0
        # the queued requests in arrival order, each woken with True (a slot is its) or False (timed out)
        self._queue: deque[asyncio.Future[bool]] = deque()

    def check(self) -> None:
        """Refuse now if a request arriving now would be refused by `queue()` anyway."""
        if self.max_inflight and self.inflight >= self.max_inflight and self.waiting >= self.max_queue:
            raise self._full()

    def take(self) -> Admission | None:
        """A free slot, now held (leave it with `with`); None when every slot is held: `queue()` for one.
        While anyone is queued every slot is held (a release hands its slot on), so this never jumps the queue."""
        if self.max_inflight and self.inflight >= self.max_inflight:
            return None
        self.inflight += 1
        return self

    async def queue(self) -> Admission:
        """Wait for a slot in the queue (503 when the queue is full, or after --queue-timeout)."""
        if self.waiting >= self.max_queue:
            raise self._full()
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[bool] = loop.create_future()
        self._queue.append(turn)
        timer = loop.call_later(self.queue_timeout, self._expire, turn)
        self.waiting += 1
        try:
            granted = await turn
        except BaseException:  # cancelled (the client left): its place, or the slot just handed to it, goes on
            if turn.done() and not turn.cancelled() and turn.result():
                self.release()
            else:
                self._forget(turn)
            raise
        finally:
            timer.cancel()
            self.waiting -= 1
        if not granted:
            raise ProxyError(503, f"no capacity within {self.queue_timeout:g}s; retry later",
                             error_type="queue_timeout", stage=QUEUE, retry_after=1)
        return self

    def release(self) -> None:
        """Give a slot back: to the longest-waiting queued request if any, else free."""
        queue = self._queue
        while queue:
            turn = queue.popleft()
            if not turn.done():  # one cancelled a moment ago is still in the queue
                turn.set_result(True)
                return
        self.inflight -= 1

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _expire(self, turn: asyncio.Future[bool]) -> None:
        if not turn.done():
            turn.set_result(False)
            self._forget(turn)

    def _forget(self, turn: asyncio.Future[bool]) -> None:
        try:
            self._queue.remove(turn)
        except ValueError:
            pass  # already taken off by a release

    def _full(self) -> ProxyError:
        return ProxyError(503, f"pdproxy is at capacity ({self.max_inflight} in flight, {self.waiting} queued); "
                               "retry later", error_type="overloaded", stage=QUEUE, retry_after=1)
