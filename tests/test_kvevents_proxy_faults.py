"""A proxy process subscribed to a real publisher process, under what real engines and hostile ones send (issue 39):
a stream that never pauses, floods of large batches, messages over the size bound, a flood of old replay
answers, and an engine on IPv6. `/status` and `/metrics` are read as an operator reads them; `/health` is timed
while the proxy takes the flood (a stalled event loop answers late)."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import pytest

from kv_publisher import PublisherProcess
from procs import HOST, free_port, start_proxy, start_scripted
from test_kvevents_subscriber import prompt
from waits import scaled, wait_until

from pdproxy.config import Settings, kv_event_endpoints

STALL_BOUND = 0.5  # seconds: /health on a shared, loaded 2-core machine while the proxy takes a flood (main: 2-17 s)


def get(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=scaled(timeout)) as r:
        body = r.read()
        return json.loads(body) if r.headers.get("Content-Type", "").startswith("application/json") else body.decode()


class Subscribed:
    """A publisher process standing for the decode instance's engine, and a proxy subscribed to it."""

    def __init__(self, *proxy_args: str, scripted: bool = False) -> None:
        pub, replay = free_port(), free_port()
        self.publisher = PublisherProcess(pub, replay)
        self.procs = []
        if scripted:  # instances that answer, for requests
            for role in ("prefill", "decode"):
                proc, url = start_scripted(role)
                self.procs.append(proc)
                setattr(self, role, url)
        else:  # instances nothing is sent to
            self.prefill, self.decode = f"http://{HOST}:{free_port()}", f"http://{HOST}:{free_port()}"
        self.address = (self.decode if not scripted else self.prefill).removeprefix("http://")
        proxy, self.url = start_proxy(
            "--prefill", self.prefill, "--decode", self.decode, "--health-check-interval", "0",
            "--kv-events-instance", f"{self.address}=tcp://{HOST}:{pub}",
            "--kv-events-replay-instance", f"{self.address}=tcp://{HOST}:{replay}", *proxy_args)
        self.procs.append(proxy)
        self.proxy = proxy

    def status(self) -> dict:
        return get(self.url + "/status")["kv_events"][self.address]

    def stop(self) -> None:
        self.publisher.stop()
        for proc in self.procs:
            proc.stop()


