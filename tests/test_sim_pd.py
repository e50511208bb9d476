"""P/D between two `pdproxy sim` processes: kv_transfer_params, the KV pull, leases and failed loads.

The prefill → decode hand-off is orchestrated here by the test, the way vLLM's toy proxy does it.
"""

from __future__ import annotations

import asyncio
import copy
import re
import time
from typing import Any

import aiohttp
import pytest

from pdproxy.sim.probe import PDResult, metric_value, pd_request, prefill_body, timed_request
from procs import free_port, start_sim
from waits import scaled, wait_until

pytestmark = pytest.mark.timeout(60)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def pd():
    """Prefill and decode on the fast two-GPU link preset; a 1.5 s lease so expiry is testable."""
    procs = []
    try:
        p, purl = start_sim("prefill", "--preset", "h200-llama8b-2gpu", "--kv-lease-seconds", "1.5",
                            "--engine-id", "prefill-engine-1")
        procs.append(p)
        d, durl = start_sim("decode", "--preset", "h200-llama8b-2gpu", "--enable-per-request-metrics")
        procs.append(d)
        yield purl, durl
    finally:
        for proc in procs:
            assert proc.stop() == 0, proc.output()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def call(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)


async def metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            return await r.text()


async def prefill(purl: str, body: dict[str, Any], request_id: str = "pd-1") -> dict[str, Any]:
    status, out = await call("POST", purl + COMPLETIONS, prefill_body(body), {"X-Request-Id": request_id})
    assert status == 200, out
    return out


async def decode(durl: str, body: dict[str, Any], kv: Any, path: str = COMPLETIONS) -> tuple[int, Any]:
    return await call("POST", durl + path, dict(body, kv_transfer_params=kv))


def test_prefill_returns_kv_params_naming_itself_and_holds_blocks(pd):
    purl, durl = pd
    body = {"prompt": list(range(1000, 1100)), "max_tokens": 8}
    out = run(prefill(purl, body, "hold-1"))
    assert out["usage"] == {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101,
                            "prompt_tokens_details": None}
    kv = out["kv_transfer_params"]
    host, port = purl.removeprefix("http://").split(":")
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_engine_id"] == "prefill-engine-1"
    assert kv["remote_host"] == host and kv["remote_port"] == int(port)
    assert re.fullmatch(r"cmpl-hold-1-0-[0-9a-f]{8}", kv["remote_request_id"])
    assert kv["tp_size"] == 1 and kv["remote_num_tokens"] == 100 and kv["transfer_mode"] == "pull"
    assert len(kv["remote_block_ids"]) == 1 and len(kv["remote_block_ids"][0]) == 7  # ceil(100 / 16)
    _, state = run(call("GET", purl + "/sim/state"))
    assert state["leases_held"] >= 1 and state["kv_blocks_used"] >= 7
    # the decode pulls them: the prefill frees them, the decode counts a NIXL transfer of 7 blocks
    before = run(metrics(durl))
    status, answer = run(decode(durl, body, kv))
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 8 and answer["kv_transfer_params"] is None
    after = run(metrics(durl))
    def delta(name: str) -> float:
        return metric_value(after, name) - metric_value(before, name)
    assert delta("vllm:nixl_xfer_time_seconds_count") == 1
    moved = delta("vllm:nixl_bytes_transferred_sum")
    assert moved == 7 * 16 * 131072
    _, state = run(call("GET", purl + "/sim/state"))
    assert state["leases_held"] == 0
    # the KV wait is part of the decode's queue time, as in vLLM
    assert answer["metrics"]["queue_time_ms"] > 0


def test_pd_output_equals_single_output(pd):
    purl, durl = pd
    proc, surl = start_sim("single", "--preset", "instant")
    try:
        body = {"messages": [{"role": "user", "content": "tell me about P/D disaggregation"}], "max_tokens": 12,
                "stream": True}

        async def both() -> tuple[PDResult, Any]:
            async with aiohttp.ClientSession() as s:
                pdr = await pd_request(s, purl, durl, CHAT, body, "same-1", keep_events=True)
                single = await timed_request(s, surl + CHAT, body, keep_events=True)
                return pdr, single
        pdr, single = run(both())
    finally:
        proc.stop()
    assert pdr.ok and single.ok

    def text(events: list[dict[str, Any]]) -> str:
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))
    assert text(pdr.decode.events) == text(single.events)
    assert sum(1 for e in single.events if e.get("choices") and e["choices"][0]["delta"].get("content")) == 12
    assert pdr.decode.events[0]["id"] == "chatcmpl-same-1"


