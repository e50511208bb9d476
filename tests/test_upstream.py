"""The legs' HTTP/1.1 client (pdproxy/upstream.py) against raw servers on loopback: framing, keep-alive,
the failure kinds the retry rules tell apart, timeouts, back-pressure, cancellation and TLS."""

import asyncio
import ssl
import subprocess
import time

import pytest

from pdproxy.upstream import (ConnectFailed, ConnectTimeout, Disconnected, MalformedResponse, ReadTimeout,
                              UpstreamClient)

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


def test_refused_and_connect_timeout_say_the_request_never_arrived():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        client = UpstreamClient(1.0, 5.0)
        with pytest.raises(ConnectFailed):
            await client.post(f"http://127.0.0.1:{port}", "/", b"{}", HEADERS)
        # a non-routable address (TEST-NET-1) never answers the handshake; or the network refuses
        client = UpstreamClient(0.2, 5.0)
        with pytest.raises((ConnectTimeout, ConnectFailed)) as info:
            await client.post("http://192.0.2.1:9", "/", b"{}", HEADERS)
        assert not isinstance(info.value, ReadTimeout)
    run(main())


def test_silence_drop_and_garbage_are_told_apart():
    async def main():
        async with RawServer(answer(b"", pause=2.0),
                             answer(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", then="close"),
                             answer(b"not http at all\r\n\r\n")) as server:
            client = UpstreamClient(1.0, 0.3)
            started = time.monotonic()
            with pytest.raises(ReadTimeout):
                await client.post(server.url, "/", b"{}", HEADERS)
            assert 0.25 < time.monotonic() - started < 1.5
            r = await client.post(server.url, "/", b"{}", HEADERS)
            with pytest.raises(Disconnected):
                await r.read()
            with pytest.raises(MalformedResponse):
                await client.post(server.url, "/", b"{}", HEADERS)
            await client.close()
    run(main())


def test_read_timeout_counts_silences_not_the_whole_answer():
    async def main():
        slow = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", *[b"x"] * 5, pause=0.15)
        async with RawServer(slow) as server:
            client = UpstreamClient(1.0, 0.4)  # the answer takes 0.9 s, no silence is longer than 0.15 s
            r = await client.post(server.url, "/", b"{}", HEADERS)
            assert await r.read() == b"xxxxx"
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
