"""Routing policies on real processes: simulated vLLM instances behind a real pdproxy.

Where each request went is read from the proxy's own trace file (the leg span's server.port and its
pd.route.* attributes) and from the instances' counters, never from timing.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter as Tally
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ledgers import Counters, counter, spans_in, trace_of
from otlp import attrs
from procs import start_proxy, start_scripted, start_sim, pdproxy
from waits import wait_until

ENV = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
QUIET = ("--health-check-interval", "0")


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def post(url: str, body: dict, headers: dict | None = None) -> str:
    rid = uuid.uuid4().hex
    r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid, **(headers or {})}, timeout=60)
    assert r.status_code == 200, r.text
    return rid


def leg(trace_file, rid: str, name: str) -> dict:
    return attrs(trace_of(trace_file, rid)[name])


def sims(procs, role: str, n: int, *extra: str) -> list[str]:
    urls = []
    for _ in range(n):
        proc, url = start_sim(role, *extra)
        procs.append(proc)
        urls.append(url)
    return urls


def test_cache_aware_sends_each_shared_prefix_to_one_prefill_instance(procs, tmp_path):
    # where the requests go is the point, not how long their KV takes: 60 KVs of ~2,800 tokens through one
    # decode's intake of two prefills (0.13 GB/s, the one-GPU preset's) would take ~170 s at the preset's pace
    fast = ("--time-scale", "0.1")
    prefill = sims(procs, "prefill", 2, *fast)
    decode = sims(procs, "decode", 1, *fast)
    trace_file = tmp_path / "spans.jsonl"
    proxy, url = start_proxy("--prefill", *prefill, "--decode", *decode, "--prefill-policy", "cache_aware",
                             "--trace-file", str(trace_file), *QUIET, env=ENV)
    procs.append(proxy)
    prefixes = [words(f"p{k}w", 500) for k in range(6)]  # ~2,800 tokens each
    bodies = [{"prompt": f"{prefixes[n % 6]} user {n} asks question {n}", "max_tokens": 2, "model": "sim-model"}
              for n in range(60)]
    counters = Counters(url)
    with ThreadPoolExecutor(6) as pool:  # six at a time: both instances are busy at once
        rids = list(pool.map(lambda body: post(url, body), bodies))

    ports: dict[int, Tally] = {k: Tally() for k in range(6)}
    for n, rid in enumerate(rids):
        span = leg(trace_file, rid, "pd.prefill")
        ports[n % 6][span["server.port"]] += 1
        assert span["pd.route.policy"] == "cache_aware"
        if span["pd.route.reason"] == "prefix_match":
            assert span["pd.route.matched_prefix"] > 500 * 4 and span["pd.route.matched_prefix.unit"] == "chars"
            assert len(span["pd.route.scores"]) == 2
    for k, tally in ports.items():
        assert tally.most_common(1)[0][1] >= 9, (k, tally)  # >= 90 % of a prefix's 10 requests on one instance
    per_instance = sum((t for t in ports.values()), Tally())
    assert len(per_instance) == 2 and min(per_instance.values()) >= 20, per_instance

    assert counters.delta("pdproxy_route_decisions_total", role="prefill", policy="cache_aware",
                          reason="prefix_match") >= 48
    assert counters.delta("pdproxy_route_decisions_total", role="decode", policy="round_robin") == 60
    # the instances' own counters agree: the shared prefixes were computed about once per prefix
    hits = sum(counter(httpx.get(u + "/metrics").text, "vllm:prefix_cache_hits_total") for u in prefill)
    queries = sum(counter(httpx.get(u + "/metrics").text, "vllm:prefix_cache_queries_total") for u in prefill)
    assert hits / queries > 0.75, (hits, queries)
    status = httpx.get(url + "/status").json()["instances"]["prefill"]
    assert all(i["policy"] == "cache_aware" and i["scores"]["indexed_prefixes"] > 0 for i in status)


def test_round_robin_spreads_the_same_prefixes(procs, tmp_path):
    """The baseline of the test above: the property does not come for free."""
    prefill = sims(procs, "prefill", 2)
    decode = sims(procs, "decode", 1)
    trace_file = tmp_path / "spans.jsonl"
    proxy, url = start_proxy("--prefill", *prefill, "--decode", *decode, "--trace-file", str(trace_file), *QUIET,
                             env=ENV)
    procs.append(proxy)
    prefix = words("rr", 600)
    rids = [post(url, {"prompt": f"{prefix} user {n}", "max_tokens": 2}) for n in range(10)]
    tally = Tally(leg(trace_file, rid, "pd.prefill")["server.port"] for rid in rids)
    assert sorted(tally.values()) == [5, 5]
    assert {leg(trace_file, rids[0], "pd.prefill")["pd.route.reason"]} == {"rotation"}


def test_load_aware_reads_the_engines_own_load(procs, tmp_path):
    """Requests sent to decode 0 behind the proxy's back: only its /metrics can tell."""
    d0, d1 = sims(procs, "single", 2)
    trace_file = tmp_path / "spans.jsonl"
    proxy, url = start_proxy("--decode", d0, d1, "--decode-policy", "load_aware", "--load-metrics-interval", "0.2",
                             "--trace-file", str(trace_file), *QUIET, env=ENV)
    procs.append(proxy)
    stop = threading.Event()

    def occupy() -> None:  # a long stream straight to decode 0, closed when the test is done
        with httpx.stream("POST", d0 + "/v1/completions", timeout=60,
                          json={"prompt": "busy elsewhere", "max_tokens": 4000, "stream": True}) as r:
            for _ in r.iter_bytes():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=occupy) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        def read_busy():
            scores = {i["url"]: i["scores"] for i in httpx.get(url + "/status").json()["instances"]["decode"]}
            return scores if scores[d0].get("running", 0) >= 6 and scores[d1].get("metrics") == "ok" else None

        scores = wait_until(read_busy, "the proxy's reading of decode 0's six running requests", timeout=20)
        assert scores[d0]["score"] > scores[d1]["score"]
        rids = [post(url, {"prompt": f"short one {n}", "max_tokens": 2}) for n in range(10)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    d1_port = int(d1.rsplit(":", 1)[1])
    for rid in rids:
        span = leg(trace_file, rid, "pd.prefill")  # single mode: the one leg is pd.prefill
        assert span["server.port"] == d1_port
        assert span["pd.route.policy"] == "load_aware" and span["pd.route.reason"] == "engine_load"
        assert len(span["pd.route.scores"]) == 2


def test_load_aware_falls_back_to_inflight_when_metrics_cannot_be_read(procs):
    (sim,) = sims(procs, "single", 1)
    scripted, scripted_url = start_scripted("decode")  # answers requests, has no /metrics
    procs.append(scripted)
    proxy, url = start_proxy("--decode", sim, scripted_url, "--decode-policy", "load_aware",
                             "--load-metrics-interval", "0.2", *QUIET)
    procs.append(proxy)
    wait_until(lambda: counter(httpx.get(url + "/metrics").text, "pdproxy_engine_metrics_read_failures_total") >= 2,
               "two failed reads of the scripted instance's /metrics", timeout=20)
    counters = Counters(url)
    for n in range(4):
        r = httpx.post(url + "/v1/completions", json={"prompt": f"a b {n}", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
    assert counters.delta("pdproxy_route_decisions_total", policy="load_aware", reason="inflight_fallback") == 4
    text = httpx.get(url + "/metrics").text
    assert counter(text, "pdproxy_engine_metrics_read_failures_total", server_address=scripted_url[7:]) >= 2
    assert counter(text, "pdproxy_engine_metrics_read_failures_total", server_address=sim[7:]) == 0
    status = {i["url"]: i["scores"] for i in httpx.get(url + "/status").json()["instances"]["decode"]}
    assert status[scripted_url]["metrics"] == "unreadable" and status[sim]["metrics"] == "ok"
    assert proxy.output().count("cannot read engine load from " + scripted_url) == 1  # logged once


def test_consistent_hash_keeps_a_session_on_one_instance(procs, tmp_path):
    decode = sims(procs, "single", 2)
    trace_file = tmp_path / "spans.jsonl"
    proxy, url = start_proxy("--decode", *decode, "--policy", "consistent_hash", "--trace-file", str(trace_file),
                             *QUIET, env=ENV)
    procs.append(proxy)
    where: dict[str, set] = {}
    for turn in range(3):
        for s in range(16):
            rid = post(url, {"prompt": f"turn {turn} of {s}", "max_tokens": 2}, {"X-Session-Id": f"session-{s}"})
            span = leg(trace_file, rid, "pd.prefill")
            assert span["pd.route.reason"] == "hash_key"
            where.setdefault(f"session-{s}", set()).add(span["server.port"])
    assert all(len(ports) == 1 for ports in where.values()), where
    assert len(set().union(*where.values())) == 2  # 16 sessions do not all hash to one instance
    by_user = {leg(trace_file, post(url, {"prompt": "hi there", "max_tokens": 2, "user": "alice"}),
                   "pd.prefill")["server.port"] for _ in range(4)}
    assert len(by_user) == 1
    no_key = leg(trace_file, post(url, {"prompt": "hi there", "max_tokens": 2}), "pd.prefill")
    assert no_key["pd.route.reason"] == "no_key"


@pytest.mark.parametrize("policy", ["cache_aware", "power_of_two", "consistent_hash", "load_aware"])
def test_any_prompt_shape_is_routed_never_an_error(procs, policy):
    p = start_scripted("prefill")
    d = start_scripted("decode")
    procs.extend([p[0], d[0]])
    proxy, url = start_proxy("--prefill", p[1], "--decode", d[1], "--policy", policy, *QUIET)
    procs.append(proxy)
    shapes = [{"prompt": list(range(5000))}, {"prompt": [[1, 2, 3]]}, {"prompt": ""}, {"prompt": "x" * 300_000},
              {"prompt": [{"odd": 1}]}, {"prompt": 7}, {}, {"prompt": ["a", "b"]}]
    chats = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi " * 500},
                                                        {"type": "image_url", "image_url": {"url": "x"}}]}]},
             {"messages": []}, {"messages": "nope"}, {"messages": [None, {"role": 5, "content": {"a": 1}}]}]
    with httpx.Client(timeout=30) as c:
        for body in shapes:
            r = c.post(url + "/v1/completions", json={"model": "m", "max_tokens": 2, **body})
            assert r.status_code < 500, (body, r.text)
        for body in chats:
            r = c.post(url + "/v1/chat/completions", json={"model": "m", "max_tokens": 2, **body})
            assert r.status_code < 500, (body, r.text)
    assert "Traceback" not in proxy.output()