@pytest.fixture
def cluster(request):
    made: list[Subscribed] = []

    def make(*args: str, **kwargs) -> Subscribed:
        made.append(Subscribed(*args, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.stop()


class HealthTimer:
    """/health asked again and again from a thread, each answer's latency kept."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies = url + "/health", []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=30) as r:
                r.read()
            self.latencies.append(time.perf_counter() - started)
            time.sleep(0.005)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.latencies


def decisions(url: str) -> dict[str, float]:
    """The prefill leg's precise_prefix decisions by reason, from /metrics."""
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^pdproxy_route_decisions_total\{([^}]*)\} (\S+)$", get(url + "/metrics"), re.M):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if named.get("role") == "prefill" and named.get("policy") == "precise_prefix":
            out[named["reason"]] = out.get(named["reason"], 0) + float(value)
    return out


def test_a_stream_that_never_pauses_stays_flowing_and_precise_routing_never_falls_back(cluster):
    c = cluster("--prefill-policy", "precise_prefix", scripted=True)
    c.publisher.send(every=0.3, seconds=scaled(19))
    wait_until(lambda: c.status()["flowing"] and c.status()["blocks"] > 0, "the first block stored")
    readings, sent = [], 0
    deadline = time.monotonic() + 16
    while time.monotonic() < deadline:
        body = {"model": "m", "prompt": prompt(sent % 5, blocks=2), "max_tokens": 4, "stream": True}
        req = urllib.request.Request(c.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=scaled(10)) as r:
            assert r.status == 200 and r.read().endswith(b"data: [DONE]\n\n")
        sent += 1
        readings.append(c.status())
        time.sleep(0.2)
    assert sent >= 30 and len(readings) >= 30
    not_flowing = [(r["not_flowing_reason"] if "not_flowing_reason" in r else "?", r["last_batch_age_seconds"])
                   for r in readings if not r["flowing"]]
    assert not_flowing == [], f"{len(not_flowing)} of {len(readings)} readings not flowing: {not_flowing[:3]}"
    made = decisions(c.url)
    assert made.get("approximate", 0) == 0 and sum(made.values()) == sent, made
    assert readings[-1]["batches"] >= 45 and readings[-1]["gaps"] == 0


def test_a_flood_of_large_batches_does_not_stall_the_proxy(cluster):
    c = cluster()
    wait_until(lambda: c.status()["flowing"], "the subscription")
    timer = HealthTimer(c.url)
    try:
        c.publisher.send(flood=64, blocks=8192)  # 64 batches of 131,072 token ids (~0.7 MiB each)
        wait_until(lambda: c.status()["batches"] >= 64, "the flood taken", timeout=120, interval=0.2)
    finally:
        latencies = timer.stop()
    assert len(latencies) >= 20
    print(f"flood of large batches: /health worst {max(latencies):.3f} s over {len(latencies)}")
    assert max(latencies) < STALL_BOUND, f"/health took {max(latencies):.3f} s during the flood"
    status = c.status()
    assert status["flowing"] and status["blocks"] == 262_144 and status["evicted_blocks"] > 0


def rss_peak_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def test_messages_over_the_size_bound_are_refused_skipped_and_memory_stays_bounded(cluster):
    """Batches over the bound (ZMQ's MAXMSGSIZE, from --kv-events-max-blocks) are refused before they are kept;
    the rebuild that follows skips them in the replay, and the instance flows again (issue 54 item 6: it stayed
    `rebuild_failed` for as long as the engine kept them, precise routing off for that instance)."""
    c = cluster("--kv-events-max-blocks", "1000")
    c.publisher.send(store=prompt(0))
    wait_until(lambda: c.status()["flowing"] and c.status()["blocks"] == 4, "the subscription")
    before = rss_peak_mib(c.proxy.popen.pid)
    timer = HealthTimer(c.url)
    try:
        c.publisher.send(big=3, bytes=20 << 20)  # three batches of 20 MiB (the bound is 256 KiB here)
        c.publisher.send(store=prompt(1))
        wait_until(lambda: c.status()["oversized_messages"] >= 1, "the big batches refused", timeout=30, interval=0.2)
        # flowing again, with what came before and after them
        wait_until(lambda: c.status()["flowing"] and c.status()["blocks"] == 8, "the instance flowing again",
                   timeout=30, interval=0.2)
    finally:
        latencies = timer.stop()
    grown = rss_peak_mib(c.proxy.popen.pid) - before
    print(f"oversized messages: peak RSS +{grown:.0f} MiB, /health worst {max(latencies):.3f} s")
    assert grown < 100, f"the proxy's peak RSS grew {grown:.0f} MiB"
    assert max(latencies) < STALL_BOUND
    status = c.status()
    assert status["max_message_bytes"] == 256 << 10 and status["gaps_unrepaired"] >= 3  # each skipped, counted
    assert status["oversized_messages"] >= 4  # the live one that dropped the stream, then each in the replay
    text = get(c.url + "/metrics")
    assert re.search(rf'^pdproxy_kv_event_oversized_messages_total\{{server_address="{c.address}"\}} [1-9]', text,
                     re.M)
    assert f'pdproxy_kv_events_flowing{{server_address="{c.address}"}} 1.0' in text
    c.publisher.send(store=prompt(2))  # and live batches are taken as before
    wait_until(lambda: c.status()["blocks"] == 12, "a live batch after them")


def test_a_flood_of_old_replay_answers_does_not_stall_the_proxy(cluster):
    """Python 3.12 does not yield on a receive that had finished already: skipped answers must count too."""
    c = cluster()
    c.publisher.send(store=prompt(0))
    wait_until(lambda: c.status()["flowing"] and c.status()["blocks"] == 4, "the subscription")
    probes = c.status()["replays"]
    c.publisher.send(old_answers=600_000)  # the next replay (the idle probe, every 2 s) answers these first
    timer = HealthTimer(c.url)
    try:
        wait_until(lambda: c.status()["replays"] >= probes + 2, "two more probes", timeout=60, interval=0.2)
    finally:
        latencies = timer.stop()
    print(f"old replay answers: /health worst {max(latencies):.3f} s over {len(latencies)}")
    assert max(latencies) < STALL_BOUND, f"/health took {max(latencies):.3f} s during the flood"
    status = c.status()
    assert status["sequence_jumps"] >= 10_000 and status["blocks"] == 4


def test_an_engine_on_ipv6_is_followed_through_the_host_template(cluster):
    pub, replay = free_port(), free_port()
    publisher = PublisherProcess(pub, replay, host="[::1]")
    try:
        publisher.send(store=prompt(0))
        # the decode instance's host is an IPv6 literal; the template gives tcp://[::1]:PUB
        decode = f"http://[::1]:{pub}"
        proxy, url = start_proxy("--prefill", f"http://{HOST}:{free_port()}", "--decode", decode,
                                 "--health-check-interval", "0", "--kv-events-endpoint", "tcp://{host}:{port}",
                                 "--kv-events-replay-instance", f"::1:{pub}=tcp://[::1]:{replay}")
        try:
            status = lambda: get(url + "/status")["kv_events"][f"::1:{pub}"]
            assert status()["endpoint"] == f"tcp://[::1]:{pub}"
            wait_until(lambda: status()["flowing"] and status()["blocks"] == 4, "the catch-up over IPv6")
            publisher.send(store=prompt(1))
            wait_until(lambda: status()["blocks"] == 8, "a live batch over IPv6")
        finally:
            proxy.stop()
    finally:
        publisher.stop()


def test_an_ipv6_instance_may_be_named_with_or_without_brackets_in_an_override():
    s = Settings(prefill_urls=["http://[::1]:8100"], decode_urls=["http://[fd00::2]:8200"],
                 kv_events_endpoint="tcp://{host}:5557", kv_events_replay_endpoint="tcp://{host}:{port}",
                 kv_events_instances={"[::1]:8100": "tcp://[::1]:6000"},
                 kv_events_replay_instances={"fd00::2:8200": "tcp://[fd00::2]:6001"})
    assert kv_event_endpoints(s) == [("::1:8100", "tcp://[::1]:6000", "tcp://[::1]:8100"),
                                     ("fd00::2:8200", "tcp://[fd00::2]:5557", "tcp://[fd00::2]:6001")]
