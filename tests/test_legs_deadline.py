"""legs.Deadline, the decode's first-token deadline, cancels and un-cancels as asyncio.timeout does:
its own expiry becomes a timeout, anyone else's cancellation (a client's disconnect) stays one."""

from __future__ import annotations

import asyncio

import pytest

from pdproxy.legs import Deadline


async def wait(seconds: float, deadline: float) -> str:
    timer = Deadline(deadline)
    try:
        await asyncio.sleep(seconds)
        return "done"
    except asyncio.CancelledError:
        if not timer.end(cancelled=True):
            raise
        return "timed out"
    finally:
        timer.end()


def test_the_deadline_times_the_await_out_and_withdraws_its_cancellation():
    async def main():
        assert await wait(0.0, 5.0) == "done"
        assert await wait(5.0, 0.01) == "timed out"
        task = asyncio.current_task()
        assert task.cancelling() == 0  # nothing left to cancel the request later
        await asyncio.sleep(0.02)  # and the timer of the finished one never fires
        return "still running"

    assert asyncio.run(main()) == "still running"


def test_a_cancellation_from_elsewhere_stays_one():
    async def main():
        task = asyncio.create_task(wait(5.0, 5.0))
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
