"""One client's large body holds the proxy's event loop only for as long as the parse takes (issue 54 item 8).

A chat of two million empty messages (6 MB, under --max-body-bytes) is the most objects per byte a client can
send. Reading it is one JSON parse; a walk of what the parse made, proving the fast reader's reading exact,
had cost several times the parse again, with every other request (here `/healthcheck`) waiting behind it.
The bound is relative to the parse as this machine does it right now (the standard library's, in this
process), so a loaded machine stretches both sides alike; benchmarks/big_body_stall.py measures the same
against an older tree side by side.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

from procs import HOST, start_proxy, start_scripted

MESSAGES = 2_000_000


def test_a_chat_of_millions_of_messages_holds_the_loop_no_longer_than_its_parse(started):
    decode_proc, decode = start_scripted("decode")
    started.append(decode_proc)
    proxy, url = start_proxy("--decode", decode, "--health-check-interval", "0", "--no-tracing")
    started.append(proxy)
    raw = b'{"max_tokens":4,"messages":[' + b",".join([b"{}"] * MESSAGES) + b"]}"
    parse = min(_timed(lambda: json.loads(raw)) for _ in range(2))  # what the parse alone costs here, now
    port = int(url.rsplit(":", 1)[1])
    done, longest, answers = threading.Event(), [0.0], [0]

    def poll() -> None:
        conn = http.client.HTTPConnection(HOST, port, timeout=60)
        while not done.is_set():
            t = time.perf_counter()
            conn.request("GET", "/healthcheck")
            assert conn.getresponse().read()
            longest[0] = max(longest[0], time.perf_counter() - t)
            answers[0] += 1
        conn.close()

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.2)
        conn = http.client.HTTPConnection(HOST, port, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=raw, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        conn.close()
        time.sleep(0.2)
    finally:
        done.set()
        poller.join()
    assert resp.status == 200  # the scripted decode's stream: the whole body went through
    assert answers[0] >= 10
    # main before the fix: 6-8x the parse (the walk); now about the parse plus freeing what it made
    assert longest[0] < 2.5 * parse + 0.25, f"/healthcheck waited {longest[0]:.2f}s; the parse alone takes {parse:.2f}s"


def _timed(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t
