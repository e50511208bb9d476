"""The served-model check refuses only what vLLM refuses (issue 54 items 1-4), against instances that list and
check models as vLLM 0.23 does (tests/vllm_models_backend.py): a model they start serving after the proxy
read their listings, an adapter their LoRA resolver loads on its first request, `"model": ""`, any name under
VLLM_SKIP_MODEL_NAME_VALIDATION; an adapter in the listing keeps the checks on; a request without a model is
checked against the default model's context. What the proxy refuses never reaches an instance (its journal)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from procs import HOST, Proc, free_port, start_proxy
from waits import scaled, wait_until

from pdproxy.served import RELIST_SECONDS

BACKEND = str(Path(__file__).with_name("vllm_models_backend.py"))


@pytest.fixture(scope="module")
def instances():
    procs, urls = [], []
    try:
        for _ in range(2):
            port = free_port()
            proc = Proc([sys.executable, BACKEND, "--port", str(port)], name="vllm-models")
            procs.append(proc)
            proc.wait_http(f"http://{HOST}:{port}/health")
            urls.append(f"http://{HOST}:{port}")
        yield urls
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
def proxy(instances, started):
    """The instances serving model-a (4,096 tokens) unless a test says otherwise, and a fresh proxy in front."""
    def start(**serving) -> str:
        serve(instances, **{"names": ["model-a"], "max_model_len": 4096, **serving})
        proc, url = start_proxy(*[a for u in instances for a in ("--decode", u)], "--health-check-interval", "0")
        started.append(proc)
        wait_until(lambda: served_models(url)["checked"], "the proxy to read the listings")
        return url
    return start


def serve(instances: list[str], **serving) -> None:
    for url in instances:
        httpx.post(url + "/_serve", json=serving, timeout=scaled(5)).raise_for_status()


def served_models(url: str) -> dict:
    return httpx.get(url + "/status", timeout=scaled(5)).json()["served_models"]


def reached(instances: list[str], model: object) -> int:
    """Generations for `model` that reached the instances."""
    return sum(entry["model"] == model for url in instances
               for entry in httpx.get(url + "/_journal", timeout=scaled(5)).json())


def complete(url: str, model: object = None, **fields) -> httpx.Response:
    body = {"prompt": "a b c", "max_tokens": 4, **fields}
    if model is not None:
        body["model"] = model
    return httpx.post(url + "/v1/completions", json=body, timeout=scaled(10))


def test_a_model_the_instances_start_serving_is_served_and_the_old_one_forgotten(proxy, instances):
    url = proxy()
    assert complete(url, "model-a").status_code == 200
    serve(instances, names=["model-b"], max_model_len=2048)  # both restarted with --model model-b
    time.sleep(RELIST_SECONDS)
    r = complete(url, "model-b")
    assert r.status_code == 200, r.text  # main: 404 for as long as it ran
    assert served_models(url)["max_model_len"] == {"model-b": 2048}  # model-a forgotten
    before = reached(instances, "model-b")
    r = complete(url, "model-b", max_tokens=3000)  # its own context now
    assert r.status_code == 400 and "maximum context length is 2048 tokens" in r.json()["error"]["message"]
    r = complete(url, "model-a")
    assert (r.status_code, r.json()["error"]["type"]) == (404, "NotFoundError")
    assert reached(instances, "model-b") == before and reached(instances, "model-a") == 1  # refused here


def test_what_vllms_model_check_serves_is_not_refused(proxy, instances):
    url = proxy(resolvable=["adapter-1"])
    r = complete(url, "adapter-1")  # its LoRA resolver loads it on this first request
    assert r.status_code == 200, r.text
    assert reached(instances, "adapter-1") == 1
    assert complete(url, "").status_code == 200  # vLLM serves an empty name with its model
    serve(instances, names=["model-a"], max_model_len=4096, skip_validation=True)  # VLLM_SKIP_MODEL_NAME_VALIDATION
    r = complete(url, "whatever-name")
    assert r.status_code == 200, r.text
    assert "whatever-name" in served_models(url)["served_when_asked"]
    serve(instances, names=["model-a"], max_model_len=4096)  # and what no instance serves is still refused
    r = complete(url, "nope")
    assert (r.status_code, r.json()) == (404, {"error": {"message": "The model `nope` does not exist.",
                                                         "type": "NotFoundError", "param": "model", "code": 404}})
    assert reached(instances, "nope") == 0


def test_an_adapter_in_the_listing_keeps_the_checks_on(proxy, instances):
    url = proxy(adapters=["adapter-2"])
    assert served_models(url) == {"checked": True, "max_model_len": {"adapter-2": 4096, "model-a": 4096},
                                  "served_when_asked": []}  # main: checked false (no max_model_len: "not vLLM")
    r = complete(url, "nope-2")
    assert r.status_code == 404 and reached(instances, "nope-2") == 0
    r = complete(url, "adapter-2", max_tokens=100_000)
    assert r.status_code == 400 and "maximum context length is 4096 tokens" in r.json()["error"]["message"]
    assert reached(instances, "adapter-2") == 0
    assert complete(url, "adapter-2").status_code == 200


def test_a_request_without_a_model_is_checked_against_the_default_models_context(proxy, instances):
    url = proxy()
    for model in (None, ""):
        before = reached(instances, model)
        r = complete(url, model, max_tokens=5000)
        assert r.status_code == 400 and "maximum context length is 4096 tokens" in r.json()["error"]["message"]
        assert reached(instances, model) == before  # main: the instance refused it (in P/D: after its prefill)
        assert complete(url, model).status_code == 200


def test_the_instances_are_those_listed_at_each_refresh(instances):
    """`urls` is asked at every refresh (instances come and go, pdproxy/membership): a gone instance's names
    are forgotten with it."""
    import asyncio

    import aiohttp

    from pdproxy.served import ServedModels
    from pdproxy.telemetry.models import ModelNames

    serve(instances[:1], names=["model-a"], max_model_len=4096)
    serve(instances[1:], names=["model-c"], max_model_len=8192)

    async def scenario() -> list[dict]:
        served = ServedModels(ModelNames())
        listed = list(instances)
        async with aiohttp.ClientSession() as session:
            seen = []
            for keep in (2, 1):
                del listed[keep:]
                assert await served.refresh(session, lambda: listed, {}, scaled(5))
                seen.append(dict(served.context))
            return seen

    assert asyncio.run(scenario()) == [{"model-a": 4096, "model-c": 8192}, {"model-a": 4096}]
