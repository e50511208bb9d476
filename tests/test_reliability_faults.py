"""Faults one by one and mixed: each gives the client a precise error, an ERROR trace naming the
stage, and one counter increment; retries happen only where the client cannot see them.

Backends are real processes: the scripted backend (exact faults; one process serves two instances
sharing one script, so "the first attempt fails, wherever it lands" is exact), llmock as a faulty
decode, and dead ports for refused connections.
"""

import concurrent.futures
import json
import random
import time
import uuid

import httpx
import pytest

from ledgers import Counters, ScriptedGroup, is_error, sse_events, trace_of
from otlp import attrs
from procs import HOST, Proc, free_port, start_proxy
from waits import scaled, wait_until

BODY = {"model": "m", "prompt": "one two three", "max_tokens": 8, "stream": True}
KV_FAILURE = {"status": 500, "body": {"error": {"message": "KV load failed: remote blocks expired",
                                                "type": "InternalServerError", "code": 500}}}
FAST = ("--retry-backoff", "0.01", "--health-check-interval", "0", "--eject-after-failures", "0",
        "--read-timeout", "1")
ENV = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
# every leg on a new connection: a drop or reset before any answer byte then says the instance got the
# request. On a reused connection it would be the idle-close race, resent by the upstream client
# itself (tests/test_upstream.py, tests/test_instance_failures.py)
FRESH = ("--upstream-keep-alive", "0")


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """Two prefill and two decode instances (one scripted process per role) behind one proxy."""
    trace_file = tmp_path_factory.mktemp("faults") / "spans.jsonl"
    p, d = ScriptedGroup("prefill", 2), ScriptedGroup("decode", 2)
    proxy, url = start_proxy("--prefill", *p.urls, "--decode", *d.urls, "--prefill-retries", "1",
                             "--decode-retries", "1", "--trace-file", str(trace_file), *FAST, *FRESH, env=ENV)
    try:
        yield {"p": p, "d": d, "url": url, "file": trace_file, "proxy": proxy}
    finally:
        proxy.stop()
        p.stop()
        d.stop()


def post(url, body=BODY, timeout=15, **headers):
    rid = headers.pop("rid", None) or f"t-{uuid.uuid4().hex[:12]}"
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout, headers={"X-Request-Id": rid, **headers})
    assert r.headers["x-request-id"] == rid
    return r, rid


def script(rig, prefill=(), decode=()):
    rig["p"].script(*prefill)
    rig["d"].script(*decode)


def assert_accounted(rig, counters, rid, *, code, stage, error_type):
    """One counter increment, and an ERROR trace whose root and failing stage span name the stage."""
    assert counters.requests(code, stage) == 1
    assert counters.errors(stage, error_type) == 1
    spans = trace_of(rig["file"], rid)
    root = attrs(spans["root"])
    assert is_error(spans["root"]) and root["pd.failed_stage"] == stage and root["error.type"] == error_type
    assert root["http.response.status_code"] == code
    assert is_error(spans[f"pd.{stage}"]) and attrs(spans[f"pd.{stage}"])["error.type"] == error_type
    return spans


def assert_ok(rig, counters, rid):
    assert counters.requests(200) == 1
    return trace_of(rig["file"], rid)


def error_of(r):
    return r.json()["error"]


# -- prefill leg -----------------------------------------------------------------------------


def test_prefill_5xx_is_retried_once_elsewhere_then_reported(rig):
    script(rig, prefill=[{"status": 500, "body": {"error": {"message": "engine died"}}}])
    c = Counters(rig["url"])
    r, rid = post(rig["url"])
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    ports = [e["port"] for e in rig["p"].journal()]
    assert len(ports) == 2 and ports[0] != ports[1]  # the retry went to the other instance
    assert attrs(assert_ok(rig, c, rid)["pd.prefill"])["pd.prefill.attempts"] == 2

    script(rig, prefill=[{"status": 500, "body": {"error": {"message": "engine died"}}}] * 2)
    c = Counters(rig["url"])
    r, rid = post(rig["url"])
    assert r.status_code == 502
    err = error_of(r)
    assert err["code"] == "upstream_5xx" and "prefill instance" in err["message"] and "engine died" in err["message"]
    assert err["type"] == "server_error"
    assert rig["d"].journal() == []  # the decode never ran
    spans = assert_accounted(rig, c, rid, code=502, stage="prefill", error_type="upstream_5xx")
    assert attrs(spans["pd.prefill"])["pd.prefill.attempts"] == 2


