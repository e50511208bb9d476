"""What a client sends cannot grow the proxy's traces without bound, nor switch them off.

A hostile client hammering 401s with a 7 KB `tracestate` against a real proxy process: spans carry
at most 512 characters of it (W3C's cut: long members first, then from the right), refusals are
traced within `--trace-rejected-rate` and counted in full in `/metrics`, and the trace file and its
rotated copies each stay within `--trace-file-max-bytes`. A client's `sampled=00` does not turn the
proxy's spans off unless the operator chose a parent-based sampler.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from procs import start_proxy, start_sim

KEY = "secret"
BODY = {"model": "sim-model", "prompt": "one two three", "max_tokens": 2}
SHORT = ["a=1", "b=2", "c=3"]
# 31 valid members, ~7.2 KB: within what the W3C parser accepts (32 members, 8192 characters)
HOSTILE = ",".join(SHORT + [f"k{i}={'v' * 250}" for i in range(28)])
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def sim():
    proc, url = start_sim("single", "--time-scale", "0.1")
    yield url
    proc.stop()


def traceparent(sampled: bool = True) -> tuple[str, str]:
    trace_id = f"{random.getrandbits(128):032x}"
    return trace_id, f"00-{trace_id}-{random.getrandbits(64):016x}-{'01' if sampled else '00'}"


def spans_in(*files: Path) -> list[dict]:
    out = []
    for f in files:
        if f.exists():
            for line in f.read_text().splitlines():
                for rs in json.loads(line)["resourceSpans"]:
                    for ss in rs["scopeSpans"]:
                        out += ss["spans"]
    return out


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_for(condition, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            return result
        time.sleep(0.1)
    return result


@pytest.fixture(scope="module")
def guarded(sim, tmp_path_factory):
    """A proxy behind an API key, tracing at most 5 refusals a second."""
    trace_file = tmp_path_factory.mktemp("bounds") / "spans.jsonl"
    proxy, url = start_proxy("--decode", sim, "--api-key", KEY, "--trace-file", str(trace_file),
                             "--trace-rejected-rate", "5", "--health-check-interval", "0",
                             env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    yield url, trace_file
    proxy.stop()


def test_refusals_are_traced_within_the_rate_and_all_counted(guarded):
    url, trace_file = guarded
    refused: set[str] = set()
    with httpx.Client(timeout=10) as client:
        started = time.monotonic()
        while time.monotonic() - started < 3.0 and len(refused) < 300:
            trace_id, parent = traceparent()
            r = client.post(url + "/v1/completions", json=BODY, headers={"traceparent": parent})
            assert r.status_code == 401
            refused.add(trace_id)
        elapsed = time.monotonic() - started
        ok_id, parent = traceparent()
        assert client.post(url + "/v1/completions", json=BODY, headers={
            "traceparent": parent, "Authorization": f"Bearer {KEY}"}).status_code == 200
    assert len(refused) >= 50, f"only {len(refused)} refusals sent in the phase"
    # spans are exported in order: once the served request's are in, every traced refusal's are too
    assert wait_for(lambda: any(s["traceId"] == ok_id for s in spans_in(trace_file)))
    traced = {s["traceId"] for s in spans_in(trace_file) if s["traceId"] in refused}
    untraced = metric(url, "pdproxy_untraced_refusals_total")
    print(f"\n{len(refused)} refusals in {elapsed:.1f}s: {len(traced)} traced, {untraced:.0f} counted untraced")
    assert metric(url, "pdproxy_requests_total", code="401") == len(refused)  # counting stays complete
    assert len(traced) + untraced == len(refused)
    assert 1 <= len(traced) <= 5 * elapsed + 5  # the rate, plus one burst


def test_client_tracestate_is_cut_to_the_w3c_limits_on_spans_and_legs(guarded, sim):
    url, trace_file = guarded
    auth = {"Authorization": f"Bearer {KEY}"}
    many = [f"m{i}={'x' * 36}" for i in range(20)]  # 20 short members, 800 characters: cut from the right
    too_many = ",".join(f"t{i}=1" for i in range(33))  # over W3C's 32 members: discarded whole
    cases = {"hostile": (HOSTILE, ",".join(SHORT)), "many": (",".join(many), ",".join(many[:12])),
             "too_many": (too_many, None)}
    httpx.delete(sim + "/sim/requests")
    sent = {}
    for name, (state, expected) in cases.items():
        trace_id, parent = traceparent()
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10,
                       headers={**auth, "traceparent": parent, "tracestate": state})
        assert r.status_code == 200, r.text
        sent[trace_id] = expected
    legs = {e["headers"]["traceparent"].split("-")[1]: e["headers"].get("tracestate")
            for e in httpx.get(sim + "/sim/requests").json()["requests"] if "traceparent" in e["headers"]}
    for trace_id, expected in sent.items():
        assert len(expected or "") <= 512
        assert legs[trace_id] == expected  # the instance gets the cut state, leftmost (newest) members kept
        spans = wait_for(lambda: [s for s in spans_in(trace_file) if s["traceId"] == trace_id])
        assert spans and {s.get("traceState") for s in spans} == {expected}
    assert metric(url, "pdproxy_tracestate_cut_total", reason="too_long") >= 2
    assert metric(url, "pdproxy_tracestate_cut_total", reason="invalid") >= 1


def test_a_client_sampled_00_flag_does_not_turn_the_proxys_spans_off(guarded, sim):
    url, trace_file = guarded
    httpx.delete(sim + "/sim/requests")
    trace_id, parent = traceparent(sampled=False)
    r = httpx.post(url + "/v1/completions", json=BODY, timeout=10,
                   headers={"Authorization": f"Bearer {KEY}", "traceparent": parent})
    assert r.status_code == 200
    names = wait_for(lambda: {s["name"] for s in spans_in(trace_file) if s["traceId"] == trace_id})
    assert {"pd.queue", "pd.prefill"} <= names  # recorded, in the client's trace
    (leg,) = [e["headers"]["traceparent"] for e in httpx.get(sim + "/sim/requests").json()["requests"]]
    assert leg.startswith(f"00-{trace_id}-") and leg.endswith("-01")  # and the instance is asked to trace too


def test_an_operator_chosen_parent_based_sampler_obeys_the_clients_flag(sim, tmp_path):
    trace_file = tmp_path / "spans.jsonl"
    proxy, url = start_proxy("--decode", sim, "--trace-file", str(trace_file), "--health-check-interval", "0",
                             env={"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_TRACES_SAMPLER": "parentbased_always_on"})
    try:
        unsampled, parent = traceparent(sampled=False)
        assert httpx.post(url + "/v1/completions", json=BODY, headers={"traceparent": parent},
                          timeout=10).status_code == 200
        marker, parent = traceparent(sampled=True)
        assert httpx.post(url + "/v1/completions", json=BODY, headers={"traceparent": parent},
                          timeout=10).status_code == 200
        # spans are exported in order: once the later request's are in, the earlier one's would be too
        assert wait_for(lambda: any(s["traceId"] == marker for s in spans_in(trace_file)))
        assert not [s for s in spans_in(trace_file) if s["traceId"] == unsampled]
        assert httpx.get(url + "/status").json()["tracing"]["sampler"] == "parentbased_always_on"
    finally:
        proxy.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_hostile_401s_cannot_grow_the_trace_file_past_its_bound(sim, tmp_path, workers):
    trace_file = tmp_path / "spans.jsonl"
    backup = trace_file.with_name("spans.jsonl.1")
    proxy, url = start_proxy("--decode", sim, "--api-key", KEY, "--trace-file", str(trace_file),
                             "--trace-file-max-bytes", str(MIB), "--trace-file-backups", "1",
                             "--trace-rejected-rate", "1000000",  # every refusal traced: the file bound alone holds
                             "--workers", str(workers), "--health-check-interval", "0",
                             env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    sent, backups_seen = 0, set()
    try:
        deadline = time.monotonic() + 60
        # until the first backup has itself been replaced: over 2 MiB written, the oldest MiB deleted
        while len(backups_seen) < 2 and time.monotonic() < deadline:
            with httpx.Client(timeout=10) as client:  # a new connection each round: the workers share them
                for _ in range(10):
                    r = client.post(url + "/v1/completions", json=BODY,
                                    headers={"traceparent": traceparent()[1], "tracestate": HOSTILE})
                    assert r.status_code == 401
            sent += 10
            if backup.exists():
                backups_seen.add(os.stat(backup).st_ino)
        assert len(backups_seen) >= 2, f"{sent} refusals did not rotate the file twice within the phase"
        assert metric(url, "pdproxy_requests_total", code="401") == sent
        files = sorted(p.name for p in tmp_path.iterdir())
        assert files == ["spans.jsonl", "spans.jsonl.1"]  # no older copy kept, nothing else written
        for f in (trace_file, backup):
            assert f.stat().st_size <= MIB
        spans = spans_in(trace_file, backup)  # whole lines, none interleaved: a rotation never cuts one
        assert spans and all(len(s.get("traceState", "")) <= 512 for s in spans)
        assert {s.get("traceState") for s in spans} == {",".join(SHORT)}
        writers = {a["value"]["stringValue"] for f in (trace_file, backup) for line in f.read_text().splitlines()
                   for rs in json.loads(line)["resourceSpans"] for a in rs["resource"]["attributes"]
                   if a["key"] == "service.instance.id"}
        assert len(writers) == workers  # every worker wrote into the one bounded file
        print(f"\n{sent} refusals; files {[f.stat().st_size for f in (trace_file, backup)]} bytes, bound {MIB}")
    finally:
        proxy.stop()


def test_tokenizer_refusals_are_traced_within_the_same_rate(guarded):
    """/tokenize and /detokenize cost a client as little to have refused as a completion: a flood of
    them is traced within --trace-rejected-rate too, so it cannot push real spans out of the export
    queue; the call that is served is traced."""
    url, trace_file = guarded
    refused: set[str] = set()
    untraced_before = metric(url, "pdproxy_untraced_refusals_total")
    with httpx.Client(timeout=10) as client:
        started = time.monotonic()
        while time.monotonic() - started < 2 and len(refused) < 300:
            trace_id, parent = traceparent()
            path = ("/tokenize", "/detokenize")[len(refused) % 2]
            r = client.post(url + path, json={"prompt": "one two"}, headers={"traceparent": parent})
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            refused.add(trace_id)
        elapsed = time.monotonic() - started
        ok_id, parent = traceparent()
        assert client.post(url + "/tokenize", json={"model": "sim-model", "prompt": "one two"}, headers={
            "traceparent": parent, "Authorization": f"Bearer {KEY}"}).status_code == 200
    assert len(refused) >= 50, f"only {len(refused)} refusals sent in the phase"
    assert wait_for(lambda: any(s["traceId"] == ok_id for s in spans_in(trace_file)))
    traced = {s["traceId"] for s in spans_in(trace_file) if s["traceId"] in refused}
    untraced = metric(url, "pdproxy_untraced_refusals_total") - untraced_before
    print(f"\n{len(refused)} tokenizer refusals in {elapsed:.1f}s: {len(traced)} traced, {untraced:.0f} untraced")
    assert len(traced) + untraced == len(refused)
    assert 1 <= len(traced) <= 5 * elapsed + 5  # the rate, plus one burst
