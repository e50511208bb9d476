"""Several pdproxy replicas in front of the same instances agree on where a prompt's KV sits, via the engines' events.

Real processes: 2 simulated prefills and 2 decodes publishing KV events; pdproxy replicas (separate processes)
with requests alternating between them; 6 shared prefixes of 20 blocks, 10 requests each. Three phases over the
same instances, each with its own prefixes: 2 replicas with cache_aware (today's approximate index), 2 replicas
with precise_prefix, 4 replicas with precise_prefix, 1 replica with precise_prefix (the single-process reference). Figures in docs/explanation/kv-events.md."""

from __future__ import annotations

import json
import random
import re
import time
import urllib.request

import pytest

from procs import HOST, free_port, start_proxy, start_sim
from waits import scaled

PREFIXES, PER_PREFIX, PREFIX_TOKENS = 6, 10, 320


def events_config(pub: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{HOST}:{pub}",
                       "replay_endpoint": f"tcp://{HOST}:{replay}"})


def get(url: str):
    with urllib.request.urlopen(url, timeout=scaled(10)) as r:
        body = r.read()
        return json.loads(body) if r.headers.get("Content-Type", "").startswith("application/json") else body.decode()


def post(url: str, body: dict) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=scaled(30)) as r:
        assert r.status == 200