def test_prefill_timeout_is_a_504(rig):
    script(rig, prefill=[{"delay": 1.6}, {"delay": 1.6}])  # --read-timeout 1
    c = Counters(rig["url"])
    started = time.monotonic()
    r, rid = post(rig["url"])
    assert r.status_code == 504 and error_of(r)["code"] == "timeout" and "prefill" in error_of(r)["message"]
    assert time.monotonic() - started < scaled(3.5)
    assert_accounted(rig, c, rid, code=504, stage="prefill", error_type="timeout")
    wait_until(lambda: len(j := rig["p"].journal()) == 2 and all(e["aborted"] and not e["completed"] for e in j),
               "both prefill attempts to be hung up on by the proxy")


def test_prefill_malformed_json_and_broken_kv_params(rig):
    script(rig, prefill=[{"body": "{not json"}])
    c = Counters(rig["url"])
    r, rid = post(rig["url"])
    assert r.status_code == 200  # another prefill answered properly
    assert_ok(rig, c, rid)

    broken = {"id": "cmpl-x", "choices": [{"index": 0, "text": "a"}], "kv_transfer_params": "garbage"}
    script(rig, prefill=[{"body": "{not json"}, {"body": broken}])
    c = Counters(rig["url"])
    r, rid = post(rig["url"])
    assert r.status_code == 502 and error_of(r)["code"] == "invalid_kv_params"
    assert rig["d"].journal() == []
    assert_accounted(rig, c, rid, code=502, stage="prefill", error_type="invalid_kv_params")


