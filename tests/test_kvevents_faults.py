"""What a faulty or hostile engine does to a subscription, against a real publisher process (tests/kv_publisher.py):
a malformed event, a replay socket that stops answering, a restarted subscription, a sequence number far ahead.
The subscriber runs on this test's event loop as on a proxy's (issue 39, items 1-4)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from kv_publisher import PublisherProcess
from procs import HOST, free_port
from test_kvevents_subscriber import held, prompt, until
from waits import scaled

from pdproxy.kvevents.subscriber import KVEvents, Source


@pytest.fixture
def publisher():
    pub_port, replay_port = free_port(), free_port()
    process = PublisherProcess(pub_port, replay_port)
    process.ports = (pub_port, replay_port)
    yield process
    process.stop()


@contextlib.asynccontextmanager
async def following(publisher, probe_interval: float = 0.5, replay_timeout: float = 1.0):
    """The subscriber following `publisher` as instance d0, started, and stopped on the way out."""
    pub_port, replay_port = publisher.ports
    events = KVEvents([Source("d0", f"tcp://{HOST}:{pub_port}", f"tcp://{HOST}:{replay_port}", "kv@")],
                      probe_interval=probe_interval, replay_timeout=replay_timeout)
    events.start()
    try:
        yield events
    finally:
        await events.stop()


async def always(what: str, condition, seconds: float) -> None:
    """`condition` holds at every look for `seconds` (a bounded observation, not a wait)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert condition(), what
        await asyncio.sleep(0.02)


def test_a_malformed_event_is_skipped_alone_and_the_subscription_goes_on(publisher):
    async def scenario():
        publisher.send(store=prompt(0))
        publisher.send(malformed=prompt(1))  # token ids that are lists (a TypeError on main), then a good store
        async with following(publisher) as events:
            sub = events.get("d0")
            await until("the catch-up", lambda: sub.flowing and held(sub, prompt(0)) == held(sub, prompt(1)) == 4)
            publisher.send(malformed=prompt(2))
            publisher.send(store=prompt(3))
            await until("live batches", lambda: held(sub, prompt(2)) == held(sub, prompt(3)) == 4)
            await always("flowing", lambda: sub.flowing, 1.5)  # probes replay from the next batch: no crash loop
            assert sub.counts["malformed_events"] == 2 and sub.counts["resyncs"] == 1
            assert sub.counts["batches"] == 4 and len(sub.index) == 16

    asyncio.run(scenario())


def test_a_failed_rebuild_is_not_trusted_and_is_retried(publisher):
    async def scenario():
        publisher.send(store=prompt(0))
        publisher.send(store=prompt(1))
        publisher.send(replay=False)
        async with following(publisher) as events:
            sub = events.get("d0")
            await until("the failed rebuild", lambda: sub.connected and sub.counts["replay_failures"] >= 1)
            publisher.send(store=prompt(2))  # live, but nothing before it is known: still not trusted
            reasons = set()
            await always("not flowing", lambda: not sub.flowing and not reasons.add(sub.status().get(
                "not_flowing_reason")), 1.5)
            publisher.send(replay=True)
            await until("the retried rebuild", lambda: sub.flowing, timeout=20)
            assert [held(sub, prompt(n)) for n in range(3)] == [4, 4, 4]
            assert sub.counts["rebuild_failures"] >= 1
            assert "rebuild_failed" in reasons <= {"rebuild_failed", "rebuilding"}
            # a restarted subscription (its task ended, as after a failure) rebuilds on a new replay socket
            await events.stop()
            publisher.send(store=prompt(3), send=False)  # only in the replay buffer
            events.start()
            await until("connected", lambda: sub.connected)
            publisher.send(store=prompt(4))
            await until("the rebuild after the restart",
                        lambda: sub.flowing and [held(sub, prompt(n)) for n in range(5)] == [4] * 5)

    asyncio.run(scenario())


def test_a_sequence_far_ahead_is_not_believed(publisher):
    async def scenario():
        publisher.send(store=prompt(0))
        async with following(publisher) as events:
            sub = events.get("d0")
            await until("the catch-up", lambda: sub.flowing and held(sub, prompt(0)) == 4)
            # a replay answer 2^62 ahead (only in the replay buffer: the idle probe brings it)
            publisher.send(seq=sub.next_seq + (1 << 62), store=prompt(1), send=False)
            await until("the probe", lambda: sub.counts.get("sequence_jumps", 0) >= 1)
            for n in (2, 3):
                publisher.send(store=prompt(n))
            await until("live batches after it", lambda: held(sub, prompt(2)) == held(sub, prompt(3)) == 4)
            assert held(sub, prompt(1)) == 0 and sub.next_seq == 3 and sub.flowing
            # a live batch far ahead: the index is rebuilt from the replay buffer (its bogus answers skipped)
            publisher.send(seq=(1 << 62), store=prompt(4))
            await until("the rebuild", lambda: sub.counts["resyncs"] == 2 and sub.flowing)
            publisher.send(store=prompt(5))
            await until("in sequence again", lambda: held(sub, prompt(5)) == 4)
            assert [held(sub, prompt(n)) for n in range(6)] == [4, 0, 4, 4, 0, 4] and sub.next_seq == 4

    asyncio.run(scenario())


def test_a_busy_stream_stays_trusted_without_its_replay_socket_until_a_batch_is_lost(publisher):
    async def scenario():
        publisher.send(store=prompt(0))
        async with following(publisher, probe_interval=0.3, replay_timeout=0.5) as events:  # silence allowed: 1.4 s
            sub = events.get("d0")
            await until("the catch-up", lambda: sub.flowing and held(sub, prompt(0)) == 4)
            publisher.send(replay=False)
            publisher.send(every=0.1, seconds=scaled(6))
            await always("flowing while every batch comes in sequence", lambda: sub.flowing, 3.0)
            assert sub.replay_answering is False and sub.counts["replay_failures"] >= 1  # the busy probe saw it
            publisher.send(store=prompt(1), send=False)  # lost: the gap cannot be repaired
            await until("untrusted", lambda: sub.not_flowing_reason == "rebuild_failed", timeout=5)
            assert sub.counts["gaps_unrepaired"] >= 1
            publisher.send(replay=True)
            await until("the rebuild", lambda: sub.flowing and held(sub, prompt(1)) == 4, timeout=20)
            assert sub.replay_answering is True
            # idle, and the replay socket gone: not heard from, not trusted
            await until("the publisher's end", lambda: time.monotonic() - sub.last_batch_at > 0.5, timeout=15)
            publisher.send(replay=False)
            await until("silence", lambda: sub.not_flowing_reason == "replay_unanswered", timeout=5)
            assert sub.connected

    asyncio.run(scenario())


def test_a_full_replay_buffer_is_taken_whole_though_the_engine_drops_answers_on_the_way(publisher):
    """10,000 batches answered at once: the engine's ROUTER drops what does not fit its queue to a slower
    reader (the end marker too); the replay resumes where the answers broke off, so nothing is lost."""
    async def scenario():
        publisher.send(flood=10_000, blocks=4, send=False)
        async with following(publisher, replay_timeout=1.0) as events:
            sub = events.get("d0")
            await until("the rebuild", lambda: sub.flowing, timeout=60)
            assert sub.counts["replayed_batches"] == 10_000 and sub.counts["gaps_unrepaired"] == 0
            assert len(sub.index) == 40_000 and sub.next_seq == 10_000 and sub.counts["rebuild_failures"] == 0

    asyncio.run(scenario())
