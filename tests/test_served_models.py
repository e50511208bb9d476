"""A request no instance can serve is the client's mistake: answered as vLLM answers it, before any
prefill, and never counted as the cluster's failure (issue 43, item 2)."""

import httpx
import pytest

from ledgers import counter
from procs import start_proxy, start_sim
from waits import wait_until

MAX_MODEL_LEN = 4608  # the simulator's default preset (pdproxy/sim/presets.py)


@pytest.fixture(scope="module")
def cluster():
    procs = []
    try:
        p_proc, p_url = start_sim("prefill")
        procs.append(p_proc)
        d_proc, d_url = start_sim("decode")
        procs.append(d_proc)
        proxy, url = start_proxy("--prefill", p_url, "--decode", d_url, "--health-check-interval", "0")
        procs.append(proxy)
        wait_until(lambda: httpx.get(url + "/status").json()["served_models"]["checked"],
                   "the proxy to read the instances' /v1/models")
        yield url, d_url
    finally:
        for proc in reversed(procs):
            proc.stop()


def prefill_attempts(url: str) -> float:
    return counter(httpx.get(url + "/metrics").text, "pdproxy_instance_attempts_total", role="prefill")


def test_status_lists_the_served_models_and_their_context(cluster):
    url, _ = cluster
    assert httpx.get(url + "/status").json()["served_models"] == {"checked": True, "served_when_asked": [],
                                                                  "max_model_len": {"sim-model": MAX_MODEL_LEN}}


@pytest.mark.parametrize("body", [
    {"model": "nope", "prompt": "a b c", "max_tokens": 4},  # no instance serves it
    {"model": "sim-model", "prompt": list(range(100, 140)), "max_tokens": MAX_MODEL_LEN},  # 40 + 4608 tokens
], ids=["unknown_model", "too_many_tokens"])
def test_what_vllm_would_refuse_is_refused_as_vllm_does_before_the_prefill(cluster, body):
    url, decode = cluster
    direct = httpx.post(decode + "/v1/completions", json=body, timeout=10)  # what a single vLLM answers
    assert direct.status_code in (400, 404)
    before = prefill_attempts(url)
    r = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert (r.status_code, r.json()) == (direct.status_code, direct.json())
    assert prefill_attempts(url) == before  # no prefill spent on it


def test_a_text_prompt_asking_for_more_than_the_context_is_refused_before_the_prefill(cluster):
    url, _ = cluster
    before = prefill_attempts(url)
    r = httpx.post(url + "/v1/chat/completions", json={"model": "sim-model", "max_completion_tokens": 100000,
                                                        "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "input_tokens" and error["code"] == 400
    assert error["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, "
                                       "you requested 100000 output tokens")
    assert prefill_attempts(url) == before
    text = httpx.get(url + "/metrics").text
    assert counter(text, "pdproxy_request_errors_total", error_type="context_length_exceeded", stage="queue") >= 1


def test_a_decode_refusing_the_request_is_not_the_clusters_failure(cluster):
    """What the proxy cannot foresee (a text prompt's length needs the tokenizer): the prefill runs,
    the decode refuses with 400. The client gets vLLM's 400; the decode is not charged (no ejection,
    no abandoned hand-off on its account: the prefill's blocks are still counted held), and the
    failure is `upstream_4xx`, which the paging rule leaves out."""
    url, decode = cluster
    prompt = " ".join("abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(MAX_MODEL_LEN - 4))  # one token each
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 64}
    direct = httpx.post(decode + "/v1/completions", json=body, timeout=10)
    assert direct.status_code == 400
    before = httpx.get(url + "/metrics").text
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert (r.status_code, r.json()) == (400, direct.json())
    after = httpx.get(url + "/metrics").text
    assert prefill_attempts(url) == counter(before, "pdproxy_instance_attempts_total", role="prefill") + 1
    assert counter(after, "pdproxy_instance_abandoned_handoffs_total") == \
        counter(before, "pdproxy_instance_abandoned_handoffs_total")
    assert counter(after, "pdproxy_abandoned_handoffs_total") == counter(before, "pdproxy_abandoned_handoffs_total") + 1
    assert counter(after, "pdproxy_request_errors_total", error_type="upstream_4xx") == \
        counter(before, "pdproxy_request_errors_total", error_type="upstream_4xx") + 1
    status = httpx.get(url + "/status").json()["instances"]["decode"][0]
    assert status["healthy"] and not status["ejected"]


def test_an_empty_model_name_is_served_with_the_instances_model(cluster):
    """vLLM serves `"model": ""` with its own model (`_is_model_supported`), and so does the simulator; the proxy
    checks it, as a request without a model, against that model's context (issue 54 items 2 and 4)."""
    url, decode = cluster
    body = {"model": "", "prompt": list(range(100, 140)), "max_tokens": 4}
    direct = httpx.post(decode + "/v1/completions", json=body, timeout=10)
    assert direct.status_code == 200 and direct.json()["model"] == "sim-model"
    assert httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200
    for model in ("", None):
        too_long = {"prompt": list(range(100, 140)), "max_tokens": MAX_MODEL_LEN,
                    **({"model": model} if model is not None else {})}
        direct = httpx.post(decode + "/v1/completions", json=too_long, timeout=10)
        before = prefill_attempts(url)
        r = httpx.post(url + "/v1/completions", json=too_long, timeout=10)
        assert (r.status_code, r.json()) == (400, direct.json())
        assert prefill_attempts(url) == before  # no prefill spent on it