def test_prefill_without_kv_params_lets_the_decode_recompute(rig):
    plain = {"id": "cmpl-x", "choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}
    script(rig, prefill=[{"body": plain}])
    c = Counters(rig["url"])
    r, rid = post(rig["url"])
    assert r.status_code == 200
    assert "kv_transfer_params" not in rig["d"].journal()[0]["body"]
    root = attrs(assert_ok(rig, c, rid)["root"])
    assert root["pd.kv_transfer_params"] == "missing"  # visible, not an error (LMCache/Mooncake never send any)


def test_retry_after_is_waited_out_when_short_and_relayed_when_long(rig):
    p = ScriptedGroup("prefill", 1)
    proxy, url = start_proxy("--prefill", p.url, "--decode", rig["d"].url, "--prefill-retries", "2",
                             "--max-retry-wait", "2", *FAST)
    try:
        busy = {"status": 429, "headers": {"Retry-After": "0.6"}, "body": {"error": {"message": "busy"}}}
        p.script(busy)
        started = time.monotonic()
        r, _ = post(url)
        took = time.monotonic() - started
        assert r.status_code == 200 and 0.6 <= took < 2.5  # the only instance asked for 0.6 s: honoured
        first, second = p.journal()
        assert second["body"] == first["body"]

        p.script({**busy, "headers": {"Retry-After": "30"}})
        c = Counters(url)
        started = time.monotonic()
        r, _ = post(url)
        assert time.monotonic() - started < 1.5  # not waited: relayed at once
        assert r.status_code == 429 and r.headers["retry-after"] == "30" and error_of(r)["message"] == "busy"
        assert len(p.journal()) == 1
        assert c.requests(429, "prefill") == 1 and c.errors("prefill", "upstream_429") == 1
    finally:
        proxy.stop()
        p.stop()


def test_refused_connections_are_retried_with_the_same_kv_params(rig):
    """A refused connection never reached the instance: its KV coordinates are still good to use."""
    dead = lambda: f"http://{HOST}:{free_port()}"  # noqa: E731
    trace_file = rig["file"].with_name("refused.jsonl")
    rig["p"].script()
    rig["d"].script()
    proxy, url = start_proxy("--prefill", dead(), rig["p"].url, "--decode", dead(), rig["d"].url,
                             "--prefill-retries", "1", "--decode-retries", "1", "--trace-file", str(trace_file),
                             *FAST, env=ENV)
    try:
        r, rid = post(url)  # round-robin starts at the dead ones
        assert r.status_code == 200
        assert rig["d"].journal()[0]["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-p"
        spans = trace_of(trace_file, rid)
        assert attrs(spans["pd.prefill"])["pd.prefill.attempts"] == 2
        assert attrs(spans["pd.decode"])["pd.decode.attempts"] == 2
        assert attrs(spans["root"])["pd.kv_transfer_params"] == "received"
    finally:
        proxy.stop()
    for prefill, decode, stage in ((dead(), rig["d"].url, "prefill"), (rig["p"].url, dead(), "kv_transfer")):
        proxy, url = start_proxy("--prefill", prefill, "--decode", decode, "--trace-file", str(trace_file),
                                 *FAST, env=ENV)
        try:
            c = Counters(url)
            r, rid = post(url)
            assert r.status_code == 503 and error_of(r)["code"] == "connect_error"
            assert ("prefill" if stage == "prefill" else "decode") in error_of(r)["message"]
            assert_accounted({"file": trace_file}, c, rid, code=503, stage=stage, error_type="connect_error")
        finally:
            proxy.stop()


# -- decode leg, before the first byte ---------------------------------------------------------


def test_kv_load_failure_is_retried_on_another_decode_with_fresh_kv_params(rig):
    """A decode that got the hand-off may have pulled its KV (vLLM then frees the blocks): the retry
    never reuses those parameters, the prefill runs again and the new ones go to the other decode."""
    script(rig, decode=[KV_FAILURE])
    c = Counters(rig["url"])
    r, rid = post(rig["url"])
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    first, second = rig["d"].journal()
    assert first["port"] != second["port"]
    prefills = rig["p"].journal()
    assert len(prefills) == 2 and prefills[0]["port"] != prefills[1]["port"]  # on the other prefill instance
    assert "kv_transfer_params" in first["body"] and "kv_transfer_params" in second["body"]
    spans = assert_ok(rig, c, rid)
    root = attrs(spans["root"])
    assert root["pd.kv_transfer_params"] == "received" and root["pd.prefill.reruns"] == 1
    assert root["pd.migrations"] == 1 and root["pd.handoffs.abandoned"] == 1
    assert attrs(spans["pd.decode"])["pd.decode.attempts"] == 2
    assert c.delta("pdproxy_migrations_total", stage="before_first_token", reason="kv_load_failed") == 1
    assert c.delta("pdproxy_abandoned_handoffs_total", server_address=f"{HOST}:{prefills[0]['port']}") == 1

    script(rig, decode=[KV_FAILURE, KV_FAILURE])
    c = Counters(rig["url"])
    r, rid = post(rig["url"])
    assert r.status_code == 502
    assert error_of(r)["code"] == "kv_load_failed" and "KV load failed" in error_of(r)["message"]
    # the decode request belongs to the kv_transfer stage: no token came back
    assert_accounted(rig, c, rid, code=502, stage="kv_transfer", error_type="kv_load_failed")


def test_decode_busy_timeout_and_dropped_connection_before_headers(rig):
    script(rig, decode=[{"status": 503, "headers": {"Retry-After": "0.2"}, "body": {"error": {"message": "full"}}}])
    r, _ = post(rig["url"])
    assert r.status_code == 200 and len(rig["d"].journal()) == 2
    assert "kv_transfer_params" in rig["d"].journal()[1]["body"]  # busy, not broken: its KV was never touched

    assert len(rig["p"].journal()) == 1  # the same hand-off, no second prefill

    script(rig, decode=[{"drop": True}])
    r, _ = post(rig["url"])
    assert r.status_code == 200 and len(rig["p"].journal()) == 2  # dropped after receiving it: prefill again

    script(rig, decode=[{"delay": 1.6}, {"delay": 1.6}])
    c = Counters(rig["url"])
    r, rid = post(rig["url"])
    assert r.status_code == 504 and "decode" in error_of(r)["message"]
    assert_accounted(rig, c, rid, code=504, stage="kv_transfer", error_type="timeout")


def test_decode_failing_before_its_first_token_is_retried_then_keeps_an_http_status(rig):
    """The client's status line waits for the first token: a decode that fails before it is retried on
    the other decode, invisibly; when the retry fails too, the client gets a real HTTP error."""
    role = 'data: {"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": null}]}\n\n'
    for step, error_type in (({"abort_after": 0}, "stream_broken"), ({"chunks": ["data: {\"id\": \"cmpl-"]}, "stream_truncated"),
                             ({"chunks": [role, role, role], "abort_after": 2}, "stream_broken"),
                             ({"chunks": [role, 'data: {"error": {"message": "boom"}}\n\n', "data: [DONE]\n\n"]},
                              "stream_error")):
        script(rig, decode=[step])
        r, rid = post(rig["url"])
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text
        assert len(rig["d"].journal()) == 2
        script(rig, decode=[step, step])
        c = Counters(rig["url"])
        r, rid = post(rig["url"])
        assert r.status_code == 502 and error_of(r)["code"] == error_type, r.text
        assert_accounted(rig, c, rid, code=502, stage="kv_transfer", error_type=error_type)

    script(rig, decode=[{"body": "{broken"}, {"body": "{broken"}])
    c = Counters(rig["url"])
    r, rid = post(rig["url"], {**BODY, "stream": False})
    assert r.status_code == 502 and error_of(r)["code"] == "invalid_response"
    assert_accounted(rig, c, rid, code=502, stage="kv_transfer", error_type="invalid_response")


# -- decode leg, mid-stream ---------------------------------------------------------------------


def chunk(text):
    return "data: " + json.dumps({"id": "cmpl-s", "choices": [{"index": 0, "text": text, "finish_reason": None}]}) + "\n\n"


@pytest.mark.parametrize("step, error_type", [
    ({"chunks": [chunk("a"), chunk("b"), chunk("c"), "data: [DONE]\n\n"], "stall_after": 2, "stall": 3}, "timeout"),
    ({"chunks": [chunk("a"), chunk("b"), chunk("c"), "data: [DONE]\n\n"], "abort_after": 2}, "stream_broken"),
    ({"chunks": [chunk("a"), chunk("b"), 'data: {"id": "cmpl-broken", "choices": [{"text": \n\n', chunk("c"),
                 "data: [DONE]\n\n"]}, "malformed_stream"),
], ids=["stall", "disconnect", "malformed"])
def test_mid_stream_faults_end_with_an_error_event_and_done(rig, step, error_type):
    script(rig, decode=[step])
    c = Counters(rig["url"])
    r, rid = post(rig["url"])
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[:2] == [chunk("a").strip(), chunk("b").strip()]  # what came before the fault was delivered
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == error_type and "decode" in error["message"]
    assert len(events) == 4  # and nothing of the broken event, nothing after it
    assert len(rig["d"].journal()) == 1  # never retried: the client had seen tokens
    assert_accounted(rig, c, rid, code=200, stage="decode", error_type=error_type)


# -- mixed ---------------------------------------------------------------------------------------


def test_mixed_faults_every_request_accounted_once(rig):
    """A burst with a random mix of faults on both legs: every request ends once, in all three ledgers."""
    rng = random.Random(7)
    prefill_faults = [{}, {}, {}, {"status": 500, "body": {"error": {"message": "x"}}}, {"body": "{bad"},
                      {"status": 429, "headers": {"Retry-After": "0.05"}, "body": {"error": {"message": "busy"}}}]
    decode_faults = [{}, {}, {}, KV_FAILURE, {"drop": True}, {"abort_after": 2}, {"stall_after": 1, "stall": 2},
                     {"status": 400, "body": {"error": {"message": "too long"}}}]
    n = 48
    script(rig, prefill=[rng.choice(prefill_faults) for _ in range(n * 2)],
           decode=[rng.choice(decode_faults) for _ in range(n * 2)])
    c = Counters(rig["url"])
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: post(rig["url"], rid=f"mix-{i}-{uuid.uuid4().hex[:6]}"), range(n)))
    outcomes = {}
    for r, rid in results:
        if r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text:
            outcomes[rid] = (200, "none")
        elif r.status_code == 200:  # failed mid-stream: an error event, then [DONE]
            assert r.text.endswith("data: [DONE]\n\n") and '"error"' in sse_events(r.text)[-2]
            outcomes[rid] = (200, "decode")
        else:
            assert "error" in r.json() and r.status_code in (400, 429, 502, 503, 504), r.text
            outcomes[rid] = (r.status_code, None)
    for rid, (code, stage) in outcomes.items():
        root = attrs(trace_of(rig["file"], rid)["root"])
        assert root["http.response.status_code"] == code
        assert root.get("pd.failed_stage", "none") == (stage or root["pd.failed_stage"])
        outcomes[rid] = (code, root.get("pd.failed_stage", "none"))
    for code, stage in set(outcomes.values()):
        expected = sum(1 for o in outcomes.values() if o == (code, stage))
        assert c.requests(code, stage) == expected, (code, stage)
    assert c.delta("pdproxy_requests_total") == n
    assert len({o for o in outcomes.values()}) >= 3  # the mix really mixed


