"""Each failure gives the client a precise answer naming the stage (proxy as a real process)."""

import socket
import time

import httpx

from procs import free_port, raw_post, start_proxy
from waits import scaled

BODY = {"model": "m", "prompt": "one two three", "max_tokens": 16, "stream": True}


def post(url, body=BODY, **kw):
    return httpx.post(url + "/v1/completions", json=body, timeout=15, **kw)


def error_of(response):
    return response.json()["error"]


def test_prefill_4xx_is_returned_as_is_and_decode_never_runs(pd):
    p, d, url, _ = pd
    vllm_error = {"error": {"message": "This model's maximum context length is 4608 tokens", "type": "BadRequestError",
                            "param": None, "code": 400}}
    p.script({"status": 400, "body": vllm_error})
    r = post(url)
    assert r.status_code == 400 and r.json() == vllm_error
    assert d.journal() == []


def test_prefill_5xx_is_a_502_naming_the_prefill_stage(pd):
    p, d, url, _ = pd
    p.script({"status": 500, "body": {"error": {"message": "engine dead", "type": "InternalServerError"}}})
    r = post(url)
    assert r.status_code == 502
    err = error_of(r)
    assert "prefill" in err["message"] and "engine dead" in err["message"] and err["code"] == "upstream_5xx"
    assert d.journal() == []


def test_prefill_read_timeout_is_a_504(pd):
    p, d, url, _ = pd  # the proxy's --read-timeout is 2 s
    p.script({"delay": 30})
    started = time.monotonic()
    r = post(url)
    assert r.status_code == 504 and "prefill" in error_of(r)["message"] and error_of(r)["code"] == "timeout"
    assert time.monotonic() - started < min(scaled(6), 25)  # the 2 s timeout, not the instance's 30 s


def test_prefill_malformed_json_and_broken_kv_params(pd):
    p, d, url, _ = pd
    p.script({"body": "{not json"})
    r = post(url)
    assert r.status_code == 502 and error_of(r)["code"] == "invalid_prefill_response"
    p.script({"body": {"id": "x", "choices": [], "kv_transfer_params": "garbage"}})
    r = post(url)
    assert r.status_code == 502 and error_of(r)["code"] == "invalid_kv_params"
    assert d.journal() == []


def test_decode_status_is_checked_before_the_client_gets_a_200(pd):
    p, d, url, _ = pd
    d.script({"status": 500, "body": {"error": {"message": "KV load failed", "type": "InternalServerError"}}})
    r = post(url)
    assert r.status_code == 502
    assert "decode" in error_of(r)["message"] and "KV load failed" in error_of(r)["message"]


def test_decode_4xx_is_relayed_with_its_status(pd):
    _, d, url, _ = pd
    d.script({"status": 429, "headers": {"Retry-After": "3"}, "body": {"error": {"message": "slow down"}}})
    r = post(url)
    assert r.status_code == 429 and r.headers["retry-after"] == "3" and error_of(r)["message"] == "slow down"


def test_failure_mid_stream_ends_with_an_sse_error_event_and_done(pd):
    _, d, url, _ = pd
    d.script({"abort_after": 2})
    r = post(url)
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "decode" in events[-2]
    assert sum('"text"' in e for e in events) == 2  # what came before the break was delivered


def test_truncated_stream_without_done_is_reported(pd):
    _, d, url, _ = pd
    d.script({"chunks": ['data: {"id":"c","choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n']})
    r = post(url)
    assert r.text.endswith("data: [DONE]\n\n") and "stream_truncated" in r.text


def test_decode_silence_mid_stream_times_out(pd):
    _, d, url, _ = pd  # --read-timeout 2
    d.script({"stall_after": 1, "stall": 30})
    started = time.monotonic()
    r = post(url)
    assert time.monotonic() - started < min(scaled(8), 25)  # the 2 s timeout, not the instance's 30 s stall
    assert '"timeout"' in r.text and r.text.endswith("data: [DONE]\n\n")


def test_unreachable_instances_are_503s_naming_the_stage(pd):
    dead = f"http://127.0.0.1:{free_port()}"
    _, d, _, _ = pd
    proc, url = start_proxy("--prefill", dead, "--decode", d.url, "--prefill-retries", "0", "--health-check-interval", "0")
    try:
        r = post(url)
        assert r.status_code == 503 and "prefill" in error_of(r)["message"] and error_of(r)["code"] == "connect_error"
    finally:
        proc.stop()
    proc, url = start_proxy("--decode", dead, "--decode-retries", "0", "--health-check-interval", "0")
    try:
        r = post(url)
        assert r.status_code == 503 and "decode" in error_of(r)["message"]
    finally:
        proc.stop()


def test_client_disconnect_cancels_the_decode_request(pd):
    _, d, url, _ = pd
    d.script({"chunks": [f'data: {{"id":"c","choices":[{{"index":0,"text":"t{i}","finish_reason":null}}]}}\n\n'
                         for i in range(200)], "chunk_delay": 0.05})
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(raw_post({"model": "m", "prompt": "a b", "max_tokens": 200, "stream": True}))
        seen = b""
        while b"t1" not in seen:  # the stream is flowing: now hang up
            seen += s.recv(65536)
    deadline = time.monotonic() + scaled(5)
    while time.monotonic() < deadline and not d.journal()[0]["aborted"]:
        time.sleep(0.1)
    entry = d.journal()[0]
    assert entry["aborted"] and not entry["completed"]


def test_bad_input_gets_clear_400s(pd):
    p, d, url, _ = pd
    cases = {
        b"{not json": "not valid JSON",
        b"[1, 2]": "JSON object",
        b"": "empty",
        b'{"model": "m"}': "prompt",
        b'{"prompt": "x", "max_tokens": "ten"}': "max_tokens",
        b'{"prompt": "x", "stream": "yes"}': "stream",
    }
    for raw, words in cases.items():
        r = httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, raw
        assert words in error_of(r)["message"], (raw, r.text)
        assert error_of(r)["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    assert p.journal() == [] and d.journal() == []
