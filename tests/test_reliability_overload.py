"""Overload and hostile clients: a bounded queue that refuses at once, deadlines for slow clients,
a body limit checked before reading, and memory that stays put through all of it."""

import concurrent.futures
import json
import socket
import statistics
import time

import httpx
import pytest

from ledgers import Counters, ScriptedGroup, proc_rss
from procs import start_proxy
from waits import scaled, wait_until

BODY = {"model": "m", "prompt": "one two three", "max_tokens": 8, "stream": False}


CLIENT = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=200))  # built once: building one is slow


def timed_post(url, body=BODY, timeout=30.0):
    started = time.monotonic()
    r = CLIENT.post(url + "/v1/completions", json=body, timeout=timeout)
    return r, time.monotonic() - started


def test_beyond_the_queue_503_comes_at_once_and_admitted_requests_keep_their_latency():
    """The instance holds every request until the test lets go: exactly max-inflight + max-queue are
    admitted, every later one is refused while those are still held (at once, not after waiting), and
    the queued ones are served as soon as the held ones are."""
    d = ScriptedGroup("decode", 1)
    proxy, url = start_proxy("--decode", d.url, "--max-inflight", "4", "--max-queue", "4", "--queue-timeout", "60",
                             "--health-check-interval", "0")
    try:
        d.script(*[{"hold": True}] * 8)
        c = Counters(url)
        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            admitted = [pool.submit(timed_post, url) for _ in range(8)]
            wait_until(lambda: len(d.journal()) == 4 and gauge(url, "pdproxy_queue_depth") == 4,
                       "4 requests held by the instance and 4 in the proxy's queue")
            # all back while the 8 are held, and long before the 60 s a queued request could wait
            refused = list(pool.map(lambda _: timed_post(url, timeout=scaled(10)), range(32)))
            held = d.journal()
            assert len(held) == 4 and not any(e["completed"] for e in held), "the refusals waited for the held"
            assert all(not f.done() for f in admitted)
            httpx.post(d.url + "/_release", json={})
            ok = [f.result(timeout=scaled(30)) for f in admitted]
        assert [r.status_code for r, _ in ok] == [200] * 8
        assert [r.status_code for r, _ in refused] == [503] * 32
        for r, _ in refused:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
        assert len(d.journal()) == 8  # the 4 queued reached the instance once a slot freed; no refused one did
        assert c.requests(503, "queue") == 32 and c.errors("queue", "overloaded") == 32
        assert c.requests(200) == 8
    finally:
        proxy.stop()
        d.stop()


def gauge(url, name):
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _open(url):
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.settimeout(5)
    return s


def _closed_by_peer(s, seen: dict, key: int) -> bytes | None:
    """What the proxy sent before closing (b'' when nothing); None while the socket is still open."""
    s.settimeout(0.01)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return seen.get(key, b"")
            seen[key] = seen.get(key, b"") + chunk
    except (socket.timeout, BlockingIOError):
        return None
    except ConnectionResetError:
        return seen.get(key, b"")


def test_slowloris_and_huge_bodies_cost_bounded_memory_and_are_cut_off():
    d = ScriptedGroup("decode", 1)
    proxy, url = start_proxy("--decode", d.url, "--keep-alive-timeout", "1.5", "--body-timeout", "1.5",
                             "--max-body-bytes", str(2**20), "--health-check-interval", "0", "--debug-endpoints")
    pid = proxy.popen.pid
    sockets = []
    try:
        for _ in range(50):
            timed_post(url)  # warm up
        rss_before = proc_rss(pid)
        baseline_sockets = httpx.get(url + "/debug/runtime").json()["sockets"]
        for i in range(300):  # a request head that never ends
            s = _open(url)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100)
            sockets.append(("head", s))
        for i in range(100):  # a body that never comes
            s = _open(url)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\":")
            sockets.append(("body", s))
        # huge bodies: announced ones are refused before a byte of them is read
        for _ in range(20):
            s = _open(url)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n")
            answer = s.recv(65536)
            assert answer.startswith(b"HTTP/1.1 413") and b'"body_too_large"' in answer
            s.close()
        # unannounced (chunked) ones are cut off at the limit
        def chunked_upload():
            def gen():
                for _ in range(48):
                    yield b"x" * 65536
            r = httpx.post(url + "/v1/completions", content=gen(), timeout=30)
            return r.status_code, r.json()["error"]["code"]

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            assert set(pool.map(lambda _: chunked_upload(), range(10))) == {(413, "body_too_large")}
        # meanwhile, everyone else is served as usual
        latencies = [timed_post(url) for _ in range(20)]
        assert all(r.status_code == 200 for r, _ in latencies)
        assert statistics.median(t for _, t in latencies) < scaled(0.5)
        assert proc_rss(pid) - rss_before < 60 * 2**20  # 400 stuck clients and 30 huge bodies later
        # head deadline 1.5 s; body deadline 1.5 s + 1.5 s drain
        answers, seen, deadline = {}, {}, time.monotonic() + scaled(6)
        while len(answers) < len(sockets) and time.monotonic() < deadline:
            for i, (kind, s) in enumerate(sockets):
                if i not in answers and (answer := _closed_by_peer(s, seen, i)) is not None:
                    answers[i] = answer
            time.sleep(0.1)
        assert len(answers) == len(sockets), f"{len(sockets) - len(answers)} slow clients still connected"
        for i, (kind, _) in enumerate(sockets):
            if kind == "body":
                assert answers[i].startswith(b"HTTP/1.1 408") and b'"body_timeout"' in answers[i]
            else:
                assert answers[i] == b""
        assert httpx.get(url + "/debug/runtime").json()["sockets"] <= baseline_sockets + 5
    finally:
        for _, s in sockets:
            s.close()
        proxy.stop()
        d.stop()