# -- ejection and re-admission ---------------------------------------------------------------------


def test_failing_instance_is_ejected_for_a_while_and_comes_back(rig):
    bad = ScriptedGroup("decode", 1)
    good = ScriptedGroup("decode", 1)
    bad.script(*[{"status": 500, "body": {"error": {"message": "broken connector"}}}] * 100)
    good.script()
    rig["p"].script()
    proxy, url = start_proxy("--prefill", rig["p"].url, "--decode", bad.url, good.url, "--decode-retries", "1",
                             "--eject-after-failures", "2", "--eject-seconds", "3", "--retry-backoff", "0.01",
                             "--health-check-interval", "0.2")
    try:
        def healthy():
            return {i["url"]: i["healthy"] for i in httpx.get(url + "/status").json()["instances"]["decode"]}

        for _ in range(6):
            assert post(url)[0].status_code == 200  # retries hide the broken one from clients
        assert healthy() == {bad.url: False, good.url: True}  # /health passes, yet it is out: failures decide
        assert 'pdproxy_instance_healthy{role="decode",server_address="%s"} 0.0' % bad.url[7:] in httpx.get(url + "/metrics").text
        seen = len(bad.journal())
        assert seen == 2
        for _ in range(4):
            post(url)
        assert len(bad.journal()) == seen  # no traffic while ejected
        # 3 s: long enough that it cannot run out during the checks above on a slow machine
        wait_until(lambda: healthy()[bad.url] is True, "the 3 s ejection to run out")
        for _ in range(4):
            assert post(url)[0].status_code == 200
        assert healthy()[bad.url] is False  # failing again: out again, now for 6 s
        bad.script()  # repaired
        wait_until(lambda: healthy()[bad.url] is True, "the 6 s ejection to run out", timeout=15)
        before = len(bad.journal())
        for _ in range(4):
            assert post(url)[0].status_code == 200
        assert len(bad.journal()) - before == 2 and healthy()[bad.url] is True
    finally:
        proxy.stop()
        bad.stop()
        good.stop()


