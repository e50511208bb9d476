"""A client that stops reading a stream is cut off, and its decode aborted, after --write-timeout."""

import socket

import httpx

from procs import raw_post, start_proxy, start_scripted
from waits import wait_until


def test_client_that_stops_reading_is_cut_off_and_its_decode_aborted():
    decode, d_url = start_scripted("decode")
    proxy, url = start_proxy("--decode", d_url, "--write-timeout", "1", "--health-check-interval", "0")
    try:
        event = 'data: {"id":"c","choices":[{"index":0,"text":"%s","finish_reason":null}]}\n\n' % ("x" * 8000)
        # 32 MB: far more than the socket buffers between the proxy and this client hold
        script = httpx.post(d_url + "/_script", json=[{"chunks": [event], "repeat": 4000, "chunk_delay": 0}])
        assert script.status_code == 200
        host, port = url.removeprefix("http://").split(":")
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: no autotuning to 32 MB
            s.connect((host, int(port)))
            s.sendall(raw_post({"model": "m", "prompt": "a b", "max_tokens": 4000, "stream": True}))
            s.recv(1024)  # the stream has started; from now on this client reads nothing
            entry = wait_until(lambda: (e := httpx.get(d_url + "/_journal").json()[0])["aborted"] and e,
                               "the proxy to give up on the client and abort the decode", timeout=15, interval=0.2)
            assert entry["aborted"] and not entry["completed"]
        metrics = httpx.get(url + "/metrics").text
        assert any(line.startswith("pdproxy_request_errors_total") and 'error_type="client_too_slow"' in line
                   and 'stage="decode"' in line and line.endswith(" 1.0") for line in metrics.splitlines())
    finally:
        proxy.stop()
        decode.stop()


def test_client_hanging_up_right_after_done_was_served():
    """A client may close as soon as it reads [DONE], before the instance ends its response: that
    request was served in full and must not count as a disconnect."""
    decode, d_url = start_scripted("decode")
    proxy, url = start_proxy("--decode", d_url, "--health-check-interval", "0")
    try:
        event = 'data: {"id":"c","choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n'
        # the instance ends its response 1 s after [DONE]
        httpx.post(d_url + "/_script", json=[{"chunks": [event, "data: [DONE]\n\n", ""], "chunk_delay": 0.5}])
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(raw_post({"model": "m", "prompt": "a b", "max_tokens": 4, "stream": True}))
            seen = b""
            while b"data: [DONE]" not in seen:
                seen += s.recv(65536)
        # counted once it ends, i.e. when the instance ends its response
        def counted():
            text = httpx.get(url + "/metrics").text
            return text if "pdproxy_requests_total{" in text else None

        metrics = wait_until(counted, "the request to be counted")
        assert 'pdproxy_requests_total{code="200"' in metrics and "client_disconnect" not in metrics
    finally:
        proxy.stop()
        decode.stop()