def test_streaming_prefill_puts_kv_params_on_the_finish_chunk_only(pd):
    purl, _ = pd

    async def scenario():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "a b c d", "max_tokens": 1, "stream": True,
                    "stream_options": {"include_usage": True}, "kv_transfer_params": {"do_remote_decode": True}}
            return await timed_request(s, purl + COMPLETIONS, body, keep_events=True)
    t = run(scenario())
    assert t.ok
    with_params = [e for e in t.events if "kv_transfer_params" in e]
    assert len(with_params) == 1 and with_params[0]["choices"][0]["finish_reason"] == "length"
    assert len(with_params[0]["kv_transfer_params"]["remote_block_ids"][0]) == 1  # 4 tokens: one block


def test_decode_without_params_prefills_locally(pd):
    _, durl = pd
    status, out = run(call("POST", durl + COMPLETIONS, {"prompt": "local prefill please", "max_tokens": 3}))
    assert status == 200 and out["usage"]["completion_tokens"] == 3


def _expect_kv_failure(status: int, out: Any, fragment: str) -> None:
    assert status == 500, out
    err = out["error"]
    assert err["code"] == 500 and err["type"] == "InternalServerError" and "KV load failed" in err["message"]
    assert fragment in err["message"], err["message"]


@pytest.mark.parametrize("mutation, fragment", [
    ({"remote_port": "closed"}, "cannot read KV"),
    ({"remote_host": "127.0.0.2"}, "cannot read KV"),
    ({"remote_engine_id": "someone-else"}, "is not served here"),
    ({"remote_block_ids": "shifted"}, "block ids do not match"),
    ({"remote_request_id": "cmpl-nobody-0-deadbeef"}, "no KV blocks held"),
])
def test_failed_kv_pull_fails_the_decode_request(pd, mutation, fragment):
    purl, durl = pd
    body = {"prompt": "x y z " * 20, "max_tokens": 4}
    kv = run(prefill(purl, body))["kv_transfer_params"]
    bad = copy.deepcopy(kv)
    for key, value in mutation.items():
        if value == "closed":
            value = free_port()
        elif value == "shifted":
            value = [[b + 10_000 for b in kv["remote_block_ids"][0]]]
        bad[key] = value
    before = metric_value(run(metrics(durl)), "vllm:nixl_num_failed_transfers_total")
    status, out = run(decode(durl, body, bad))
    _expect_kv_failure(status, out, fragment)
    assert metric_value(run(metrics(durl)), "vllm:nixl_num_failed_transfers_total") == before + 1
    # the real params still work: a failed read does not consume the blocks
    status, out = run(decode(durl, body, kv))
    assert status == 200, out


def test_blocks_are_read_once(pd):
    purl, durl = pd
    body = {"prompt": "once only", "max_tokens": 2}
    kv = run(prefill(purl, body))["kv_transfer_params"]
    assert run(decode(durl, body, kv))[0] == 200
    status, out = run(decode(durl, body, kv))
    _expect_kv_failure(status, out, "no KV blocks held")


def test_streaming_decode_failure_is_an_http_500_not_an_sse_event(pd):
    purl, durl = pd
    body = {"prompt": "stream me", "max_tokens": 3, "stream": True}
    kv = run(prefill(purl, body))["kv_transfer_params"]
    kv["remote_engine_id"] = "wrong"

    async def scenario():
        async with aiohttp.ClientSession() as s:
            async with s.post(durl + COMPLETIONS, json=dict(body, kv_transfer_params=kv)) as r:
                return r.status, r.headers.get("Content-Type", ""), await r.json()
    status, ctype, out = run(scenario())
    assert status == 500 and ctype.startswith("application/json") and "KV load failed" in out["error"]["message"]


