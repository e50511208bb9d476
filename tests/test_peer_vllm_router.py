"""Differential check against vllm-router (PyPI), vLLM's own Rust P/D router: the same requests
through both proxies must reach the instances with the same protocol fields, and give the client
the same stream. Deliberate differences are listed in docs/reference/protocol.md and excluded here."""

import json
import shutil

import httpx
import pytest

from procs import HOST, Proc, free_port, start_proxy, start_scripted

pytestmark = pytest.mark.skipif(shutil.which("vllm-router") is None, reason="vllm-router not installed")

# fields vllm-router adds or rewrites on its own (SGLang-era defaults), not part of vLLM's P/D protocol
ROUTER_EXTRAS = {"include_reasoning", "logprobs", "no_stop_trim", "ignore_eos", "continue_final_message",
                 "skip_special_tokens", "separate_reasoning", "stream_reasoning", "return_hidden_states", "echo"}

REQUESTS = [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
                              "max_completion_tokens": 10, "min_tokens": 3, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
                              "stream": False}),
    ("/v1/completions", {"model": "m", "prompt": "a b c", "max_tokens": 12, "stream": True, "temperature": 0}),
]


@pytest.fixture(scope="module")
def peers():
    (p, p_url), (d, d_url) = start_scripted("prefill"), start_scripted("decode")
    port = free_port()
    router = Proc(["vllm-router", "--vllm-pd-disaggregation", "--prefill", p_url, "--decode", d_url, "--host", HOST,
                   "--port", str(port), "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
                   "--policy", "round_robin"], name="vllm-router")
    proxy = None
    try:
        router.wait_http(f"http://{HOST}:{port}/health", timeout=30)
        proxy, url = start_proxy("--prefill", p_url, "--decode", d_url, "--health-check-interval", "0")
        yield {"router": f"http://{HOST}:{port}", "pdproxy": url, "p": p_url, "d": d_url}
    finally:
        for proc in (proxy, router, p, d):
            if proc is not None:
                proc.stop()


def run_through(peers, name, path, body):
    for leg in ("p", "d"):
        httpx.post(peers[leg] + "/_reset", json={})
    answer = httpx.post(peers[name] + path, json=body, timeout=20)
    prefill = httpx.get(peers["p"] + "/_journal").json()
    decode = httpx.get(peers["d"] + "/_journal").json()
    assert len(prefill) == len(decode) == 1, name
    return answer, prefill[0], decode[0]


def protocol_fields(body):
    return {k: v for k, v in body.items() if k not in ROUTER_EXTRAS}


def client_events(answer):
    """The stream's events without the response id (the router puts its own request id into it)."""
    if not answer.headers["content-type"].startswith("text/event-stream"):
        return {k: v for k, v in answer.json().items() if k != "id"}
    events = []
    for block in answer.text.split("\n\n"):
        if block.startswith("data: {"):
            event = json.loads(block[6:])
            event.pop("id", None)
            events.append(event)
        elif block:
            events.append(block)
    return events


@pytest.mark.parametrize("path,body", REQUESTS, ids=["chat-stream", "chat-whole", "completions-stream"])
def test_same_bodies_reach_the_instances_and_the_same_answer_reaches_the_client(peers, path, body):
    theirs = run_through(peers, "router", path, body)
    ours = run_through(peers, "pdproxy", path, body)
    assert theirs[0].status_code == ours[0].status_code == 200
    assert protocol_fields(ours[1]["body"]) == protocol_fields(theirs[1]["body"])  # prefill leg
    assert protocol_fields(ours[2]["body"]) == protocol_fields(theirs[2]["body"])  # decode leg
    assert client_events(ours[0]) == client_events(theirs[0])
    # both send one id per request, the same on both legs
    for leg in (theirs, ours):
        assert leg[1]["headers"]["x-request-id"] == leg[2]["headers"]["x-request-id"]


def test_prefill_errors_compared(peers):
    """A prefill 4xx reaches the client as-is from both; a 5xx is a 500 text from the router and an
    OpenAI-style 502 naming the stage from pdproxy (a deliberate difference)."""
    bad = {"error": {"message": "prompt too long", "type": "BadRequestError", "param": None, "code": 400}}
    path, body = REQUESTS[2]
    for name in ("router", "pdproxy"):
        httpx.post(peers["p"] + "/_script", json=[{"status": 400, "body": bad}])
        answer = _without_decode(peers, name, path, body)
        assert answer.status_code == 400 and answer.json() == bad
    httpx.post(peers["p"] + "/_script", json=[{"status": 500, "body": {"error": {"message": "down"}}}] * 3)
    assert _without_decode(peers, "router", path, body).status_code == 500
    ours = _without_decode(peers, "pdproxy", path, body)
    assert ours.status_code == 502 and "prefill" in ours.json()["error"]["message"]


def _without_decode(peers, name, path, body):
    """Send a request whose prefill fails; the decode instance must never be called."""
    httpx.post(peers["d"] + "/_reset", json={})
    answer = httpx.post(peers[name] + path, json=body, timeout=20)
    assert httpx.get(peers["d"] + "/_journal").json() == []
    return answer
