"""Virtual time: an asyncio event loop whose clock jumps to the next timer instead of waiting for it.

The simulator's engine (pdproxy/sim/engine.py) is written against a clock with `now()` and
`sleep_until()` and asyncio's own primitives. Run on this loop with `VirtualClock`, the very same
code (scheduler, cost model, KV leases, the transfer link's queue) executes as a discrete-event
simulation: when nothing is ready, time advances straight to the earliest timer, so a 10-minute
recording costs only the Python work of its engine steps. There is no I/O: the loop's selector
never waits, and a loop with nothing ready and no timer left is a model bug (a request that can
never finish), reported as such instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class ModelStuck(RuntimeError):
    """Nothing can run and no timer is set: some request waits for an event that will never come."""


class _NoIOSelector(selectors.BaseSelector):
    """Accepts the loop's own self-pipe registration and moves the virtual clock instead of polling."""

    def __init__(self) -> None:
        self._map: dict[Any, selectors.SelectorKey] = {}
        self.loop: VirtualLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        loop = self.loop
        assert loop is not None
        if timeout is None:
            raise ModelStuck("the virtual-time model has requests waiting but nothing that will wake them")
        if timeout > 0:
            loop.advance_to_next_timer()
        return []

    def get_map(self) -> Any:
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    """`time()` is virtual seconds from 0; idle time costs nothing."""

    def __init__(self) -> None:
        selector = _NoIOSelector()
        super().__init__(selector)
        selector.loop = self
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def advance_to_next_timer(self) -> None:
        scheduled = self._scheduled  # type: ignore[attr-defined]
        if scheduled:
            self._virtual_now = max(self._virtual_now, scheduled[0].when())


class VirtualClock:
    """The engine's clock interface (`PreciseClock`'s methods) on the running virtual loop."""

    def __init__(self, loop: VirtualLoop) -> None:
        self._loop = loop

    def now(self) -> float:
        return self._loop.time()

    async def sleep_until(self, deadline: float) -> None:
        delay = deadline - self._loop.time()
        if delay > 0:
            await asyncio.sleep(delay)

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)


class _Noop:
    __slots__ = ()

    def observe(self, value: float) -> None:
        pass

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass


class NullMetrics:
    """Stands in for the simulator's Prometheus metrics (`SimMetrics`): the model reads its own timestamps.

    The instruments the engine touches on every step are plain attributes (no per-call lookup); anything
    else falls back to a no-op through `__getattr__`."""

    def __init__(self) -> None:
        noop = _Noop()
        for name in ("ttft", "itl", "tpot", "queue", "inference", "prefill", "decode", "e2e", "running", "waiting",
                     "kv_usage", "generation_tokens", "preemptions", "nixl_xfer_time", "nixl_bytes", "nixl_failed",
                     "nixl_expired"):
            setattr(self, name, noop)
        self.success = _AnyKey(noop)

    def prompt_computed(self, tokens: int) -> None:
        pass

    def prompt_queried(self, tokens: int, hit: int) -> None:
        pass

    def prompt_transferred(self, tokens: int) -> None:
        pass

    def __getattr__(self, name: str) -> _Noop:
        return _Noop()


class _AnyKey(dict):
    def __init__(self, value: _Noop) -> None:
        super().__init__()
        self._value = value

    def __missing__(self, key: object) -> _Noop:
        return self._value


def run(main: Any) -> Any:
    """Run coroutine `main` to completion on a fresh virtual loop; returns its result."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(main(VirtualClock(loop)))
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
