"""The admin HTTP API (issue 53, items 1, 2 and 7): instances added and removed while requests flow, with
vllm-router's routes; removal drains without failing a request; bad callers and bad input are refused."""

import threading
import urllib.parse

import httpx
import pytest

from ledgers import counter
from procs import start_proxy, start_sim
from waits import wait_until

KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster():
    procs = []
    try:
        p, p_url = start_sim("prefill")
        procs.append(p)
        sims = []
        for _ in range(2):
            d, d_url = start_sim("decode")
            procs.append(d)
            sims.append(d_url)
        proxy, url = start_proxy("--prefill", p_url, "8998", "--decode", sims[0], "--health-check-interval", "0.5",
                                 "--admin-api-key", KEY, "--instance-series-retention", "1")
        procs.append(proxy)
        yield {"url": url, "p": p_url, "d1": sims[0], "d2": sims[1], "proxy": proxy}
    finally:
        for proc in reversed(procs):
            proc.stop()


def instances(url, role="decode"):
    return {i["url"]: i for i in httpx.get(url + "/status").json()["instances"][role]}


def attempts(url, address):
    return counter(httpx.get(url + "/metrics").text, "pdproxy_instance_attempts_total", role="decode",
                   server_address=address)


def complete(url, max_tokens=4, stream=False):
    r = httpx.post(url + "/v1/completions", json={"model": "sim-model", "prompt": "hello there", "max_tokens": max_tokens,
                                                 "min_tokens": max_tokens, "ignore_eos": True, "stream": stream},
                   timeout=60)
    return r.status_code, r.text


def test_added_by_hand_it_takes_requests_and_removed_it_drains_without_failing_one(cluster):
    url, d1, d2 = cluster["url"], cluster["d1"], cluster["d2"]
    listed = httpx.get(url + "/workers", headers=AUTH).json()
    assert {(w["url"], w["worker_type"], w["sources"][0]) for w in listed["workers"]} == {
        (cluster["p"], "prefill", "flags"), (d1, "decode", "flags")}
    assert [w["bootstrap_port"] for w in listed["workers"] if w["worker_type"] == "prefill"] == [8998]

    answer = httpx.post(url + "/workers", json={"url": d2, "worker_type": "decode"}, headers=AUTH)
    assert answer.status_code == 200 and answer.json()["success"], answer.text
    wait_until(lambda: instances(url).get(d2, {}).get("state") == "active", "the added decode in rotation")
    assert instances(url)[d2]["sources"] == ["admin"]

    for _ in range(8):
        assert complete(url)[0] == 200
    a2 = d2.removeprefix("http://")
    assert attempts(url, a2) >= 3  # round robin over both

    # four long streams, some on each decode; the added one is withdrawn while they run
    results = []
    threads = [threading.Thread(target=lambda: results.append(complete(url, 400, stream=True))) for _ in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: instances(url)[d2]["inflight"] >= 1, "a stream running on the added decode")
    gone = httpx.delete(url + "/workers/" + urllib.parse.quote(d2, safe=""), headers=AUTH)
    assert gone.status_code == 200, gone.text
    assert instances(url)[d2]["state"] == "draining"
    before = attempts(url, a2)
    for _ in range(6):  # new requests meanwhile: none goes to the leaving decode
        assert complete(url)[0] == 200
    assert attempts(url, a2) == before
    for t in threads:
        t.join(60)
    assert [status for status, _ in results] == [200] * 4
    assert all(text.rstrip().endswith("data: [DONE]") for _, text in results)  # each stream whole
    wait_until(lambda: d2 not in instances(url), "the drained decode removed")
    metrics = httpx.get(url + "/metrics").text
    assert counter(metrics, "pdproxy_membership_changes_total", source="admin", kind="added") == 1
    assert counter(metrics, "pdproxy_membership_changes_total", source="admin", kind="removed") == 1
    assert counter(metrics, "pdproxy_requests_total", code="200") >= 18
    assert counter(metrics, "pdproxy_requests_total") == counter(metrics, "pdproxy_requests_total", code="200")
    # its series go after --instance-series-retention (1 s)
    wait_until(lambda: f'server_address="{a2}"' not in httpx.get(url + "/metrics").text,
               "the removed decode's series gone")


