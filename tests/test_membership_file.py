"""A watched file of instances (issue 53, item 2): edits in place and atomic renames are followed, a file that
cannot be parsed keeps the last good set, a wrong entry is skipped alone, and an instance the file lists cannot
be removed by hand (it would come back)."""

import os

import httpx
import pytest
import yaml

from ledgers import counter
from procs import FILES, start_proxy, start_sim
from waits import wait_until


@pytest.fixture(scope="module")
def sims():
    procs = []
    try:
        p, p_url = start_sim("prefill")
        procs.append(p)
        urls = [p_url]
        for _ in range(2):
            d, d_url = start_sim("decode")
            procs.append(d)
            urls.append(d_url)
        yield urls
    finally:
        for proc in reversed(procs):
            proc.stop()


def decodes(url):
    return {i["url"]: i for i in httpx.get(url + "/status").json()["instances"]["decode"]}


def complete(url):
    return httpx.post(url + "/v1/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 3},
                      timeout=30).status_code


def test_the_file_is_followed_through_edits_renames_and_bad_writes(sims):
    p_url, d1, d2 = sims
    path = FILES.scratch("instances") / "instances.yaml"
    path.write_text(yaml.safe_dump({"prefill": [p_url], "decode": [{"url": d1}]}))
    proxy, url = start_proxy("--vllm-pd-disaggregation", "--instances-file", str(path), "--instances-file-interval",
                             "0.2", "--health-check-interval", "0.5")
    try:
        wait_until(lambda: decodes(url).get(d1, {}).get("state") == "active", "the file's decode in rotation")
        assert complete(url) == 200
        assert httpx.get(url + "/status").json()["mode"] == "pd"

        # an atomic rename (what a ConfigMap update and `mv` do) adding a decode, as a list with roles
        new = path.with_suffix(".tmp")
        new.write_text(yaml.safe_dump([{"url": p_url, "role": "prefill"}, {"url": d1, "worker_type": "decode"},
                                       {"url": d2, "role": "decode"}]))
        os.replace(new, path)
        wait_until(lambda: decodes(url).get(d2, {}).get("state") == "active", "the renamed file's new decode")

        # by hand: refused, the file lists it
        gone = httpx.delete(url + "/workers/" + d2)
        assert gone.status_code == 409 and "file" in gone.json()["error"]["message"]

        # half-written garbage: the last good set stays, and /status says why
        path.write_text("decode: [http://")
        wait_until(lambda: httpx.get(url + "/status").json()["membership"]["sources"]["file"]["state"] == "degraded",
                   "the bad file reported")
        assert set(decodes(url)) == {d1, d2} and complete(url) == 200

        # an edit in place dropping d1, with one wrong entry beside it: d1 drains away, the wrong one is skipped
        path.write_text(yaml.safe_dump({"prefill": [p_url], "decode": [d2, {"url": "http://10.0.0.1:1/v1"}]}))
        wait_until(lambda: set(decodes(url)) == {d2}, "d1 removed")
        file_status = httpx.get(url + "/status").json()["membership"]["sources"]["file"]
        assert file_status["state"] == "ok" and "path" in file_status["skipped_entries"][0]
        for _ in range(4):
            assert complete(url) == 200
        metrics = httpx.get(url + "/metrics").text
        assert counter(metrics, "pdproxy_membership_changes_total", source="file", kind="removed") == 1
        assert counter(metrics, "pdproxy_membership_changes_total", source="file", kind="added") == 3
        assert counter(metrics, "pdproxy_requests_total") == counter(metrics, "pdproxy_requests_total", code="200")
    finally:
        proxy.stop()
    log = proxy.output()
    assert "membership source file:" in log and "membership source flags:" in log  # one line per source


def test_a_missing_file_at_start_serves_the_flags_and_says_so(sims):
    p_url, d1, _ = sims
    path = FILES.scratch("instances") / "absent.yaml"
    proxy, url = start_proxy("--prefill", p_url, "--decode", d1, "--instances-file", str(path),
                             "--health-check-interval", "0")
    try:
        status = httpx.get(url + "/status").json()["membership"]["sources"]["file"]
        assert status["state"] == "degraded" and "cannot read" in status["last_error"]
        assert complete(url) == 200
        path.write_text(yaml.safe_dump({"decode": [d1]}))  # the same instance from a second source: one entry
        wait_until(lambda: decodes(url)[d1]["sources"] == ["flags", "file"], "both sources named")
        assert len(decodes(url)) == 1
    finally:
        proxy.stop()
