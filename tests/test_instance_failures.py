"""Which failures count against an instance, and how much of a pool they may take out.

Real processes throughout: the proxy, simulated vLLM instances (a non-streamed answer as long as a
real one), scripted instances (exact faults), and a listener that never completes a handshake.
A hostile client must not be able to eject a whole pool nor take `/health` to 503.
"""

import concurrent.futures
import uuid

import httpx
import pytest

from ledgers import ScriptedGroup, trace_of
from otlp import attrs
from procs import HOST, start_proxy, start_sim, unaccepting_listener
from waits import wait_until

ENV = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
STRICT = ("--eject-after-failures", "1", "--eject-seconds", "60", "--retry-backoff", "0.01")
KV_FAILURE = {"status": 500, "body": {"error": {"message": "KV load failed: remote blocks expired"}}}
BROKEN = {"status": 500, "body": {"error": {"message": "engine broke"}}}


def post(url, body=None, timeout=30):
    rid = f"t-{uuid.uuid4().hex[:12]}"
    body = body or {"model": "m", "prompt": "one two three", "max_tokens": 4, "stream": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout, headers={"X-Request-Id": rid}), rid


def ejected(url, role="decode"):
    return {i["url"]: i["ejected"] for i in httpx.get(url + "/status").json()["instances"][role]}


def health(url):
    return httpx.get(url + "/health").status_code


def up(started, thing):
    started.append(thing)
    return thing


def sim_up(started, role):
    proc, url = start_sim(role)
    started.append(proc)
    return url


def proxy_up(started, *args, **kwargs):
    proxy, url = start_proxy(*args, **kwargs)
    started.append(proxy)
    return url