@pytest.mark.parametrize("args, message", [
    (("--policy", "fastest"), "invalid choice: 'fastest'"),
    (("--cache-threshold", "1.5"), "cache-threshold must be between 0 and 1"),
    (("--balance-rel-threshold", "0.5"), "balance-rel-threshold >= 1"),
    (("--hash-key", "cookie:sid"), "hash-key source 'cookie:sid' is not header:NAME or body:FIELD"),
    (("--max-tree-size", "0"), "max-tree-size must be >= 1"),
    (("--load-metrics-interval", "0"), "load-metrics-interval must be > 0"),
    (("--hash-load-factor", "0.5"), "hash-load-factor must be >= 1, or 0 for no bound"),
])
def test_bad_policy_settings_are_a_clear_error_at_start(args, message):
    proc = pdproxy("serve", "--decode", "http://127.0.0.1:9", *args)
    assert proc.popen.wait(30) == 2
    assert message in proc.output() and "Traceback" not in proc.output()


def test_unknown_policy_in_the_environment_or_file_is_a_clear_error(tmp_path):
    proc = pdproxy("serve", "--decode", "http://127.0.0.1:9", env={"PDPROXY_PREFILL_POLICY": "nearest"})
    proc.popen.wait(30)
    assert proc.popen.returncode == 2 and "prefill-policy 'nearest' is not a routing policy" in proc.output()
    config = tmp_path / "c.yaml"
    config.write_text("decode: [http://127.0.0.1:9]\ncache-aware-threshold: 0.5\n")
    proc = pdproxy("serve", "--config", str(config))
    proc.popen.wait(30)
    assert proc.popen.returncode == 2 and "cache_aware_threshold" in proc.output()