def hits(sim_url: str) -> tuple[float, float]:
    text = get(sim_url + "/metrics")
    total = lambda name: sum(float(v) for v in re.findall(rf"^{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return total("vllm:prefix_cache_hits"), total("vllm:prefix_cache_queries")


@pytest.fixture(scope="module")
def cluster():
    procs, urls, overrides = [], {}, []
    try:
        for role, names in (("prefill", ("p0", "p1")), ("decode", ("d0", "d1"))):
            for name in names:
                pub, replay = free_port(), free_port()
                args = (role, "--kv-events-config", events_config(pub, replay), "--time-scale", "0.05")
                proc, url = start_sim(*args)
                procs.append(proc)
                urls[name] = url
                urls[name + ":args"] = args
                address = url.removeprefix("http://")
                overrides.append((f"{address}=tcp://{HOST}:{pub}", f"{address}=tcp://{HOST}:{replay}"))
        env = {"PDPROXY_KV_EVENTS_INSTANCE": ",".join(o[0] for o in overrides),
               "PDPROXY_KV_EVENTS_REPLAY_INSTANCE": ",".join(o[1] for o in overrides)}
        yield urls, env, procs
    finally:
        for proc in procs:
            proc.stop()


def prefix_of(prompt, base: int) -> int | None:
    """Which of the phase's prefixes a prompt (as the prefill got it) starts with."""
    if isinstance(prompt, list) and prompt and base <= prompt[0] < base + 1000 * PREFIXES:
        return (prompt[0] - base) // 1000
    if isinstance(prompt, str) and prompt.startswith(f"t{base}p"):
        return int(prompt.split(" ", 1)[0].split("p")[1].split("w")[0])
    return None


def run_phase(cluster, policy: str, replicas: int, base: int, workers: int = 1, text: bool = False) -> dict:
    urls, env, procs = cluster
    proxies = []
    try:
        for _ in range(replicas):
            proc, url = start_proxy("--prefill", urls["p0"], urls["p1"], "--decode", urls["d0"], urls["d1"],
                                    "--prefill-policy", policy, "--decode-policy", "round_robin",
                                    "--workers", str(workers), env=env)
            proxies.append((proc, url))
        if policy == "precise_prefix":
            for _, url in proxies:  # a replica routes by events once every worker caught up with every instance
                deadline = time.monotonic() + scaled(15)
                while True:
                    flowing = [line for line in get(url + "/metrics").splitlines()
                               if line.startswith("pdproxy_kv_events_flowing{")]  # the minimum over workers
                    if len(flowing) == 4 and all(line.endswith(" 1.0") for line in flowing):
                        break
                    assert time.monotonic() < deadline, flowing
                    time.sleep(0.05)
        before = {name: hits(urls[name]) for name in ("p0", "p1")}
        rng = random.Random(base)
        order = [p for p in range(PREFIXES) for _ in range(PER_PREFIX)]
        rng.shuffle(order)
        for n, p in enumerate(order):
            prompt = [base + p * 1000 + k for k in range(PREFIX_TOKENS)] + [rng.randrange(1, 100000)
                                                                           for _ in range(rng.randint(5, 40))]
            if text:  # about as many tokens, tokenized by the instances' /tokenize for routing
                prompt = " ".join(f"t{base}p{p}w{k}" for k in range(PREFIX_TOKENS // 4)) + " " + " ".join(
                    f"x{rng.randrange(100000)}" for _ in range(rng.randint(2, 10)))
            post(proxies[n % replicas][1] + "/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 2})
        # which prefill got each request, in arrival order
        arrivals = []
        for name in ("p0", "p1"):
            for entry in get(urls[name] + "/sim/requests")["requests"]:
                prefix = prefix_of((entry.get("body") or {}).get("prompt"), base)
                if entry["path"] == "/v1/completions" and prefix is not None:
                    arrivals.append((entry["received_at"], prefix, name))
        arrivals.sort()
        assert len(arrivals) == len(order)
        seen: dict[int, set[str]] = {}
        followers = affine = 0
        for _, prefix, name in arrivals:
            if prefix in seen:
                followers += 1
                affine += name in seen[prefix]
            seen.setdefault(prefix, set()).add(name)
        after = {name: hits(urls[name]) for name in ("p0", "p1")}
        hit = sum(after[n][0] - before[n][0] for n in after)
        queried = sum(after[n][1] - before[n][1] for n in after)
        decisions = get(proxies[0][1] + "/metrics")
        return {"affinity": affine / followers, "hit_rate": hit / queried,
                "approximate": sum(float(line.rsplit(" ", 1)[1]) for line in decisions.splitlines()
                                   if line.startswith("pdproxy_route_decisions_total{") and 'reason="approximate"' in line)}
    finally:
        for proc, _ in proxies:
            proc.stop()


def test_replicas_route_by_events_as_one_process_does(cluster):
    approximate = run_phase(cluster, "cache_aware", 2, base=10_000)
    precise = run_phase(cluster, "precise_prefix", 2, base=40_000)
    four = run_phase(cluster, "precise_prefix", 4, base=70_000)
    workers = run_phase(cluster, "precise_prefix", 1, base=100_000, workers=2)
    single = run_phase(cluster, "precise_prefix", 1, base=110_000)
    text = run_phase(cluster, "precise_prefix", 2, base=16_000, text=True)
    print(f"\nprefix affinity / engine prefix-cache hit rate: cache_aware x2 {approximate}; "
          f"precise_prefix x2 {precise}; precise_prefix x4 {four}; --workers 2 {workers}; precise_prefix x1 {single}; precise_prefix x2, text prompts {text}")
    for replicas in (precise, four, workers, single, text):
        assert replicas["affinity"] >= 0.95 and replicas["approximate"] == 0
        assert abs(replicas["hit_rate"] - single["hit_rate"]) <= 0.02
    assert approximate["affinity"] < precise["affinity"]


def send(url: str, prompt: list[int]) -> None:
    post(url + "/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 2})


def wait_status(url: str, what: str, condition) -> dict:
    deadline = time.monotonic() + scaled(15)
    while True:
        state = get(url + "/status")
        if condition(state):
            return state
        assert time.monotonic() < deadline, f"{what}: {state['kv_events']}"
        time.sleep(0.05)


def test_a_late_replica_catches_up_and_a_restarted_instance_is_resynchronised(cluster):
    urls, env, procs = cluster
    legs = ("--prefill", urls["p0"], urls["p1"], "--decode", urls["d0"], urls["d1"], "--prefill-policy",
            "precise_prefix", "--decode-policy", "round_robin")
    prompts = [[120_000 + p * 100 + k % 100 for k in range(PREFIX_TOKENS)] for p in range(4)]
    started = []
    try:
        first, first_url = start_proxy(*legs, env=env)
        started.append(first)
        wait_status(first_url, "first replica in sync", lambda s: all(v["flowing"] for v in s["kv_events"].values()))
        for prompt in prompts:
            send(first_url, prompt)
        # a replica started now knows the prefills' caches from their replay buffers before routing anything
        late, late_url = start_proxy(*legs, env=env)
        started.append(late)
        state = wait_status(late_url, "late replica in sync",
                            lambda s: all(v["flowing"] for v in s["kv_events"].values()))
        prefills = [urls[n].removeprefix("http://") for n in ("p0", "p1")]
        blocks = {a: state["kv_events"][a]["blocks"] for a in prefills}
        assert sum(blocks.values()) >= 4 * PREFIX_TOKENS // 16, state["kv_events"]
        assert all(state["kv_events"][a]["replayed_batches"] >= 1 for a in prefills)
        for prompt in prompts:
            send(late_url, prompt + [7, 8, 9])
        metrics = get(late_url + "/metrics")
        decisions = [line for line in metrics.splitlines() if line.startswith("pdproxy_route_decisions_total{")]
        matched = sum(float(line.rsplit(" ", 1)[1]) for line in decisions
                      if 'role="prefill"' in line and 'reason="prefix_match"' in line)
        assert matched == len(prompts), decisions  # every one, from the first: caught up before routing
        # an instance restarted mid-run: sequence from 0, cache empty; both replicas resynchronise
        procs[0].stop()  # p0
        procs[0], _ = start_sim(*urls["p0:args"], port=int(urls["p0"].rsplit(":", 1)[1]))
        address, other = prefills
        for url in (first_url, late_url):
            wait_status(url, "resynchronised after the restart", lambda s: s["kv_events"][address]["flowing"]
                        and s["kv_events"][address]["blocks"] == 0 and s["kv_events"][address]["resyncs"] >= 2)
        kept = get(first_url + "/status")["kv_events"][other]["blocks"]
        send(first_url, [125_000 + k % 100 for k in range(PREFIX_TOKENS)])  # a new prefix, after the restart
        for url in (first_url, late_url):  # both replicas see it, wherever it went
            wait_status(url, "the new prefix's blocks", lambda s: s["kv_events"][address]["blocks"]
                        + s["kv_events"][other]["blocks"] == kept + PREFIX_TOKENS // 16)
    finally:
        for proc in started:
            proc.stop()
