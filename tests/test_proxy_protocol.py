"""The P/D wire protocol as each leg and the client see it (proxy as a real process)."""

import json
import uuid

import httpx
import pytest

from procs import start_proxy
from scripted_backend import PREFILL_KV, default_stream

BODY = {"model": "m", "prompt": "one two three", "max_tokens": 50, "stream": True,
        "stream_options": {"include_usage": True}, "min_tokens": 5, "temperature": 0.5}


def post(url, body, path="/v1/completions", **kw):
    return httpx.post(url + path, json=body, timeout=10, **kw)


def test_prefill_leg_is_rewritten_exactly_as_vllm_expects(pd):
    p, d, url, _ = pd
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
            "max_completion_tokens": 20, "min_tokens": 4, "min_completion_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert post(url, chat, "/v1/chat/completions").status_code == 200
    leg = p.journal()[0]
    assert leg["path"] == "/v1/chat/completions"
    expected = {**chat, "max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 1, "min_completion_tokens": 1,
                "stream": False, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                                        "remote_engine_id": None, "remote_block_ids": None,
                                                        "remote_host": None, "remote_port": None}}
    del expected["stream_options"]
    assert leg["body"] == expected


def test_prefill_leg_adds_no_field_the_client_did_not_send(pd):
    p, _, url, _ = pd
    body = {"model": "m", "prompt": "a b", "max_tokens": 8}
    assert post(url, body).status_code == 200
    sent = p.journal()[0]["body"]
    assert "max_completion_tokens" not in sent and "min_completion_tokens" not in sent and "stream_options" not in sent
    assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["min_tokens"] == 1


def test_decode_leg_is_the_original_body_plus_prefill_params_verbatim(pd):
    p, d, url, _ = pd
    custom_kv = {**PREFILL_KV, "remote_num_tokens": 3, "transfer_mode": "pull", "extra": {"nested": [1, None]}}
    p.script({"body": {"id": "cmpl-1", "choices": [{"text": "x", "finish_reason": "length"}],
                       "kv_transfer_params": custom_kv}})
    assert post(url, BODY).status_code == 200
    assert d.journal()[0]["body"] == {**BODY, "kv_transfer_params": custom_kv}


def test_prefill_without_kv_params_sends_the_untouched_body_to_decode(pd):
    p, d, url, _ = pd
    p.script({"body": {"id": "cmpl-1", "choices": [{"text": "x", "finish_reason": "length"}]}})
    assert post(url, BODY).status_code == 200
    assert d.journal()[0]["body"] == BODY


def test_client_kv_transfer_params_are_rejected(pd):
    p, d, url, _ = pd
    r = post(url, {**BODY, "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "evil"}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params"
    assert p.journal() == [] and d.journal() == []


def test_request_id_is_honoured_sent_to_both_legs_and_echoed(pd):
    p, d, url, _ = pd
    r = post(url, BODY, headers={"X-Request-Id": "my-req-42"})
    assert r.headers["x-request-id"] == "my-req-42"
    assert p.journal()[0]["headers"]["x-request-id"] == "my-req-42"
    assert d.journal()[0]["headers"]["x-request-id"] == "my-req-42"


def test_request_id_is_generated_when_absent(pd):
    p, d, url, _ = pd
    r = post(url, BODY)
    rid = r.headers["x-request-id"]
    uuid.UUID(rid)
    assert p.journal()[0]["headers"]["x-request-id"] == rid == d.journal()[0]["headers"]["x-request-id"]


def test_invalid_request_id_is_a_400(pd):
    p, _, url, _ = pd
    r = post(url, BODY, headers={"X-Request-Id": "has space"})
    assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]
    assert p.journal() == []


def test_client_authorization_is_forwarded_without_a_configured_key(pd):
    p, d, url, _ = pd
    post(url, BODY, headers={"Authorization": "Bearer client-key"})
    assert p.journal()[0]["headers"]["authorization"] == "Bearer client-key"
    assert d.journal()[0]["headers"]["authorization"] == "Bearer client-key"


def test_stream_is_relayed_byte_for_byte_with_sse_content_type(pd):
    _, d, url, _ = pd
    tricky = [
        ": keep-alive comment\n\n",
        'data: {"id":"cmpl-1","choices":[{"index":0,"text":"a","finish_reason":null}]}\n\ndata: {"id":"cmpl-1","ch',
        'oices":[{"index":0,"text":"\u00e9\u4e2d","finish_reason":null}]}\n\n',
        'data: {"id":"cmpl-1","choices":[{"index":0,"text":"b","finish_reason":"length"}]}\r\n\r\n',
        "data: [DONE]\n\n",
    ]
    d.script({"chunks": tricky})
    with httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=10) as r:
        received = b"".join(r.iter_raw())
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
    assert received == "".join(tricky).encode()


def test_non_streaming_answer_keeps_decode_json_and_status(pd):
    _, d, url, _ = pd
    answer = {"id": "cmpl-9", "object": "text_completion", "choices": [{"index": 0, "text": "done", "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    d.script({"body": answer, "status": 200})
    r = post(url, {**BODY, "stream": False})
    assert r.status_code == 200 and r.json() == answer
    assert r.headers["content-type"].startswith("application/json")


def test_chat_stream_through_the_openai_sdk(pd):
    openai = pytest.importorskip("openai")
    _, _, url, _ = pd
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                                            max_tokens=8)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    expected = "".join(json.loads(c[6:])["choices"][0]["delta"].get("content", "")
                       for c in default_stream("r", chat=True) if '"choices": [{' in c)
    assert text == expected == "Hello P/D world!"


def test_single_mode_forwards_the_body_straight_to_the_instance(scripted_pd):
    _, d, _, _ = scripted_pd
    d.reset()
    proc, url = start_proxy("--decode", d.url, "--health-check-interval", "0")
    try:
        r = post(url, BODY, headers={"X-Request-Id": "single-1"})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        sent = d.journal()[0]
        assert sent["body"] == BODY and sent["headers"]["x-request-id"] == "single-1"
        assert httpx.get(url + "/healthcheck").json() == {"status": "ok", "prefill_instances": 0, "decode_instances": 1}
    finally:
        proc.stop()


def test_service_routes(pd):
    _, _, url, _ = pd
    assert httpx.get(url + "/healthcheck").json() == {"status": "ok", "prefill_instances": 1, "decode_instances": 1}
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "scripted-model"
    status = httpx.get(url + "/status").json()
    assert status["prefill_node_count"] == 1 and status["decode_node_count"] == 1
    missing = httpx.get(url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = httpx.get(url + "/v1/completions")
    assert wrong.status_code == 405 and "GET" in wrong.json()["error"]["message"]
    assert "pdproxy_requests_total" in httpx.get(url + "/metrics").text


def test_connections_to_instances_are_pooled(pd):
    p, d, url, _ = pd
    for _ in range(6):
        assert post(url, {**BODY, "stream": False}).status_code == 200
    assert len({tuple(e["peer"]) for e in p.journal()}) <= 2
    assert len({tuple(e["peer"]) for e in d.journal()}) <= 2
