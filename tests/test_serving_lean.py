"""pdproxy's own HTTP/1.1 server for the inference routes (pdproxy/serving/lean.py), seen from a client's
socket: pipelined requests in order, connections handed to aiohttp at a request's first byte, early
answers that keep the connection, keep-alive and `Connection: close`, and a graceful stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest

from ledgers import ScriptedGroup
from procs import HOST, start_proxy
from waits import scaled


def _post(rid: str, *, path: str = "/v1/completions", extra: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}).encode()
    return (b"POST %s %s\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: %s\r\n%s"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), version, rid.encode(), extra, len(body), body))


def _connect(url: str) -> tuple[socket.socket, object]:
    sock = socket.create_connection((HOST, int(url.rsplit(":", 1)[1])), timeout=scaled(10))
    return sock, sock.makefile("rb")


def _read_response(f) -> tuple[int, dict[str, str], bytes]:
    """One response from a buffered socket file: status, lower-cased headers, body (de-chunked)."""
    status_line = f.readline()
    assert status_line.startswith(b"HTTP/1."), status_line
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if status == 100:
        return status, headers, b""
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int(f.readline().strip(), 16):
            body += f.read(size + 2)[:size]
        assert f.readline() == b"\r\n"
    elif "content-length" in headers:
        body = f.read(int(headers["content-length"]))
    else:
        body = f.read()  # to the end of the connection (HTTP/1.0)
    return status, headers, body


def _streamed_ok(response: tuple[int, dict[str, str], bytes], rid: str) -> None:
    status, headers, body = response
    assert status == 200, body
    assert headers["x-request-id"] == rid
    assert headers["content-type"].startswith("text/event-stream")
    assert body.count(b"data: ") >= 5 and body.endswith(b"data: [DONE]\n\n"), body


@pytest.fixture
def rig():
    prefill, decode = ScriptedGroup("prefill", 1), ScriptedGroup("decode", 1)
    proxy, url = start_proxy("--prefill", prefill.url, "--decode", decode.url, "--health-check-interval", "0",
                             "--keep-alive-timeout", "1.5", "--api-key", "secret")
    yield url, decode, proxy
    proxy.stop()
    prefill.stop()
    decode.stop()


KEY = b"Authorization: Bearer secret\r\n"


def test_pipelined_requests_are_answered_in_order_and_another_route_moves_the_connection_to_aiohttp(rig):
    url, decode, _ = rig
    sock, f = _connect(url)
    with sock:
        health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        sock.sendall(_post("pipe-a", extra=KEY) + _post("pipe-b", extra=KEY) + health + _post("pipe-c", extra=KEY))
        _streamed_ok(_read_response(f), "pipe-a")
        _streamed_ok(_read_response(f), "pipe-b")
        status, _, body = _read_response(f)
        assert status == 200 and json.loads(body)["status"] == "ok"
        _streamed_ok(_read_response(f), "pipe-c")  # after the hand-over, on aiohttp's protocol
        sock.sendall(_post("pipe-d", extra=KEY))  # the connection stays usable
        _streamed_ok(_read_response(f), "pipe-d")
    ids = [e["headers"].get("x-request-id") for e in decode.journal()]
    assert ids == ["pipe-a", "pipe-b", "pipe-c", "pipe-d"], ids


@pytest.mark.parametrize("name, request_bytes, expect", [
    ("chunked body", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + KEY + b"Transfer-Encoding: chunked\r\n\r\n"
     b"%x\r\n%s\r\n0\r\n\r\n" % (len(b'{"prompt":"hi","max_tokens":4,"stream":true}'),
                                  b'{"prompt":"hi","max_tokens":4,"stream":true}'), 200),
    ("query string", _post("q", path="/v1/completions?x=1", extra=KEY), 200),
    ("HTTP/1.0", _post("old", extra=KEY, version=b"HTTP/1.0"), 200),
    ("Expect", _post("exp", extra=KEY + b"Expect: 100-continue\r\n"), 200),
    ("wrong method", b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    ("malformed header", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n", 400),
    ("too many headers", _post("many", extra=KEY + b"".join(b"X-H%d: v\r\n" % i for i in range(200))), 431),
    ("a header line too long", _post("long", extra=KEY + b"X-Long: " + b"a" * 9000 + b"\r\n"), 431),
    ("two lengths", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
     400),
])
def test_requests_the_lean_server_does_not_take_are_aiohttps_from_their_first_byte(rig, name, request_bytes, expect):
    url, _, _ = rig
    sock, f = _connect(url)
    with sock:
        sock.sendall(request_bytes)
        status, headers, body = _read_response(f)
        if status == 100:  # invited, as the head passed its checks
            status, headers, body = _read_response(f)
        assert status == expect, (name, body)
        if expect == 200:
            assert body.endswith(b"data: [DONE]\n\n")
        else:
            assert json.loads(body)["error"]["message"], body  # OpenAI's shape, not a text page


def test_an_early_answer_drops_the_unread_body_and_keeps_the_connection(rig):
    url, decode, _ = rig
    sock, f = _connect(url)
    with sock:
        # a wrong key with a 5000-byte body of which 100 came: refused from its head
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
                     b"Content-Length: 5000\r\n\r\n" + b" " * 100)
        status, _, body = _read_response(f)
        assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
        sock.sendall(b" " * 4900 + _post("after", extra=KEY))  # the rest, then the next request
        _streamed_ok(_read_response(f), "after")
        # Connection: close is honoured: the answer says so and the connection ends after it
        sock.sendall(_post("last", extra=KEY + b"Connection: close\r\n"))
        response = _read_response(f)
        _streamed_ok(response, "last")
        assert response[1].get("connection", "").lower() == "close"
        assert f.read() == b""
    assert [e["headers"].get("x-request-id") for e in decode.journal()] == ["after", "last"]


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(rig):
    url, _, _ = rig
    sock, f = _connect(url)
    with sock:
        sock.sendall(_post("idle", extra=KEY))
        _streamed_ok(_read_response(f), "idle")
        answered = time.monotonic()
        assert f.read(1) == b""  # closed by the proxy, not by this client's timeout
        waited = time.monotonic() - answered
        assert 1.0 <= waited < scaled(4), waited  # --keep-alive-timeout 1.5, swept every ~0.4 s


def test_a_stop_lets_the_stream_in_flight_finish(rig):
    url, decode, proxy = rig
    chunks = [f'data: {{"id":"s","choices":[{{"index":0,"text":"w{i}","finish_reason":null}}]}}\n\n' for i in range(6)]
    decode.script({"chunks": [*chunks, "data: [DONE]\n\n"], "chunk_delay": 0.25})
    sock, f = _connect(url)
    with sock:
        sock.sendall(_post("draining", extra=KEY))
        got: list = []
        reader = threading.Thread(target=lambda: got.append(_read_response(f)))
        reader.start()
        time.sleep(0.5)  # the stream has begun
        os.kill(proxy.popen.pid, signal.SIGTERM)
        reader.join(scaled(10))
        assert got, "no answer"
        status, _, body = got[0]
        assert status == 200 and body.endswith(b"data: [DONE]\n\n") and body.count(b'"text":"w') == 6, body
    assert proxy.popen.wait(scaled(10)) == 0
