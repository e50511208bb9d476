"""Routing against what clients and instances may send (real processes): engine readings that are not
numbers, hostile /metrics expositions, bodies built to make the prefix key expensive, and one client
pinning a consistent-hash key. Each ends in a bounded choice, never an error or a stalled loop.

The instances are scripted (tests/scripted_backend.py): their /metrics says exactly what a test sets.
Loop stalls are measured inside the proxy (/debug/runtime's loop lag), against a window of the same
length without the hostile input, so a loaded machine loosens the bound instead of failing it.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from ledgers import Counters, counter
from procs import start_proxy, start_scripted
from waits import scaled, wait_until

QUIET = ("--health-check-interval", "0")
LAG_BOUND = 0.05  # seconds the loop may be held while an instance's input is handled


def exposition(waiting: str = "0.0", running: str = "0.0", usage: str = "0.0") -> str:
    """The three gauges load_aware reads, as vLLM 0.23 writes them."""
    return (f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}\n')


def serve_metrics(url: str, text: str, repeat: int = 1) -> None:
    httpx.post(url + "/_metrics", json={"text": text, "repeat": repeat}, timeout=30).raise_for_status()


def failures(url: str, instance: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return counter(text, "pdproxy_engine_metrics_read_failures_total", server_address=instance[len("http://"):])


def metrics_state(url: str) -> dict[str, str]:
    return {i["url"]: i["scores"]["metrics"] for i in httpx.get(url + "/status", timeout=10).json()["instances"]["decode"]}


def journal(url: str) -> list[dict]:
    return httpx.get(url + "/_journal", timeout=10).json()


def loop_lag(url: str) -> float:
    """The proxy's largest loop lag since the previous call."""
    return httpx.get(url + "/debug/runtime", timeout=10).json()["loop_lag_max_seconds"]


def scripted(procs, n: int, role: str = "decode") -> list[str]:
    urls = []
    for _ in range(n):
        proc, url = start_scripted(role)
        procs.append(proc)
        urls.append(url)
    return urls


@pytest.mark.parametrize("bad", ["NaN", "-1000", "+Inf"])
def test_load_aware_takes_a_non_finite_or_negative_reading_as_unreadable(procs, bad):
    """NaN made every request a 500 (nothing equals NaN when choosing the least); a negative reading
    drew every request to the one instance. Either is an unreadable reading: counted, and the choice
    falls back to in-flight counts, which share the load."""
    good, liar = scripted(procs, 2)
    serve_metrics(good, exposition())
    serve_metrics(liar, exposition(waiting=bad))
    proxy, url = start_proxy("--decode", good, liar, "--decode-policy", "load_aware", "--load-metrics-interval", "0.2",
                             *QUIET)
    procs.append(proxy)
    wait_until(lambda: failures(url, liar) >= 2, f"two failed reads of the reading {bad}", timeout=20)
    assert metrics_state(url) == {good: "ok", liar: "unreadable"}
    counters = Counters(url)
    for n in range(6):
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": f"a b {n}", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    assert counters.delta("pdproxy_route_decisions_total", policy="load_aware", reason="inflight_fallback") == 6
    assert len(journal(good)) >= 2 and len(journal(liar)) >= 2  # one at a time: (about) in turn
    assert failures(url, good) == 0
    assert proxy.output().count("cannot read engine load from " + liar) == 1
    assert "Traceback" not in proxy.output()


# hostile expositions, each served to the proxy every read; what it cost the proxy to read before:
HOSTILE = {
    # 8 MB (under the old 8 MiB cap) of the very family the policy sums (the review: 2.14 s of loop per read)
    "8 MB of waiting samples": ('vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n', 140_000),
    # under the new size cap, still tens of thousands of samples (parsed one by one before: ~1 s)
    "2 MB of waiting samples": ('vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n', 35_000),
    # a family that starts like one the policy reads (picked by line prefix and parsed before)
    "2 MB of look-alikes": ('vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 1.0\n', 28_000),
    # a million empty lines
    "1 MiB of newlines": ("\n", 1 << 20),
}