# -- llmock as a faulty decode (independent judge of the retries) -----------------------------------


@pytest.fixture(scope="module")
def llmock():
    port = free_port()
    proc = Proc(["llmock", "serve", "--host", HOST, "--port", str(port), "--log-level", "warning"], name="llmock")
    url = f"http://{HOST}:{port}"
    try:
        proc.wait_http(url + "/health", timeout=30)
        yield url
    finally:
        proc.stop()


def test_llmock_judges_the_proxys_retries(llmock):
    proxy, url = start_proxy("--decode", llmock, "--decode-retries", "2", "--retry-backoff", "0.2",
                             "--max-retry-wait", "2", "--health-check-interval", "0", "--eject-after-failures", "0")
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    def behave(*behaviors):
        httpx.post(llmock + "/_llmock/reset")
        r = httpx.post(llmock + "/_llmock/scenario", json={"behaviors": list(behaviors)})
        assert r.status_code < 300, r.text

    def ask():
        return httpx.post(url + "/v1/chat/completions", json=chat, timeout=20)

    try:
        behave({"type": "fail", "status": 429, "retry_after": 1})
        started = time.monotonic()
        r = ask()
        assert r.status_code == 200 and time.monotonic() - started >= 1.0 and r.text.endswith("data: [DONE]\n\n")
        verdict = httpx.get(llmock + "/_llmock/verdict").json()
        assert not [f for f in verdict["findings"] if f["severity"] == "error"], verdict

        behave({"type": "fail", "status": 500, "times": 5})
        r = ask()
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_5xx"
        verdict = httpx.get(llmock + "/_llmock/verdict").json()
        assert verdict["calls"] == 1 and verdict["attempts"] == 3  # 1 + --decode-retries 2: bounded
        assert not [f for f in verdict["findings"] if f["code"] in ("retry_storm", "retry_after_ignored")]

        behave({"type": "fail", "status": 400, "message": "bad"})
        assert ask().status_code == 400
        assert httpx.get(llmock + "/_llmock/requests").json()["count"] == 1  # a 4xx is never retried

        for kind in ("disconnect", "malformed"):
            behave({"type": "stream_fault", "kind": kind, "after_chunks": 2})
            r = ask()
            events = sse_events(r.text)
            assert r.status_code == 200 and events[-1] == "data: [DONE]", (kind, r.text)
            calls = httpx.get(llmock + "/_llmock/requests").json()["count"]
            if '"error"' in events[-2]:  # the fault came after the first token reached the client
                assert calls == 1, (kind, r.text)
            else:  # it came in the same read as the first token: nothing was sent yet, so it was retried
                assert kind == "malformed" and calls == 2, (kind, r.text)
    finally:
        proxy.stop()


