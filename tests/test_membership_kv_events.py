"""KV events follow membership (issue 53, item 3): an instance added at run time is subscribed at once, a replica
started later reaches the same view of it, and a removed instance's subscription, index and series go."""

import json

import httpx
import pytest

from procs import HOST, free_port, start_proxy, start_sim
from waits import wait_until


def events_config(pub: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{HOST}:{pub}",
                       "replay_endpoint": f"tcp://{HOST}:{replay}"})


@pytest.fixture(scope="module")
def sims():
    procs, found = [], {}
    try:
        for name, role in (("p", "prefill"), ("d1", "decode"), ("d2", "decode")):
            pub, replay = free_port(), free_port()
            proc, url = start_sim(role, "--kv-events-config", events_config(pub, replay), "--time-scale", "0.05")
            procs.append(proc)
            found[name] = {"url": url, "address": url.removeprefix("http://"), "pub": f"tcp://{HOST}:{pub}",
                           "replay": f"tcp://{HOST}:{replay}"}
        yield found
    finally:
        for proc in reversed(procs):
            proc.stop()


def replica(sims):
    """A proxy given the prefill and the first decode by flags, both with their event endpoints."""
    given = [sims["p"], sims["d1"]]
    env = {"PDPROXY_KV_EVENTS_INSTANCE": ",".join(f"{s['address']}={s['pub']}" for s in given),
           "PDPROXY_KV_EVENTS_REPLAY_INSTANCE": ",".join(f"{s['address']}={s['replay']}" for s in given)}
    return start_proxy("--prefill", sims["p"]["url"], "--decode", sims["d1"]["url"], "--policy", "precise_prefix",
                       "--health-check-interval", "0.5", "--instance-series-retention", "1", env=env)


def kv(url):
    return httpx.get(url + "/status").json()["kv_events"]


def add_d2(url, sims):
    d2 = sims["d2"]
    r = httpx.post(url + "/workers", json={"url": d2["url"], "worker_type": "decode", "kv_events_endpoint": d2["pub"],
                                           "kv_events_replay_endpoint": d2["replay"]})
    assert r.status_code == 200, r.text


def traffic(url, count):
    for n in range(count):
        prompt = [1000 * (n % 3) + k for k in range(96)]  # three shared prefixes of token ids
        r = httpx.post(url + "/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text


def test_an_added_instances_events_are_followed_and_dropped_with_it(sims):
    a, b = None, None
    d2 = sims["d2"]["address"]
    try:
        a, a_url = replica(sims)
        add_d2(a_url, sims)
        wait_until(lambda: kv(a_url).get(d2, {}).get("flowing"), "the added decode's events flowing")
        traffic(a_url, 12)
        wait_until(lambda: kv(a_url)[d2]["blocks"] > 0, "blocks indexed on the added decode")

        b, b_url = replica(sims)  # a replica started later, in a quiet moment
        add_d2(b_url, sims)
        wait_until(lambda: kv(b_url).get(d2, {}).get("flowing"), "the later replica following the added decode")
        views = lambda: ({a: s["blocks"] for a, s in kv(a_url).items()}, {a: s["blocks"] for a, s in kv(b_url).items()})
        wait_until(lambda: views()[0] == views()[1], "both replicas holding the same view of every instance")
        assert views()[0][d2] > 0

        assert httpx.delete(a_url + "/workers/" + sims["d2"]["url"]).status_code == 200
        wait_until(lambda: d2 not in kv(a_url), "the removed decode's subscription closed")
        metrics = lambda: httpx.get(a_url + "/metrics").text
        assert f'pdproxy_kv_events_flowing{{server_address="{d2}"}}' not in metrics()  # its index went with it
        wait_until(lambda: f'server_address="{d2}"' not in metrics(), "its counters gone after the retention")
        assert d2 in kv(b_url)  # the other replica was not told: it still follows it
        traffic(a_url, 3)
    finally:
        for proc in (a, b):
            if proc is not None:
                proc.stop()