def test_a_hostile_metrics_exposition_does_not_stall_the_loop(procs):
    good, hostile = scripted(procs, 2)
    serve_metrics(good, exposition())
    serve_metrics(hostile, exposition())
    proxy, url = start_proxy("--decode", good, hostile, "--decode-policy", "load_aware", "--load-metrics-interval",
                             "0.2", "--debug-endpoints", *QUIET)
    procs.append(proxy)
    wait_until(lambda: metrics_state(url) == {good: "ok", hostile: "ok"}, "both instances' readings", timeout=20)

    def window(reads: int) -> float:
        """The loop's largest lag while the hostile instance's /metrics fails `reads` more reads."""
        before = failures(url, hostile)
        loop_lag(url)
        wait_until(lambda: failures(url, hostile) >= before + reads, f"{reads} more failed reads", timeout=60)
        return loop_lag(url)

    loop_lag(url)
    time.sleep(scaled(1.0))  # the same polling and reads with a readable exposition: this machine's own lag
    assert failures(url, hostile) == 0
    baseline = loop_lag(url)
    bound = max(scaled(LAG_BOUND), 2 * baseline)
    for name, (text, repeat) in HOSTILE.items():
        serve_metrics(hostile, text, repeat)
        window(1)  # the reading in flight when the exposition changed
        lag = window(3)
        assert lag < bound, (name, lag, baseline)
        assert metrics_state(url)[hostile] == "unreadable", name
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "still served", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, (name, r.text)
    serve_metrics(hostile, exposition())  # readable again, and routed by engine load again
    wait_until(lambda: metrics_state(url)[hostile] == "ok", "the hostile instance readable again", timeout=20)
    assert "Traceback" not in proxy.output()


def empty_messages_body(size: int) -> bytes:
    """A chat body of `size` bytes, nearly all empty messages (`{}`): 2.7 million of them in 8 MB."""
    head, tail = b'{"model": "m", "max_tokens": 2, "messages": [', b"{}]}"
    return head + b"{}," * ((size - len(head) - len(tail)) // 3) + tail


def test_cache_aware_work_per_request_is_bounded_by_the_body_structure(procs):
    """The prompt key's size bound counted only message text, so 2.7 million empty messages were all
    walked (3 s of loop with cache_aware against 0.34 s with round_robin, which never looks at them).
    The loop lag around that one body is measured behind both policies: cache_aware adds next to nothing."""
    (instance,) = scripted(procs, 1)
    body = empty_messages_body(8_000_000)
    lags = {}
    for policy in ("round_robin", "cache_aware"):
        proxy, url = start_proxy("--decode", instance, "--decode-policy", policy, "--debug-endpoints", *QUIET)
        procs.append(proxy)
        each = []
        for _ in range(3):
            loop_lag(url)
            r = httpx.post(url + "/v1/chat/completions", content=body, timeout=120,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 200, (policy, r.text[:300])
            each.append(loop_lag(url))
        lags[policy] = min(each)  # the least of three: what the body costs, less this machine's noise
        proxy.stop()
    # parsing the body holds the loop for both alike; walking its messages held it ten times as long
    assert lags["cache_aware"] < 1.5 * lags["round_robin"] + scaled(LAG_BOUND), lags


@pytest.mark.parametrize("with_prefill", [False, True])
def test_one_session_key_cannot_pin_more_than_its_bounded_share_of_the_load(procs, with_prefill):
    """40 streams with one client-chosen X-Session-Id all went to one decode instance, unbounded.
    With bounded loads (factor 1.25) an instance takes a keyed request only while it has fewer than
    ceil(1.25 × mean) in flight, the rest go on along the ring: at most 25 of 40 on one of two.
    In P/D mode the decode is chosen before a slow prefill: the burst must see those already bound for it."""
    decode = scripted(procs, 2)
    for url in decode:  # every request is held open at the instance until the test releases it
        httpx.post(url + "/_script", json=[{"hold": True}] * 40).raise_for_status()
    legs: tuple[str, ...] = ()
    if with_prefill:
        prefill = scripted(procs, 1, role="prefill")
        httpx.post(prefill[0] + "/_script", json=[{"delay": 1.0}] * 40).raise_for_status()
        legs = ("--prefill", *prefill)
    proxy, url = start_proxy(*legs, "--decode", *decode, "--policy", "consistent_hash", *QUIET)
    procs.append(proxy)
    counters = Counters(url)
    answers: list[int] = []

    def stream() -> None:
        r = httpx.post(url + "/v1/completions", headers={"X-Session-Id": "one-client"}, timeout=60,
                       json={"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True})
        answers.append(r.status_code)

    threads = [threading.Thread(target=stream) for _ in range(40)]
    try:
        for t in threads:  # all at once: the bound holds for a burst, not only one request at a time
            t.start()
        held = wait_until(lambda: (lambda n: n if sum(n) == 40 else None)([len(journal(d)) for d in decode]),
                          "40 streams held at the instances", timeout=30)
        assert max(held) <= 25 and min(held) >= 15, held
        status = {i["url"]: i["scores"]["inflight"] for i in httpx.get(url + "/status").json()["instances"]["decode"]}
        assert sorted(status.values()) == sorted(held), (status, held)
    finally:
        for d in decode:
            httpx.post(d + "/_release", json={})
        for t in threads:
            t.join()
    assert answers == [200] * 40
    reasons = {reason: counters.delta("pdproxy_route_decisions_total", role="decode", policy="consistent_hash",
                                      reason=reason)
               for reason in ("hash_key", "load_bound")}
    assert reasons == {"hash_key": max(held), "load_bound": min(held)}, (reasons, held)
