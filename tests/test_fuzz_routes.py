"""Hypothesis drives every route of a real proxy process with hostile input: methods, paths,
headers (request ids, trace context, keys, DP rank) and bodies (JSON of any shape, raw bytes).
Whatever arrives, the answer is a 2xx or an OpenAI-style 4xx JSON error: never a 5xx, never a
traceback, never a hang; and every inference request is counted exactly once."""

import json
import string

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledgers import Counters, ScriptedGroup
from procs import start_proxy

ROUTES = ["/v1/completions", "/v1/chat/completions", "/health", "/healthcheck", "/status", "/v1/models", "/metrics"]
INFERENCE = {"/v1/completions", "/v1/chat/completions"}
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "stream",
          "stream_options", "n", "temperature", "kv_transfer_params", "request_id", "logprobs", "echo"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
request_like = st.fixed_dictionaries({}, optional={k: json_values for k in FIELDS}) | st.fixed_dictionaries(
    {"prompt": st.text(max_size=20) | st.lists(st.integers(0, 50000), max_size=5)},
    optional={"stream": st.booleans(), "max_tokens": st.integers(-5, 50), "model": st.text(max_size=10)})
chat_like = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", 1]),
                                                 "content": json_values}), max_size=3)},
    optional={"stream": json_values, "max_completion_tokens": json_values})
valid = st.fixed_dictionaries({"prompt": st.text(max_size=20), "max_tokens": st.integers(1, 8),
                                "stream": st.booleans()}, optional={"model": st.text(max_size=10)})
bodies = st.one_of(
    valid.map(lambda b: json.dumps(b).encode()),
    valid.map(lambda b: json.dumps(b).encode()),
    request_like.map(lambda b: json.dumps(b).encode()),
    chat_like.map(lambda b: json.dumps(b).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.just(b"[" * 5000),  # deep nesting
)
def header_value(raw: bytes) -> bytes:
    """Any bytes a client library will put on the wire as a header value (no CR, LF, NUL, edge blanks)."""
    return bytes(c for c in raw if c == 9 or 32 <= c < 127 or c >= 128).strip() or b"x"


header_bytes = st.binary(min_size=1, max_size=80).map(header_value)
trace_ids = st.sampled_from(["00", "ff", "01", "zz"]).flatmap(lambda v: st.tuples(
    st.just(v), st.text("0123456789abcdefABCDEF-", min_size=0, max_size=40)).map("-".join))
headers = st.just({}) | st.fixed_dictionaries({}, optional={
    "X-Request-Id": header_bytes | st.text(string.printable, max_size=300).map(str.encode).map(header_value),
    "traceparent": header_bytes | trace_ids.map(str.encode),
    "tracestate": header_bytes,
    "Authorization": header_bytes,
    "X-data-parallel-rank": header_bytes | st.integers(-3, 10**8).map(lambda i: str(i).encode()),
    "Content-Type": st.sampled_from([b"application/json", b"text/plain", b"multipart/form-data"]),
    "X-Big": st.integers(0, 12000).map(lambda n: b"a" * n),
})
requests = st.tuples(st.sampled_from(["POST"] * 6 + ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
                     st.sampled_from(ROUTES * 4) | st.text(string.ascii_letters + "/._%~-", max_size=40)
                     .map(lambda p: "/" + p.lstrip("/")),
                     headers, bodies)


@pytest.fixture(scope="module")
def proxy():
    p, d = ScriptedGroup("prefill", 1), ScriptedGroup("decode", 1)
    proc, url = start_proxy("--prefill", p.url, "--decode", d.url, "--max-body-bytes", "65536",
                            "--health-check-interval", "0", "--prefill-retries", "0", "--decode-retries", "0")
    try:
        yield proc, url
    finally:
        proc.stop()
        p.stop()
        d.stop()


def test_any_input_gets_a_clear_answer(proxy):
    proc, url = proxy
    counters = Counters(url)
    sent_to_inference = []
    client = httpx.Client(base_url=url, timeout=10)

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests)
    def check(req):
        method, path, hdrs, body = req
        r = client.request(method, path, headers=hdrs, content=body if method not in ("GET", "HEAD") else None)
        assert r.status_code < 500, (method, path, hdrs, body[:200], r.status_code, r.text[:300])
        if method == "POST" and path in INFERENCE and r.status_code != 431:
            sent_to_inference.append(r.status_code)
        if r.status_code >= 400 and method != "HEAD":
            error = r.json()["error"]  # OpenAI's shape, always
            assert isinstance(error["message"], str) and error["message"] and error["type"]
            assert "Traceback" not in r.text
        if r.status_code == 200 and method == "POST" and path in INFERENCE:
            assert r.text.rstrip().endswith(("data: [DONE]", "}"))

    check()
    client.close()
    assert counters.delta("pdproxy_requests_total") == len(sent_to_inference)  # each one, exactly once
    assert {200, 400} <= set(sent_to_inference)  # the fuzzer reached past validation too
    log = proc.output()
    assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
