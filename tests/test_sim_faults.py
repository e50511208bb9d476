"""Faults on demand in `pdproxy sim`: one-shot faults from POST /sim/faults and random ones from flags."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from pdproxy.sim.probe import Timed, timed_request
from procs import start_sim

pytestmark = pytest.mark.timeout(60)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
STREAM = {"prompt": "one two three", "max_tokens": 6, "stream": True}
PLAIN = {"prompt": "one two three", "max_tokens": 6}


@pytest.fixture(scope="module")
def sim():
    proc, url = start_sim("single")  # default timing: ~5 ms per token, so pauses are measurable
    try:
        yield url
    finally:
        assert proc.stop() == 0, proc.output()


@pytest.fixture(autouse=True)
def no_leftover_faults(request):
    yield
    if "sim" in request.fixturenames:
        asyncio.run(call("DELETE", request.getfixturevalue("sim") + "/sim/faults"))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, json=body) as r:
            return r.status, await r.json(content_type=None)


async def send(url: str, body: dict[str, Any], path: str = COMPLETIONS) -> Timed:
    async with aiohttp.ClientSession() as s:
        return await timed_request(s, url + path, body, keep_events=True)


def queue(url: str, *faults: dict[str, Any]) -> None:
    status, out = run(call("POST", url + "/sim/faults", {"faults": list(faults)}))
    assert status == 200, out


def test_error_fault_with_status_and_retry_after(sim):
    queue(sim, {"kind": "error", "status": 503, "retry_after": 2, "times": 2})

    async def scenario():
        async with aiohttp.ClientSession() as s:
            out = []
            for _ in range(3):
                async with s.post(sim + COMPLETIONS, json=PLAIN) as r:
                    out.append((r.status, r.headers.get("Retry-After"), await r.json()))
            return out
    (s1, ra1, b1), (s2, _, _), (s3, ra3, b3) = run(scenario())
    assert (s1, s2, s3) == (503, 503, 200)  # consumed after `times` requests
    assert ra1 == "2" and ra3 is None
    assert b1["error"]["code"] == 503 and b1["error"]["type"] == "ServiceUnavailableError"
    assert b3["usage"]["completion_tokens"] == 6


def test_faults_match_path_and_stream(sim):
    queue(sim, {"kind": "error", "status": 429, "match": {"path": CHAT, "stream": True}})
    assert run(send(sim, PLAIN)).status == 200
    assert run(send(sim, STREAM)).status == 200
    assert run(send(sim, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, CHAT)).status == 200
    t = run(send(sim, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}, CHAT))
    assert t.status == 429
    _, state = run(call("GET", sim + "/sim/state"))
    assert state["faults_queued"] == 0


def test_slow_start_delays_the_first_token(sim):
    base = run(send(sim, STREAM)).ttft
    queue(sim, {"kind": "slow_start", "seconds": 0.4})
    slow = run(send(sim, STREAM))
    assert slow.ok and slow.ttft >= 0.4 and slow.ttft > base + 0.3


def test_stall_pauses_a_stream_mid_way(sim):
    queue(sim, {"kind": "stall", "seconds": 0.4, "after_chunks": 2})
    t = run(send(sim, dict(STREAM, stream_options={"include_usage": True, "continuous_usage_stats": True})))
    assert t.ok and t.done and t.chunk_tokens[-1] == 6
    gaps = t.gaps
    assert gaps[1] >= 0.38  # between the 2nd and 3rd content chunk
    assert max(gaps[:1] + gaps[2:]) < 0.2
    # the engine kept generating during the stall: what accumulated comes in one chunk
    assert t.chunk_tokens[2] - t.chunk_tokens[1] > 1


def test_stall_delays_a_non_streamed_answer(sim):
    queue(sim, {"kind": "stall", "seconds": 0.3})
    t = run(send(sim, PLAIN))
    assert t.ok and t.done_at - t.sent_at >= 0.3


def test_disconnect_mid_stream(sim):
    queue(sim, {"kind": "disconnect", "after_chunks": 3})
    t = run(send(sim, STREAM))
    assert t.status == 200 and not t.done and len(t.chunk_times) == 3
    assert t.error and ("ClientPayloadError" in t.error or "Disconnected" in t.error)
    _, state = run(call("GET", sim + "/sim/state"))
    assert state["running"] == 0 and state["kv_blocks_used"] == 0  # the request was aborted, blocks freed
    queue(sim, {"kind": "disconnect"})
    t = run(send(sim, PLAIN))
    assert t.status == 0 and "Disconnected" in (t.error or "")


def test_malformed_chunk(sim):
    queue(sim, {"kind": "malformed_chunk", "after_chunks": 2})
    t = run(send(sim, STREAM))
    assert t.status == 200 and t.done and t.error and t.error.startswith("malformed chunk")
    assert len(t.chunk_times) == 6  # the stream goes on after the garbage


def test_refuse_resets_the_connection(sim):
    queue(sim, {"kind": "refuse", "times": 1})
    t = run(send(sim, PLAIN))
    assert t.status == 0 and t.error and ("reset" in t.error.lower() or "Disconnected" in t.error)
    assert run(send(sim, PLAIN)).ok


@pytest.mark.parametrize("spec, fragment", [
    ({"kind": "explode"}, "kind"),
    ({"kind": "error", "times": 0}, "times"),
    ({"kind": "error", "status": 99}, "status"),
    ({"kind": "stall", "seconds": "long"}, "seconds"),
    ({"kind": "error", "match": {"model": "x"}}, "match"),
    ({"kind": "error", "colour": "red"}, "unknown"),
])
def test_invalid_fault_specs_are_rejected(sim, spec, fragment):
    status, out = run(call("POST", sim + "/sim/faults", {"faults": [spec]}))
    assert status == 400 and fragment in out["error"]["message"]
    status, out = run(call("GET", sim + "/sim/faults"))
    assert out["faults"] == []


def test_delete_clears_queued_faults(sim):
    queue(sim, {"kind": "error", "times": 5})
    assert run(call("GET", sim + "/sim/faults"))[1]["faults"][0]["times"] == 5
    assert run(call("DELETE", sim + "/sim/faults"))[0] == 200
    assert run(send(sim, PLAIN)).ok


def test_random_faults_from_flags():
    proc, url = start_sim("single", "--preset", "instant", "--error-rate", "0.5", "--error-status", "502",
                          "--seed", "3")
    try:
        statuses = [run(send(url, PLAIN)).status for _ in range(40)]
    finally:
        proc.stop()
    assert set(statuses) == {200, 502} and 8 <= statuses.count(502) <= 32


def test_flag_driven_stall_slow_start_and_disconnect():
    proc, url = start_sim("single", "--preset", "instant", "--slow-start-seconds", "0.2", "--stall-seconds", "0.2",
                          "--stall-after-chunks", "1", "--disconnect-rate", "1", "--disconnect-after-chunks", "4")
    try:
        t = run(send(url, STREAM))
    finally:
        proc.stop()
    assert t.ttft >= 0.2 and t.gaps[0] >= 0.19 and len(t.chunk_times) == 4 and not t.done


def test_refuse_connections_flag_keeps_health_and_controls():
    proc, url = start_sim("single", "--refuse-connections")
    try:
        t = run(send(url, PLAIN))
        status, state = run(call("GET", url + "/sim/state"))
    finally:
        proc.stop()
    assert t.status == 0 and t.error
    assert status == 200 and state["requests_total"] == 0


async def head_then_body(url: str, body: dict[str, Any]) -> tuple[int, float, float, bytes, str | None]:
    """(status, seconds to the status line, seconds to the first body bytes, the body, the read error)."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        start = loop.time()
        async with s.post(url + COMPLETIONS, json=body) as r:
            head = loop.time() - start
            data, first, error = b"", None, None
            try:
                async for chunk in r.content.iter_any():
                    first = first if first is not None else loop.time() - start
                    data += chunk
            except aiohttp.ClientError as exc:
                error = type(exc).__name__
            return r.status, head, first if first is not None else -1.0, data, error


def test_die_before_first_token_sends_the_status_line_then_resets(sim):
    queue(sim, {"kind": "die_before_first_token"})
    status, _, first, data, error = run(head_then_body(sim, STREAM))
    assert status == 200 and data == b"" and error is not None  # a 200, then nothing but a reset
    assert run(head_then_body(sim, STREAM))[3].endswith(b"data: [DONE]\n\n")  # one-shot
    _, state = run(call("GET", sim + "/sim/state"))
    assert state["running"] == 0 and state["kv_blocks_used"] == 0


def test_stall_before_first_token_sends_the_status_line_at_once(sim):
    queue(sim, {"kind": "stall_before_first_token", "seconds": 0.6})
    status, head, first, data, error = run(head_then_body(sim, STREAM))
    assert status == 200 and error is None and data.endswith(b"data: [DONE]\n\n")
    assert head < 0.4 and first >= 0.6  # the status line, then silence until the first token


def test_die_mid_stream_resets_after_some_chunks(sim):
    queue(sim, {"kind": "die_mid_stream", "after_chunks": 2})
    t = run(send(sim, STREAM))
    assert t.status == 200 and not t.done and len(t.chunk_times) == 2 and t.error