def test_a_connect_timeout_is_retried_with_the_prefills_kv_params(tmp_path, started):
    """A decode that never accepted the connection never saw the KV coordinates: the retry reuses them."""
    listener, fillers = unaccepting_listener()
    try:
        p, d = up(started, ScriptedGroup("prefill", 1)), up(started, ScriptedGroup("decode", 1))
        trace_file = tmp_path / "spans.jsonl"
        black_hole = f"http://{HOST}:{listener.getsockname()[1]}"
        url = proxy_up(started, "--prefill", p.url, "--decode", black_hole, d.url, "--connect-timeout", "0.3",
                       "--decode-retries", "1", "--health-check-interval", "0", "--retry-backoff", "0.01",
                       "--trace-file", str(trace_file), env=ENV)
        r, rid = post(url)  # round robin starts at the black hole
        assert r.status_code == 200
        (entry,) = d.journal()
        assert entry["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-p"
        spans = trace_of(trace_file, rid)
        assert attrs(spans["pd.decode"])["pd.decode.attempts"] == 2
        assert attrs(spans["root"])["pd.kv_transfer_params"] == "received"  # not "recomputed"
    finally:
        for s in (listener, *fillers):
            s.close()


def test_a_kept_alive_connection_closed_unanswered_is_resent_with_the_same_kv_params(tmp_path, started):
    """The decode reads the request on a reused connection and closes it without a byte (what the
    keep-alive race looks like): sent again on a fresh connection, KV params kept, nothing charged."""
    p, d = up(started, ScriptedGroup("prefill", 1)), up(started, ScriptedGroup("decode", 1))
    trace_file = tmp_path / "spans.jsonl"
    url = proxy_up(started, "--prefill", p.url, "--decode", d.url, "--upstream-keep-alive", "60", "--decode-retries",
                   "0", "--health-check-interval", "0", "--trace-file", str(trace_file), *STRICT, env=ENV)
    d.script({}, {"drop": True})  # the second request comes on the first one's connection
    assert post(url)[0].status_code == 200
    r, rid = post(url)
    assert r.status_code == 200  # with --decode-retries 0: not a 502
    first, dropped, resent = d.journal()
    assert dropped["peer"] == first["peer"] and resent["peer"] != first["peer"]  # reused, then a fresh one
    assert resent["body"]["kv_transfer_params"] == dropped["body"]["kv_transfer_params"] is not None
    spans = trace_of(trace_file, rid)
    assert attrs(spans["pd.decode"])["pd.decode.attempts"] == 1
    assert attrs(spans["root"])["pd.kv_transfer_params"] == "received"
    assert ejected(url) == {d.url: False}


def test_long_answers_a_client_asks_for_eject_nothing(started):
    """Non-streamed max_tokens 1000 (~5 s on the simulated H200) against --read-timeout 1: every
    attempt times out on every decode, which is the request's doing, not the instances'."""
    prefill, *decodes = (sim_up(started, role) for role in ("prefill", "decode", "decode"))
    url = proxy_up(started, "--prefill", prefill, "--decode", *decodes, "--read-timeout", "1",
                   "--health-check-interval", "0.2", *STRICT)
    hostile = {"model": "sim-model", "prompt": "tell me everything", "max_tokens": 1000}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: post(url, hostile)[0], range(4)))
    assert [a.status_code for a in answers] == [504] * 4
    assert ejected(url) == {u: False for u in decodes}
    assert health(url) == 200
    r, _ = post(url, {"model": "sim-model", "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200


def test_failures_on_every_instance_eject_at_most_half_the_pool(started):
    d = up(started, ScriptedGroup("decode", 2))
    d.script(*[BROKEN] * 40)
    url = proxy_up(started, "--decode", *d.urls, "--decode-retries", "1", "--health-check-interval", "0.2", *STRICT)
    for _ in range(4):
        assert post(url)[0].status_code == 502
    assert sorted(ejected(url).values()) == [False, True]  # one of two: 50 %
    assert health(url) == 200  # both still pass their health checks
    body = httpx.get(url + "/health").json()
    assert body["healthy_instances"] == {"decode": 2} and body["ejected_instances"] == {"decode": 1}


def test_a_lone_instance_is_never_ejected_and_health_follows_the_active_checks(started):
    d = up(started, ScriptedGroup("decode", 1))
    d.script(*[BROKEN] * 10)
    url = proxy_up(started, "--decode", d.url, "--decode-retries", "0", "--health-check-interval", "0.2",
                   "--max-ejection-percent", "100", *STRICT)
    for _ in range(3):
        assert post(url)[0].status_code == 502
    assert ejected(url) == {d.url: False} and health(url) == 200
    d.stop()  # now it fails its health check too: that, and only that, takes /health down
    wait_until(lambda: health(url) == 503, "/health to answer 503", timeout=15)


@pytest.mark.parametrize("mode", ["single", "pd"])
def test_a_kv_load_failure_counts_only_when_the_proxy_sent_the_kv_params(mode, started):
    """In single mode the proxy sends no KV params, so a KV load failure is not the instance's doing
    (the client's, if anyone's). In P/D every decode got a prefill's own params (the retry fresh ones
    from a second prefill, never the used ones: pdproxy/migration/), so both failures count; the
    ejection share keeps the second in."""
    legs = ("--prefill", up(started, ScriptedGroup("prefill", 1)).url) if mode == "pd" else ()
    d = up(started, ScriptedGroup("decode", 2))
    d.script(*[KV_FAILURE] * 10)
    url = proxy_up(started, *legs, "--decode", *d.urls, "--decode-retries", "1", "--health-check-interval", "0",
                   "--max-ejection-percent", "100", *STRICT)
    r, _ = post(url)
    assert r.status_code == 502 and r.json()["error"]["code"] == "kv_load_failed"
    first, second = d.journal()
    assert ("kv_transfer_params" in first["body"]) == ("kv_transfer_params" in second["body"]) == (mode == "pd")
    by_port = {u: u.endswith(f":{first['port']}") for u in d.urls}  # the instance that failed first
    assert ejected(url) == {u: mode == "pd" and got for u, got in by_port.items()}  # never both out at once
