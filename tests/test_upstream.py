"""The legs' HTTP/1.1 client (pdproxy/upstream.py) against raw servers on loopback: framing, keep-alive,
the failure kinds the retry rules tell apart, timeouts, back-pressure, cancellation and TLS.

Timing: bounds are lower bounds (a loaded machine only makes waits longer), or the test holds the
event loop itself to make a race happen in a fixed order."""

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdproxy.upstream import (HIGH_WATER, ConnectFailed, ConnectTimeout, Disconnected, MalformedResponse, ReadTimeout,
                              UpstreamClient)
from procs import HOST, Proc, free_port, unaccepting_listener

HEADERS = {"Content-Type": "application/json", "X-Request-Id": "r1"}


class RawServer:
    """Answers each request with the next scripted action; records requests and connections."""

    def __init__(self, *actions, ssl_context=None):
        self.actions = list(actions)
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed = asyncio.Event()  # some connection was closed by the client
        self.writers: list[asyncio.StreamWriter] = []
        self.ssl_context = ssl_context

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ssl_context)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        for w in self.writers:
            w.transport.abort()

    async def _serve(self, reader, writer):
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                action = self.actions.pop(0)
                if await action(writer, reader) == "close":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()


def answer(*parts, pause=0.0, then=None):
    async def act(writer, reader):
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause)
        return then
    return act


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_content_length_and_chunked_answers_on_one_kept_alive_connection():
    async def main():
        chunked = answer(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
                         b"6\r\ndata: \r\n", b"3\r\n{}\n\r\n1\r\n\n\r\n", b"0\r\n\r\n", pause=0.02)
        async with RawServer(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\nRetry-After: 3\r\n\r\n{\"a\": true}"),
                             chunked) as server:
            client = UpstreamClient(1.0, 5.0)
            r = await client.post(server.url, "/v1/completions", b'{"x":1}', HEADERS)
            assert (r.status, r.headers["retry-after"], await r.read()) == (200, "3", b'{"a": true}')
            r.release()
            r = await client.post(server.url, "/v1/chat/completions", b"{}", HEADERS)
            assert r.headers["content-type"] == "text/event-stream"
            parts = []
            while data := await r.readany():
                parts.append(data)
            assert b"".join(parts) == b"data: {}\n\n" and len(parts) >= 2 and r.at_eof
            r.release()
            assert server.connections == 1
            first = server.requests[0]
            assert first.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
            assert b"\r\nX-Request-Id: r1\r\n" in first and first.endswith(b'Content-Length: 7\r\n\r\n{"x":1}')
            await client.close()
    run(main())


