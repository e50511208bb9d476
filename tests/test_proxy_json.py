"""What the instances receive means what the client (or the prefill) sent, and JSON nested too deep
meets the error handling of invalid JSON, whatever orjson is installed (real processes: the proxy,
scripted instances)."""

from __future__ import annotations

import math
import uuid

import httpx
import pytest

from ledgers import Counters, ScriptedGroup, is_error, trace_of
from otlp import attrs
from procs import start_proxy
from scripted_backend import PREFILL_KV

pytestmark = pytest.mark.timeout(120)

BIG = 2 ** 127 + 12345  # a 128-bit id: orjson reads it as 1.7014118346046923e+38
DEEP = 5000  # levels: past json's recursion limit and orjson 3.13's 1,024
ENV = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    trace_file = tmp_path_factory.mktemp("json") / "spans.jsonl"
    p, d = ScriptedGroup("prefill", 1), ScriptedGroup("decode", 1)
    proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--prefill-retries", "0", "--decode-retries", "0",
                             "--health-check-interval", "0", "--eject-after-failures", "0", "--trace-file",
                             str(trace_file), env=ENV)
    try:
        yield {"p": p, "d": d, "url": url, "file": trace_file}
    finally:
        proxy.stop()
        p.stop()
        d.stop()


def post(url: str, data: bytes) -> tuple[httpx.Response, str]:
    rid = f"j-{uuid.uuid4().hex[:12]}"
    r = httpx.post(url + "/v1/completions", content=data, timeout=30,
                   headers={"Content-Type": "application/json", "X-Request-Id": rid})
    return r, rid


def test_numbers_reach_the_legs_as_the_client_and_the_prefill_wrote_them(rig):
    # 1e999 is infinity to vLLM's json.loads; orjson wrote it as null (no top_p, no bias)
    text = '{"model": "m", "prompt": "a b", "max_tokens": 2, "top_p": 1e999, "logit_bias": {"5": 1e999, "6": -1e999}}'
    answer = {"id": "cmpl-p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
              "kv_transfer_params": {**PREFILL_KV, "remote_request_id": BIG}}
    for body in (text.encode(), text.encode("utf-8-sig")):  # the decode gets the client's bytes, then a rewrite
        rig["p"].script({"body": answer})
        rig["d"].script()
        r, _ = post(rig["url"], body)
        assert r.status_code == 200, r.text
        for leg in (rig["p"].journal()[0]["body"], rig["d"].journal()[0]["body"]):
            assert leg["top_p"] == math.inf, leg
            assert leg["logit_bias"] == {"5": math.inf, "6": -math.inf}, leg
        sent = rig["d"].journal()[0]["body"]["kv_transfer_params"]["remote_request_id"]
        assert sent == BIG and isinstance(sent, int), sent  # verbatim, not 1.7014118346046923e+38


def deep(inner: str = "[]") -> str:
    return "[" * DEEP + inner + "]" * DEEP


# NaN sends every orjson to its fallback, json.loads, which raised RecursionError on such depth
DEEP_ANSWERS = {"deep": deep(), "deep with NaN": deep("NaN")}


@pytest.mark.parametrize("name", DEEP_ANSWERS)
def test_an_instances_answer_nested_too_deep_is_a_traced_invalid_response(rig, name):
    nested = DEEP_ANSWERS[name]

    # the prefill's answer: read whole (its kv_transfer_params go on), refused as invalid JSON
    rig["p"].script({"body": '{"id": "cmpl-p", "choices": [], "kv_transfer_params": {"x": %s}}' % nested})
    rig["d"].script()
    c = Counters(rig["url"])
    r, rid = post(rig["url"], b'{"model": "m", "prompt": "a b", "max_tokens": 2}')
    assert r.status_code == 502 and r.json()["error"]["code"] == "invalid_prefill_response", r.text
    assert c.errors("prefill", "invalid_prefill_response") == 1
    root = attrs(trace_of(rig["file"], rid)["root"])
    assert root["error.type"] == "invalid_prefill_response" and rig["d"].journal() == []

    # the decode's whole answer: read (orjson 3.8 reads 5,000 levels) or refused as invalid, never a crash
    rig["p"].script()
    whole = '{"id": "cmpl-d", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}], "x": %s}' % nested
    rig["d"].script({"body": whole})
    c = Counters(rig["url"])
    r, rid = post(rig["url"], b'{"model": "m", "prompt": "a b", "max_tokens": 2}')
    spans = trace_of(rig["file"], rid)
    if r.status_code == 200:
        assert name == "deep" and r.text == whole and not is_error(spans["root"])
    else:
        assert r.status_code == 502 and r.json()["error"]["code"] == "invalid_response", r.text
        assert is_error(spans["root"]) and attrs(spans["root"])["error.type"] == "invalid_response"
        assert c.errors("kv_transfer", "invalid_response") == 1

    # a streamed decode whose first event is nested too deep: read, or refused before the client has a 200
    event = 'data: {"id": "cmpl-d", "choices": [{"index": 0, "text": "x", "finish_reason": null}], "x": %s}\n\n'
    rig["d"].script({"chunks": [event % nested, "data: [DONE]\n\n"]})
    c = Counters(rig["url"])
    r, rid = post(rig["url"], b'{"model": "m", "prompt": "a b", "max_tokens": 2, "stream": true}')
    spans = trace_of(rig["file"], rid)
    if r.status_code == 200:
        assert name == "deep" and r.text.endswith("data: [DONE]\n\n") and not is_error(spans["root"]), r.text
    else:
        assert r.status_code == 502 and r.json()["error"]["code"] == "malformed_stream", r.text
        assert is_error(spans["root"]) and attrs(spans["root"])["error.type"] == "malformed_stream"
        assert c.errors("kv_transfer", "malformed_stream") == 1

    # a decode's 5xx whose body is nested too deep: its message is not read, the failure is as any 5xx
    rig["d"].script({"status": 500, "body": '{"error": %s}' % nested})
    c = Counters(rig["url"])
    r, rid = post(rig["url"], b'{"model": "m", "prompt": "a b", "max_tokens": 2}')
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_5xx", r.text
    assert attrs(trace_of(rig["file"], rid)["root"])["error.type"] == "upstream_5xx"


def test_a_client_body_nested_too_deep_is_a_400(rig):
    for nested in DEEP_ANSWERS.values():
        r, _ = post(rig["url"], ('{"model": "m", "prompt": "a", "x": %s}' % nested).encode())
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text


def test_a_model_listing_nested_too_deep_is_no_listing():
    """The model names an instance serves are learnt from its /v1/models in a task that must outlive
    a broken answer (pdproxy/telemetry/models.py)."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from pdproxy.served import listing as served_listing

    async def listing(request: web.Request) -> web.Response:
        return web.Response(text='{"data": %s}' % deep("NaN"), content_type="application/json")

    async def run() -> list:
        app = web.Application()
        app.router.add_get("/v1/models", listing)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                return [await served_listing(session, f"http://127.0.0.1:{port}", {}, 10)]
        finally:
            await runner.cleanup()

    assert asyncio.run(run()) == [None]