def test_the_legacy_routes_and_a_flags_instance_withdrawn_by_hand(cluster):
    url, d1, d2 = cluster["url"], cluster["d1"], cluster["d2"]
    r = httpx.post(url + "/add_worker", params={"url": d2, "worker_type": "decode"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert set(httpx.get(url + "/list_workers", headers=AUTH).json()["urls"]) == {cluster["p"], d1, d2}
    wait_until(lambda: instances(url).get(d2, {}).get("state") == "active", "the added decode in rotation")
    r = httpx.post(url + "/remove_worker", params={"url": d1}, headers=AUTH)  # given by the flags
    assert r.status_code == 200, r.text
    wait_until(lambda: d1 not in instances(url), "the flags' decode withdrawn")
    assert complete(url)[0] == 200  # served by the one left
    one = httpx.get(url + "/workers/" + d2, headers=AUTH)  # the URL as it is, not encoded
    assert one.status_code == 200 and one.json()["url"] == d2
    # back as it was for the other tests
    assert httpx.post(url + "/workers", json={"url": d1, "worker_type": "decode"}, headers=AUTH).status_code == 200
    assert httpx.request("DELETE", url + "/workers/" + d2, headers=AUTH).status_code == 200
    wait_until(lambda: set(instances(url)) == {d1} and instances(url)[d1]["state"] == "active", "back to one decode")


@pytest.mark.parametrize("method,path,body,headers,status,says", [
    ("GET", "/workers", None, {}, 401, "Authorization"),
    ("GET", "/workers", None, {"Authorization": "Bearer nope"}, 403, "wrong"),
    ("POST", "/workers", {"url": "not a url", "worker_type": "decode"}, AUTH, 400, "url"),
    ("POST", "/workers", {"url": "http://10.1.1.1:8000", "worker_type": "encoder"}, AUTH, 400, "role"),
    ("POST", "/workers", {"url": "http://10.1.1.1:8000"}, AUTH, 400, "prefill or decode"),
    ("POST", "/workers", {"url": "http://10.1.1.1:8000/v1", "worker_type": "decode"}, AUTH, 400, "path"),
    ("POST", "/workers", {"url": "http://10.1.1.1:8000", "worker_type": "decode", "port": 1}, AUTH, 400, "unknown"),
    ("POST", "/workers", [1, 2], AUTH, 400, "object"),
    ("POST", "/workers", {"url": "http://10.1.1.1:8000", "worker_type": "prefill", "bootstrap_port": 70000}, AUTH,
     400, "bootstrap_port"),
    ("DELETE", "/workers/http%3A%2F%2F10.9.9.9%3A1", None, AUTH, 404, "not found"),
    ("POST", "/remove_worker", None, AUTH, 400, "url"),
])
def test_bad_callers_and_bad_input_get_a_clear_error(cluster, method, path, body, headers, status, says):
    r = httpx.request(method, cluster["url"] + path, json=body, headers=headers)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]
    assert set(instances(cluster["url"])) == {cluster["d1"]}  # nothing changed


def test_without_a_key_only_loopback_callers_are_served():
    d, d_url = start_sim("decode")
    try:
        proxy, url = start_proxy("--decode", d_url, "--health-check-interval", "0")
        try:
            assert httpx.get(url + "/workers").status_code == 200  # the test calls from 127.0.0.1
            refused = httpx.post(url + "/workers", json={"url": "http://10.1.1.1:8000", "worker_type": "prefill"})
            assert refused.status_code == 400 and "single mode" in refused.json()["error"]["message"]
        finally:
            proxy.stop()
    finally:
        d.stop()


def test_with_several_workers_a_change_reaches_every_one(cluster):
    proxy, url = start_proxy("--decode", cluster["d1"], "--health-check-interval", "0.5", "--workers", "2",
                             "--admin-api-key", KEY)
    try:
        r = httpx.post(url + "/workers", json={"url": cluster["d2"], "worker_type": "decode"}, headers=AUTH)
        assert r.status_code == 200, r.text
        seen = []
        for _ in range(12):  # a new connection each time: the kernel spreads them over the workers
            with httpx.Client() as fresh:
                status = fresh.get(url + "/status").json()
            seen.append(status["instances"]["decode"][-1]["url"] if len(status["instances"]["decode"]) == 2 else None)
        assert seen == [cluster["d2"]] * 12
        assert httpx.delete(url + "/workers/" + cluster["d2"], headers=AUTH).status_code == 200
        for _ in range(8):
            with httpx.Client() as fresh:
                assert [i["url"] for i in fresh.get(url + "/status").json()["instances"]["decode"]
                        if i["state"] != "draining"] == [cluster["d1"]]
    finally:
        proxy.stop()
