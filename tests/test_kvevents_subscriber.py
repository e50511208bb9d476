"""The subscriber keeps an instance's index in step with a real publisher process: late start, gaps, restarts.

The publisher is tests/kv_publisher.py (vLLM 0.23's wire through pdproxy.kvevents.publisher) in its own process
group; the subscriber runs on this test's event loop as it runs on a proxy's."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kv_publisher import PublisherProcess
from procs import HOST, free_port
from waits import scaled

from pdproxy.kvevents import chain_hashes
from pdproxy.kvevents.subscriber import KVEvents, Source


def Publisher(pub: int, replay: int) -> PublisherProcess:
    return PublisherProcess(pub, replay)


def prompt(n: int, blocks: int = 4) -> list[int]:
    return [n * 1000 + k for k in range(16 * blocks)]


async def until(what: str, condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def held(sub, tokens) -> int:
    return sub.index.matched_blocks(chain_hashes(tokens, 16))


@pytest.fixture
def ports():
    return free_port(), free_port()


def test_late_start_gap_removal_and_restart(ports):
    pub_port, replay_port = ports
    publishers = [Publisher(pub_port, replay_port)]

    async def scenario():
        # a late start: three batches published before anyone subscribed
        for n in range(3):
            publishers[0].send(store=prompt(n))
        events = KVEvents([Source("d0", f"tcp://{HOST}:{pub_port}", f"tcp://{HOST}:{replay_port}", "kv@")],
                          probe_interval=0.5, replay_timeout=1.0)
        sub = events.get("d0")
        seen = []
        events.add_listener(lambda address, batch, live: seen.append((address, live)))
        events.start()
        try:
            await until("catch-up by replay", lambda: sub.flowing and all(held(sub, prompt(n)) == 4 for n in range(3)))
            assert sub.counts["replayed_batches"] >= 3 and sub.next_seq == 3 and seen[0] == ("d0", False)
            publishers[0].send(store=prompt(3))
            await until("a live batch", lambda: held(sub, prompt(3)) == 4)
            assert sub.counts["gaps"] == 0 and ("d0", True) in seen
            # a gap: batch 4 never reaches the PUB socket, batch 5 does; the replay brings 4
            publishers[0].send(store=prompt(4), send=False)
            publishers[0].send(store=prompt(5))
            await until("the gap repaired", lambda: held(sub, prompt(4)) == 4 and held(sub, prompt(5)) == 4)
            assert sub.counts["gaps"] == 1 and sub.counts["gaps_unrepaired"] == 0 and sub.next_seq == 6
            publishers[0].send(remove=prompt(0))
            await until("a removal", lambda: held(sub, prompt(0)) == 0)
            assert held(sub, prompt(1)) == 4
            # a lost tail: the last batch never sent live; the idle probe's replay brings it
            publishers[0].send(store=prompt(6), send=False)
            await until("the tail repaired", lambda: held(sub, prompt(6)) == 4)
            # an engine restart: a new process on the same ports, sequence from 0, cache empty
            publishers[0].stop()
            await until("the disconnection", lambda: not sub.flowing)
            publishers.append(Publisher(pub_port, replay_port))
            publishers[1].send(store=prompt(7))
            await until("the resync", lambda: held(sub, prompt(7)) == 4 and sub.flowing, timeout=15)
            assert all(held(sub, prompt(n)) == 0 for n in range(7))
            assert sub.next_seq == 1 and sub.counts["resyncs"] >= 2
            publishers[1].send(clear=True)
            await until("all cleared", lambda: len(sub.index) == 0)
            status = events.status()["d0"]
            assert status["flowing"] and status["decode_errors"] == 0 and status["batches"] >= 10
        finally:
            await events.stop()

    try:
        asyncio.run(scenario())
    finally:
        for p in publishers:
            p.stop()


def test_an_instance_that_is_not_there_is_not_flowing_and_does_not_block(ports):
    async def scenario():
        events = KVEvents([Source("p0", f"tcp://{HOST}:{ports[0]}", f"tcp://{HOST}:{ports[1]}")],
                          probe_interval=0.2, replay_timeout=0.2)
        events.start()
        try:
            ticks = 0
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:  # the loop keeps turning
                await asyncio.sleep(0.01)
                ticks += 1
            assert ticks > 50
            assert not events.get("p0").flowing and events.get("p0").next_seq is None
        finally:
            await events.stop()

    asyncio.run(scenario())


def test_proxy_counts_the_stream_in_metrics_and_shows_it_in_status(ports):
    """A proxy process subscribed through its flags (template off, one per-instance override from the env)."""
    import urllib.request

    from procs import start_proxy, start_scripted

    pub_port, replay_port = ports
    procs = []
    publisher = Publisher(pub_port, replay_port)
    try:
        prefill, prefill_url = start_scripted("prefill")
        decode, decode_url = start_scripted("decode")
        procs += [prefill, decode]
        address = decode_url.removeprefix("http://")
        publisher.send(store=prompt(1))  # before the proxy starts: caught up by replay
        proxy, url = start_proxy("--prefill", prefill_url, "--decode", decode_url, "--health-check-interval", "0",
                                 "--kv-events-instance", f"{address}=tcp://{HOST}:{pub_port}", env={
                                     "PDPROXY_KV_EVENTS_REPLAY_INSTANCE": f"{address}=tcp://{HOST}:{replay_port}"})
        procs.append(proxy)

        def status():
            with urllib.request.urlopen(url + "/status", timeout=5) as r:
                return json.loads(r.read())["kv_events"]

        deadline = time.monotonic() + scaled(10)
        while not (status()[address]["flowing"] and status()[address]["blocks"] == 4):
            assert time.monotonic() < deadline, status()
            time.sleep(0.05)
        publisher.send(store=prompt(2))
        publisher.send(store=prompt(3), send=False)
        publisher.send(store=prompt(4))
        while status()[address]["blocks"] != 16:
            assert time.monotonic() < deadline, status()
            time.sleep(0.05)
        state = status()
        assert list(state) == [address]  # the prefill has no endpoint: not subscribed
        assert state[address]["gaps"] == 1 and state[address]["next_seq"] == 4
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        label = f'{{server_address="{address}"}}'
        assert f"pdproxy_kv_event_batches_total{label} 4.0" in text
        assert f"pdproxy_kv_event_gaps_total{label} 1.0" in text
        assert f"pdproxy_kv_events_flowing{label} 1.0" in text
        assert f"pdproxy_kv_event_index_blocks{label} 16.0" in text
        # live batches only: 2 came live; the replay that repaired 3 brought 4 too, so live 4 was a duplicate
        assert f"pdproxy_kv_event_lag_seconds_count{label} 1.0" in text
    finally:
        publisher.stop()
        for proc in procs:
            proc.stop()


def test_an_idle_engine_is_caught_up_on_connection_and_again_after_its_restart(ports):
    """A subscription asks for the replay as soon as it connects, and again after every reconnection, whether
    or not the engine publishes anything (issue 54 item 7: a replica started in a quiet hour only rebuilt its
    index when a live batch came, or the probe interval ran out; here that interval is 30 s)."""
    pub_port, replay_port = ports
    publishers = [Publisher(pub_port, replay_port)]

    async def scenario():
        for n in range(3):
            publishers[0].send(store=prompt(n))  # then the engine is idle
        events = KVEvents([Source("d0", f"tcp://{HOST}:{pub_port}", f"tcp://{HOST}:{replay_port}", "kv@")],
                          probe_interval=30.0, replay_timeout=1.0)
        sub = events.get("d0")
        events.start()
        try:
            started = time.monotonic()
            await until("the catch-up of an idle engine", lambda: sub.flowing and held(sub, prompt(2)) == 4,
                        timeout=5)
            caught_up = time.monotonic() - started
            assert sub.counts["batches"] == 3 and sub.counts["replays"] >= 1
            # the engine restarts (a new process, sequence from 0) with one batch, then is idle again
            publishers[0].stop()
            await until("the disconnection", lambda: not sub.connected)
            publishers.append(Publisher(pub_port, replay_port))
            publishers[1].send(store=prompt(7))
            started = time.monotonic()
            await until("the rebuild after the reconnection", lambda: sub.flowing and held(sub, prompt(7)) == 4,
                        timeout=5)
            rebuilt = time.monotonic() - started
            assert all(held(sub, prompt(n)) == 0 for n in range(3)) and sub.next_seq == 1
            print(f"caught up {caught_up:.2f} s after the start, rebuilt {rebuilt:.2f} s after the restart")
        finally:
            await events.stop()

    try:
        asyncio.run(scenario())
    finally:
        for p in publishers:
            p.stop()