def test_lease_expiry_releases_blocks_and_fails_late_decodes(pd):
    purl, durl = pd
    body = {"prompt": "late decode " * 10, "max_tokens": 2}
    before = metric_value(run(metrics(purl)), "vllm:nixl_num_kv_expired_reqs_total")
    kv = run(prefill(purl, body, "late-1"))["kv_transfer_params"]
    # lease is 1.5 s on this prefill: wait until the prefill says it expired
    wait_until(lambda: (st := run(call("GET", purl + "/sim/state"))[1])["leases_held"] == 0
               and st["leases_expired_total"] >= 1, "the prefill's 1.5 s lease to expire")
    assert metric_value(run(metrics(purl)), "vllm:nixl_num_kv_expired_reqs_total") >= before + 1
    status, out = run(decode(durl, body, kv))
    _expect_kv_failure(status, out, "lease expired")


def test_heartbeat_extends_the_lease(pd):
    purl, durl = pd
    body = {"prompt": "kept alive " * 10, "max_tokens": 2}
    kv = run(prefill(purl, body, "alive-1"))["kv_transfer_params"]
    beat = {"remote_engine_id": kv["remote_engine_id"], "remote_request_id": kv["remote_request_id"]}
    for _ in range(3):  # 3 x 0.8 s > the 1.5 s lease
        time.sleep(0.8)
        status, out = run(call("POST", purl + "/sim/kv/heartbeat", beat))
        assert status == 200 and out["extended"] is True
    assert run(decode(durl, body, kv))[0] == 200
    status, out = run(call("POST", purl + "/sim/kv/heartbeat", beat))
    assert status == 404 and out["extended"] is False


def test_missing_remote_fields_are_a_bad_request(pd):
    _, durl = pd
    status, out = run(decode(durl, {"prompt": "a", "max_tokens": 1}, {"do_remote_prefill": True,
                                                                       "remote_engine_id": "e"}))
    assert status == 400 and "remote_host" in out["error"]["message"]


def test_injected_kv_load_failure_and_missing_params(pd):
    purl, durl = pd
    body = {"prompt": "faulty " * 30, "max_tokens": 2}
    run(call("POST", durl + "/sim/faults", {"faults": [{"kind": "kv_load_failure"}]}))
    kv = run(prefill(purl, body))["kv_transfer_params"]
    status, out = run(decode(durl, body, kv))
    _expect_kv_failure(status, out, "injected")
    assert run(decode(durl, body, kv))[0] == 200  # one-shot: the blocks are still held and readable

    run(call("POST", purl + "/sim/faults", {"faults": [{"kind": "no_kv_params"}]}))
    out = run(prefill(purl, body))
    assert out["kv_transfer_params"] is None


def test_random_kv_load_failures_from_the_command_line(pd):
    purl, _ = pd
    proc, durl = start_sim("decode", "--preset", "instant", "--kv-load-failure-rate", "1.0", "--seed", "1")
    try:
        body = {"prompt": "always failing", "max_tokens": 2}
        for _ in range(2):
            kv = run(prefill(purl, body))["kv_transfer_params"]
            status, out = run(decode(durl, body, kv))
            _expect_kv_failure(status, out, "injected")
    finally:
        proc.stop()


def test_instant_pd_pair_is_fast_and_complete():
    procs = []
    try:
        p, purl = start_sim("prefill", "--preset", "instant")
        procs.append(p)
        d, durl = start_sim("decode", "--preset", "instant")
        procs.append(d)

        async def many() -> tuple[list[PDResult], float]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                t0 = time.perf_counter()
                body = {"messages": [{"role": "user", "content": "fast " * 50}], "max_tokens": 64, "stream": True,
                        "stream_options": {"include_usage": True}}
                results = await asyncio.gather(*[pd_request(s, purl, durl, CHAT, body, f"i{i}") for i in range(60)])
                return list(results), time.perf_counter() - t0
        results, took = run(many())
        _, pstate = run(call("GET", purl + "/sim/state"))
    finally:
        for proc in procs:
            proc.stop()
    assert all(r.ok and r.decode.usage["completion_tokens"] == 64 and len(r.decode.chunk_times) == 64
               for r in results)
    assert pstate["leases_held"] == 0 and pstate["kv_blocks_used"] == 0  # every lease was pulled and released
    assert took < scaled(5)