def test_every_policy_module_is_a_choice_of_the_flags():
    from pdproxy import config, policies

    assert config.POLICIES == tuple(policies.POLICIES)
    assert set(policies.ALL_PARAMETERS) <= {f.name for f in config.fields(config.Settings)}


def test_the_prefix_index_stays_within_its_bound_and_keeps_count_per_instance():
    from pdproxy.policies import RequestView, create
    from pdproxy.pool import Pool

    pool = Pool("prefill", [f"http://10.0.0.{i}:8100" for i in range(4)], create("cache_aware", {"max_tree_size": 500}))
    for k in range(300):  # 300 distinct 2,000-token prompts: ~13 entries each, far beyond 500
        pool.pick(RequestView({"prompt": [k] + list(range(2000))}))
        assert len(pool.policy.index) <= 500
    sizes = pool.policy.index.sizes
    assert sum(sizes.values()) == len(pool.policy.index) and all(v >= 0 for v in sizes.values())
    fresh = [k + 1000 for k in range(2000)]  # a new prompt: a miss, then a match on the instance that got it
    first, decision = pool.pick(RequestView({"prompt": fresh}))
    assert decision.reason == "cache_miss"
    again, decision = pool.pick(RequestView({"prompt": fresh + [7, 7, 7]}))
    assert again is first and decision.reason == "prefix_match" and decision.matched >= 1500