def test_connection_close_and_close_delimited_bodies_are_not_reused():
    async def main():
        async with RawServer(answer(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"),
                             answer(b"HTTP/1.1 200 OK\r\n\r\nuntil ", b"the end", pause=0.02, then="close"),
                             answer(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")) as server:
            client = UpstreamClient(1.0, 5.0)
            for expected in (b"ok", b"until the end"):
                r = await client.post(server.url, "/", b"{}", HEADERS)
                assert await r.read() == expected
                r.release()
            r = await client.post(server.url, "/", b"{}", HEADERS)
            assert r.status == 503 and await r.read() == b""
            assert server.connections == 3
            await client.close()
    run(main())


def test_bytes_after_the_answer_retire_the_connection():
    async def main():
        twice = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                       b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra")
        async with RawServer(twice, answer(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext")) as server:
            client = UpstreamClient(1.0, 5.0)
            r = await client.post(server.url, "/", b"{}", HEADERS)
            assert await r.read() == b"ok"  # the answer itself is whole
            r.release()
            r = await client.post(server.url, "/", b"{}", HEADERS)
            assert await r.read() == b"next" and server.connections == 2  # never reused: the extra is not "next"'s
            await client.close()
    run(main())


def test_a_refused_connection_fails_at_once():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        client = UpstreamClient(1.0, 5.0)
        with pytest.raises(ConnectFailed):
            await client.post(f"http://127.0.0.1:{port}", "/", b"{}", HEADERS)
    run(main())


def test_a_handshake_never_completed_is_a_connect_timeout():
    listener, fillers = unaccepting_listener()  # its SYNs are dropped: nothing refuses, nothing answers
    try:
        async def main():
            client = UpstreamClient(0.3, 5.0)
            started = time.monotonic()
            with pytest.raises(ConnectTimeout) as info:
                await client.post(f"http://{HOST}:{listener.getsockname()[1]}", "/", b"{}", HEADERS)
            assert not isinstance(info.value, ConnectFailed | ReadTimeout)
            assert time.monotonic() - started >= 0.3  # it waited out --connect-timeout: not a refusal
            await client.close()
        run(main())
    finally:
        for s in (listener, *fillers):
            s.close()


def test_transfer_encoding_is_recognised_in_any_case():
    async def main():
        whole = answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: CHUNKED\r\n\r\n2\r\nok\r\n0\r\n\r\n")
        cut = answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n5\r\nhello\r\n", then="close")
        async with RawServer(whole, cut) as server:
            client = UpstreamClient(1.0, 5.0)
            r = await client.post(server.url, "/", b"{}", HEADERS)
            assert await r.read() == b"ok"
            r.release()
            r = await client.post(server.url, "/", b"{}", HEADERS)
            assert server.connections == 1  # the chunked answer ended where it said: kept alive
            with pytest.raises(Disconnected):  # no last chunk: truncated, not a body ended by the close
                await r.read()
            await client.close()
    run(main())


# -- keep-alive: idle limits, expiry, and connections the instance closed ---------------------------


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def fetch(client, url):
    r = await client.post(url, "/", b"{}", HEADERS)
    body = await r.read()
    r.release()
    return body


def test_at_most_max_idle_connections_stay_open():
    async def main():
        async with RawServer(*[answer(OK)] * 3) as server:
            client = UpstreamClient(1.0, 5.0, max_idle=1)
            both = [await client.post(server.url, "/", b"{}", HEADERS) for _ in range(2)]  # two at once
            assert server.connections == 2
            for r in both:
                assert await r.read() == b"ok"
                r.release()
            await asyncio.wait_for(server.closed.wait(), 10)  # one of them was closed, not kept
            assert await fetch(client, server.url) == b"ok" and server.connections == 2  # the other was reused
            await client.close()
    run(main())


def test_idle_connections_are_closed_when_their_keep_alive_runs_out():
    async def main():
        async with RawServer(answer(OK)) as server:
            client = UpstreamClient(1.0, 5.0, keepalive=0.2)
            assert await fetch(client, server.url) == b"ok"
            await asyncio.wait_for(server.closed.wait(), 10)  # closed by the proxy's side, unasked
            assert not client._pools[server.url].idle
            await client.close()
    run(main())


def test_an_expired_connection_is_not_reused_even_by_a_lagging_loop():
    """The loop is held past the keep-alive, so the sweeper never ran: the age is checked when taken."""
    async def main():
        async with RawServer(answer(OK), answer(OK)) as server:
            client = UpstreamClient(1.0, 5.0, keepalive=0.2)
            assert await fetch(client, server.url) == b"ok"
            time.sleep(0.3)  # a lagging loop (blocking on purpose)
            assert await fetch(client, server.url) == b"ok"
            assert server.connections == 2 and client.stale_retries == 0
            await client.close()
    run(main())


@pytest.fixture(scope="module")
def uvicorn_server():
    """vLLM's HTTP server (uvicorn, httptools) closing idle connections after 300 ms instead of 5 s."""
    port = free_port()
    proc = Proc([sys.executable, str(Path(__file__).with_name("keepalive_backend.py")), "--port", str(port),
                 "--timeout-keep-alive", "0.3"], name="uvicorn")
    url = f"http://{HOST}:{port}"
    try:
        proc.wait_http(url + "/")
        yield url
    finally:
        proc.stop()


def wait_until_peer_closed(client, url, timeout=10.0):
    """Block the loop (a lagging proxy) until the instance's FIN sits unread in the idle connection's
    socket: the proxy has not noticed, so its next request is written to a connection already closed."""
    (conn,) = client._pools[url].idle
    sock = socket.socket(fileno=os.dup(conn.transport.get_extra_info("socket").fileno()))
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    return
            except BlockingIOError:
                pass
            assert time.monotonic() < deadline, "the instance never closed its idle connection"
            time.sleep(0.01)
    finally:
        sock.close()  # the duplicate only: the connection stays open


def test_a_connection_uvicorn_closed_while_idle_is_resent_on_a_fresh_one(uvicorn_server):
    async def main():
        client = UpstreamClient(1.0, 5.0, keepalive=60.0)  # longer than the instance's: the race is possible
        first = json.loads(await fetch(client, uvicorn_server))
        wait_until_peer_closed(client, uvicorn_server)
        second = json.loads(await fetch(client, uvicorn_server))  # not a Disconnected: sent again
        assert client.stale_retries == 1
        assert second["request"] == first["request"] + 1  # the instance ran it once
        assert second["peer_port"] != first["peer_port"]  # on a new connection
        await client.close()
    run(main())


def test_only_a_reused_connection_closed_before_any_answer_byte_is_resent():
    async def main():
        async with RawServer(answer(OK), answer(then="close"), answer(OK),  # read, then closed unanswered
                             answer(b"HTTP/1.1 2", then="close"),  # part of an answer: it did get it
                             answer(then="close")) as server:  # on a fresh connection: it did get it
            client = UpstreamClient(1.0, 5.0)
            assert await fetch(client, server.url) == b"ok"
            assert await fetch(client, server.url) == b"ok"
            assert (client.stale_retries, server.connections, len(server.requests)) == (1, 2, 3)
            with pytest.raises(Disconnected):
                await client.post(server.url, "/", b"{}", HEADERS)
            with pytest.raises(Disconnected):
                await client.post(server.url, "/", b"{}", HEADERS)
            assert (client.stale_retries, server.connections, len(server.requests)) == (1, 3, 5)
            await client.close()
    run(main())


def test_silence_drop_and_garbage_are_told_apart():
    async def main():
        silent = asyncio.Event()  # never set: this instance never answers

        async def never(writer, reader):
            await silent.wait()

        async with RawServer(never,
                             answer(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", then="close"),
                             answer(b"not http at all\r\n\r\n")) as server:
            client = UpstreamClient(1.0, 0.3)
            started = time.monotonic()
            with pytest.raises(ReadTimeout):
                await client.post(server.url, "/", b"{}", HEADERS)
            assert time.monotonic() - started >= 0.3 - 0.01  # not before the silence lasted the read timeout
            r = await client.post(server.url, "/", b"{}", HEADERS)
            with pytest.raises(Disconnected):
                await r.read()
            with pytest.raises(MalformedResponse):
                await client.post(server.url, "/", b"{}", HEADERS)
            await client.close()
    run(main())


def test_read_timeout_counts_silences_not_the_whole_answer():
    read_timeout = 1.0
    took = []

    async def trickle(writer, reader):
        """One byte every 20 ms (50x shorter than the read timeout) until the answer outlasted it twice."""
        started = time.monotonic()
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while time.monotonic() - started < 2 * read_timeout:
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        took.append(time.monotonic() - started)

    async def main():
        async with RawServer(trickle) as server:
            client = UpstreamClient(1.0, read_timeout)
            r = await client.post(server.url, "/", b"{}", HEADERS)
            body = await r.read()
            assert body and set(body) == {ord("x")} and took[0] >= 2 * read_timeout
            await client.close()
    run(main())


def test_reading_again_after_a_pause_rearms_the_read_timeout():
    """Paused reading is not silence, but once the reader resumes, the instance's silence counts again."""
    size = 4 * HIGH_WATER

    async def stall(writer, reader):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (size + 1) + b"x" * size)
        await writer.drain()
        await asyncio.Event().wait()  # the last byte never comes

    async def main():
        async with RawServer(stall) as server:
            client = UpstreamClient(1.0, 0.3)
            r = await client.post(server.url, "/", b"{}", HEADERS)
            while not r._conn.paused:  # the buffer filled up: reading from the instance stopped
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # longer than the read timeout while paused: no timeout
            got = 0
            with pytest.raises(ReadTimeout):
                while data := await r.readany():
                    got += len(data)
            assert got == size  # everything sent was read, then the silence timed out
            await client.close()
    run(main())


def test_cancelling_a_request_closes_its_connection():
    async def hang(writer, reader):
        assert await reader.read() == b""  # nothing more, then the end of the connection

    async def main():
        async with RawServer(hang) as server:
            client = UpstreamClient(1.0, 10.0)
            task = asyncio.create_task(client.post(server.url, "/", b"{}", HEADERS))
            while not server.requests:
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.wait_for(server.closed.wait(), 2)  # the instance sees the request go away
            with pytest.raises(asyncio.CancelledError):
                await task
            await client.close()
    run(main())


def test_a_reader_that_stops_reading_stops_the_instance_writing():
    async def main():
        size = 16 * 2**20
        sent = asyncio.Event()

        async def big(writer, reader):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            for _ in range(size // 2**16):
                writer.write(b"x" * 2**16)
            sent.set()
            await writer.drain()

        async with RawServer(big) as server:
            client = UpstreamClient(1.0, 0.5)
            r = await client.post(server.url, "/", b"{}", HEADERS)
            await sent.wait()
            await asyncio.sleep(0.8)  # longer than the read timeout: paused reading is not silence
            buffered = server.writers[0].transport.get_write_buffer_size()
            assert buffered > size // 2  # the client took at most a socket buffer or two, then paused
            assert len(await r.read()) == size
            await client.close()
    run(main())


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_https_instances_are_verified_against_the_trust_store(certificate, monkeypatch):
    cert, key = certificate
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)

    async def main(expect_ok):
        async with RawServer(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"), ssl_context=context) as server:
            client = UpstreamClient(2.0, 5.0)
            if expect_ok:
                r = await client.post(server.url, "/", b"{}", HEADERS)
                assert await r.read() == b"ok"
            else:
                with pytest.raises(ConnectFailed):
                    await client.post(server.url, "/", b"{}", HEADERS)
            await client.close()

    run(main(expect_ok=False))  # self-signed: not in the system's trust store
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # OpenSSL reads it when the default context is made
    run(main(expect_ok=True))


def test_a_pooled_connection_reuses_its_read_timer_and_still_times_out():
    """The timer armed for one answer stays for the next request on the connection (no timer per request); an
    answer complete but not yet released is not timed out; a silence on the next request still is."""
    silent = asyncio.Event()  # never set

    async def never(writer, reader):
        await silent.wait()

    async def main():
        ok = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        async with RawServer(ok, ok, never) as server:
            client = UpstreamClient(1.0, 0.3)
            loop = asyncio.get_running_loop()
            armed = []
            call_at = loop.call_at
            loop.call_at = lambda *args, **kwargs: armed.append(args) or call_at(*args, **kwargs)
            try:
                r = await client.post(server.url, "/", b"{}", HEADERS)
                assert await r.read() == b"{}"
                r.release()
                timers = len(armed)
                r = await client.post(server.url, "/", b"{}", HEADERS)
                assert len(armed) == timers, "a second request on a pooled connection armed a timer of its own"
                assert await r.read() == b"{}"
                await asyncio.sleep(0.5)  # the timer fires with the answer complete, not yet released
                assert not r._conn.closed
                r.release()
                started = time.monotonic()
                with pytest.raises(ReadTimeout):
                    await client.post(server.url, "/", b"{}", HEADERS)
                assert time.monotonic() - started >= 0.3 - 0.01
                assert server.connections == 1
            finally:
                loop.call_at = call_at
                await client.close()
    run(main())
