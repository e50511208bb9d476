"""Admission (pdproxy/admission.py): queued requests are served first come, first served, time out
with a 503 after --queue-timeout, and a request cancelled while queued (even at the moment a slot is
handed to it) leaves neither its queue place nor a slot behind."""

import asyncio
import threading
import time

import httpx
import pytest

from ledgers import Counters, ScriptedGroup
from pdproxy.admission import Admission
from pdproxy.errors import ProxyError
from procs import start_proxy
from waits import scaled, wait_until

BODY = {"model": "m", "prompt": "one two three", "max_tokens": 8, "stream": False}


def runtime(url: str) -> dict:
    return httpx.get(url + "/debug/runtime").json()


def post(url: str, rid: str, results: dict) -> threading.Thread:
    def send() -> None:
        results[rid] = httpx.post(url + "/v1/completions", json=BODY, headers={"X-Request-Id": rid},
                                  timeout=scaled(30))
    t = threading.Thread(target=send)
    t.start()
    return t


@pytest.fixture
def held_decode():
    d = ScriptedGroup("decode", 1)
    d.script({"hold": True})
    try:
        yield d
    finally:
        d.stop()


def test_queued_requests_are_admitted_in_their_order_of_arrival(held_decode):
    proxy, url = start_proxy("--decode", held_decode.url, "--max-inflight", "1", "--max-queue", "8",
                             "--queue-timeout", "60", "--health-check-interval", "0", "--debug-endpoints")
    results: dict = {}
    threads = []
    try:
        threads.append(post(url, "holder", results))
        wait_until(lambda: len(held_decode.journal()) == 1, "the first request to hold the only slot")
        order = [f"queued-{i}" for i in range(5)]
        for i, rid in enumerate(order):  # one at a time: their order of arrival is known
            threads.append(post(url, rid, results))
            wait_until(lambda: runtime(url)["queued_requests"] == i + 1, f"{rid} to wait in the queue")
        httpx.post(held_decode.url + "/_release", json={})
        for t in threads:
            t.join(scaled(30))
        assert {rid: r.status_code for rid, r in results.items()} == {rid: 200 for rid in ["holder", *order]}
        arrived = [e["headers"]["x-request-id"] for e in held_decode.journal()]
        assert arrived == ["holder", *order]
        assert runtime(url)["inflight_requests"] == 0 and runtime(url)["queued_requests"] == 0
    finally:
        proxy.stop()


def test_a_request_queued_longer_than_the_queue_timeout_gets_503_and_the_slot_stays_usable(held_decode):
    proxy, url = start_proxy("--decode", held_decode.url, "--max-inflight", "1", "--max-queue", "8",
                             "--queue-timeout", "0.5", "--health-check-interval", "0", "--debug-endpoints")
    results: dict = {}
    try:
        c = Counters(url)
        holder = post(url, "holder", results)
        wait_until(lambda: len(held_decode.journal()) == 1, "the first request to hold the only slot")
        started = time.monotonic()
        queued = [post(url, f"late-{i}", results) for i in range(3)]
        for t in queued:
            t.join(scaled(30))
        assert time.monotonic() - started >= 0.5
        for i in range(3):
            r = results[f"late-{i}"]
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_timeout"
        assert holder.is_alive(), "the held request kept its slot while the others timed out"
        assert runtime(url)["queued_requests"] == 0 and runtime(url)["inflight_requests"] == 1
        httpx.post(held_decode.url + "/_release", json={})
        holder.join(scaled(30))
        assert results["holder"].status_code == 200
        after = httpx.post(url + "/v1/completions", json=BODY, timeout=scaled(10))
        assert after.status_code == 200  # the slot came back; no timed-out waiter took it
        assert c.errors("queue", "queue_timeout") == 3
        assert len(held_decode.journal()) == 2  # none of the timed-out ones reached the instance
        assert runtime(url)["inflight_requests"] == 0
    finally:
        proxy.stop()


# -- the hand-over races, on the object itself (no process can time a cancellation to the instant) --

def test_a_slot_handed_to_a_request_cancelled_before_it_resumed_goes_to_the_next_in_line():
    async def scenario() -> None:
        admission = Admission(1, 4, 60.0)
        held = admission.take()
        assert held is admission and admission.take() is None
        first = asyncio.ensure_future(admission.queue())
        second = asyncio.ensure_future(admission.queue())
        await asyncio.sleep(0)
        assert admission.waiting == 2
        admission.release()  # the slot is now the first's ...
        first.cancel()  # ... which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await second is admission  # the second got it, nobody lost it
        assert admission.inflight == 1 and admission.waiting == 0
        admission.release()
        assert admission.inflight == 0 and admission.take() is admission

    asyncio.run(scenario())


def test_a_request_cancelled_while_queued_leaves_its_place_and_no_slot():
    async def scenario() -> None:
        admission = Admission(1, 1, 60.0)
        admission.take()
        gone = asyncio.ensure_future(admission.queue())
        await asyncio.sleep(0)
        with pytest.raises(ProxyError) as full:
            admission.check()  # the one queue place is taken
        assert full.value.error_type == "overloaded"
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert admission.waiting == 0
        admission.check()  # the place is free again
        waiter = asyncio.ensure_future(admission.queue())
        await asyncio.sleep(0)
        admission.release()
        assert await waiter is admission and admission.inflight == 1
        admission.release()
        assert admission.inflight == 0 and not admission._queue

    asyncio.run(scenario())


def test_a_timed_out_request_gets_503_and_a_newcomer_never_jumps_the_queue():
    async def scenario() -> None:
        admission = Admission(1, 4, 0.05)
        admission.take()
        with pytest.raises(ProxyError) as late:
            await admission.queue()
        assert late.value.status == 503 and late.value.error_type == "queue_timeout"
        assert admission.waiting == 0 and not admission._queue
        waiter = asyncio.ensure_future(admission.queue())
        await asyncio.sleep(0)
        admission.release()  # handed to the waiter: a newcomer arriving now finds no free slot
        assert admission.take() is None
        assert await waiter is admission

    asyncio.run(scenario())