# -- the simulator: a decode that really pulls the KV from the prefill ---------------------------------


def test_sim_kv_load_failure_prefills_again_and_other_faults_end_to_end(tmp_path):
    """On `pdproxy sim` the decode pulls the prompt's KV from the prefill: a failed pull is retried on
    the other decode with the parameters of a new prefill, never the used ones."""
    from procs import start_sim

    procs, trace_file = [], tmp_path / "spans.jsonl"
    try:
        (pp, purl), (d1, d1url), (d2, d2url) = (start_sim("prefill", "--preset", "instant"),
                                                start_sim("decode", "--preset", "instant"),
                                                start_sim("decode", "--preset", "instant"))
        procs += [pp, d1, d2]
        proxy, url = start_proxy("--prefill", purl, "--decode", d1url, d2url, "--trace-file", str(trace_file),
                                 "--prefill-retries", "1", "--decode-retries", "2", *FAST, *FRESH, env=ENV)
        procs.append(proxy)
        body = {"model": "sim-model", "prompt": "one two three four five six", "max_tokens": 6, "stream": True}

        def fault(instance, *faults):
            httpx.delete(instance + "/sim/requests")
            assert httpx.post(instance + "/sim/faults", json={"faults": list(faults)}).status_code < 300

        def sent(instance):
            return [r["body"] for r in httpx.get(instance + "/sim/requests").json()["requests"]]

        fault(d1url, {"kind": "kv_load_failure"})
        fault(d2url, {"kind": "kv_load_failure"})
        fault(purl)
        r, rid = post(url, body)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
        decode_bodies = sent(d1url) + sent(d2url)
        assert len(decode_bodies) == 3 and all("kv_transfer_params" in b for b in decode_bodies)
        # each decode got its own prefill's coordinates: never ones another decode may have pulled
        assert len({b["kv_transfer_params"]["remote_request_id"] for b in decode_bodies}) == 3
        assert attrs(trace_of(trace_file, rid)["root"])["pd.prefill.reruns"] == 2

        fault(purl, {"kind": "refuse"})  # a TCP reset: retried (here on the same, only, prefill)
        r, rid = post(url, body)
        assert r.status_code == 200 and attrs(trace_of(trace_file, rid)["pd.prefill"])["pd.prefill.attempts"] == 2

        fault(purl, {"kind": "no_kv_params"})
        r, rid = post(url, body)
        assert r.status_code == 200 and attrs(trace_of(trace_file, rid)["root"])["pd.kv_transfer_params"] == "missing"

        # the first token goes out alone (a pause after it), so the stream is the client's before the bad
        # event: had they come in one read, nothing would be committed yet and the decode would be retried
        for decode in (d1url, d2url):
            fault(decode, {"kind": "stall", "after_chunks": 1, "seconds": 0.3}, {"kind": "malformed_chunk", "after_chunks": 3})
        r, rid = post(url, body)
        events = sse_events(r.text)
        assert r.status_code == 200 and events[-1] == "data: [DONE]" and len(events) == 5  # 3 good chunks, the error, [DONE]
        assert json.loads(events[-2][6:])["error"]["code"] == "malformed_stream"
        assert attrs(trace_of(trace_file, rid)["root"])["pd.failed_stage"] == "decode"
        for instance in (d1url, d2url):
            httpx.delete(instance + "/sim/faults")
    finally:
        for proc in procs:
            proc.stop()
