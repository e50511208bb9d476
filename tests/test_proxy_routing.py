"""Instance selection, health, authentication and the command line (real processes)."""

import subprocess
import sys
import threading

import httpx
import pytest

from procs import HOST, free_port, start_proxy, start_scripted
from waits import scaled, wait_until

BODY = {"model": "m", "prompt": "a b", "max_tokens": 4, "stream": False}


@pytest.fixture(scope="module")
def two_by_two():
    procs, urls = [], {"prefill": [], "decode": []}
    try:
        for role in ("prefill", "prefill", "decode", "decode"):
            proc, url = start_scripted(role)
            procs.append(proc)
            urls[role].append(url)
        yield urls
    finally:
        for proc in procs:
            proc.stop()


def instances(url, role):
    return httpx.get(url + "/status").json()["instances"][role]


def healthy(url, role):
    return [i["healthy"] for i in instances(url, role)]


def inflight(url, role):
    return [i["inflight"] for i in instances(url, role)]


def journal_sizes(urls):
    for url in urls:
        httpx.post(url + "/_reset", json={})
    return lambda: [len(httpx.get(u + "/_journal").json()) for u in urls]


def test_toy_flags_and_round_robin_on_each_pool(two_by_two):
    p, d = two_by_two["prefill"], two_by_two["decode"]
    ports = lambda urls: [u.rsplit(":", 1)[1] for u in urls]
    sizes = journal_sizes(p + d)
    proc, url = start_proxy("--prefiller-hosts", HOST, HOST, "--prefiller-ports", *ports(p),
                            "--decoder-hosts", HOST, HOST, "--decoder-ports", *ports(d))
    try:
        for _ in range(6):
            assert httpx.post(url + "/v1/completions", json=BODY).status_code == 200
        assert sizes() == [3, 3, 3, 3]
    finally:
        proc.stop()


def test_least_inflight_avoids_the_busy_decode(two_by_two):
    p, d = two_by_two["prefill"], two_by_two["decode"]
    sizes = journal_sizes(p + d)
    httpx.post(d[0] + "/_script", json=[{"hold": True}])  # the first request ties up decode 0 until released
    proc, url = start_proxy("--prefill", p[0], "--decode", *d, "--decode-policy", "least_inflight")
    try:
        with httpx.Client(timeout=10) as client:
            slow = threading.Thread(target=client.post, args=(url + "/v1/completions",), kwargs={"json": BODY})
            slow.start()
            wait_until(lambda: sizes()[2] == 1 and inflight(url, "decode") == [1, 0], "decode 0 to hold the first request")
            for _ in range(4):
                assert client.post(url + "/v1/completions", json=BODY).status_code == 200
            assert sizes()[2:] == [1, 4]  # all four went around the busy one
            httpx.post(d[0] + "/_release", json={})
            slow.join(scaled(10))
            assert not slow.is_alive()
    finally:
        proc.stop()


def test_unhealthy_instance_is_skipped_until_it_recovers(two_by_two):
    p = two_by_two["prefill"][0]
    healthy_decode = two_by_two["decode"][0]
    dead_port = free_port()
    sizes = journal_sizes([healthy_decode])
    proc, url = start_proxy("--prefill", p, "--decode", f"http://{HOST}:{dead_port}", healthy_decode,
                            "--health-check-interval", "0.2", "--decode-retries", "0")
    try:
        wait_until(lambda: healthy(url, "decode") == [False, True], "the probes to mark the dead decode unhealthy")
        for _ in range(5):
            assert httpx.post(url + "/v1/completions", json=BODY).status_code == 200
        assert sizes() == [5]
        revived, _ = start_scripted("decode", port=dead_port)
        try:
            wait_until(lambda: healthy(url, "decode") == [True, True], "the probes to see the decode recover")
        finally:
            revived.stop()
    finally:
        proc.stop()


def test_retry_moves_a_failed_prefill_to_another_instance(two_by_two):
    p, d = two_by_two["prefill"], two_by_two["decode"]
    sizes = journal_sizes(p)
    httpx.post(p[0] + "/_script", json=[{"status": 503, "body": {"error": {"message": "busy"}}}])
    proc, url = start_proxy("--prefill", *p, "--decode", d[0], "--prefill-retries", "1")
    try:
        assert httpx.post(url + "/v1/completions", json=BODY).status_code == 200
        assert sizes() == [1, 1]
    finally:
        proc.stop()


def test_api_key_at_the_proxy_and_upstream_key(two_by_two):
    p, d = two_by_two["prefill"][0], two_by_two["decode"][0]
    journal_sizes([p, d])
    proc, url = start_proxy("--prefill", p, "--decode", d, "--api-key", "proxy-secret",
                            env={"OPENAI_API_KEY": "instance-secret"})
    try:
        assert httpx.post(url + "/v1/completions", json=BODY).status_code == 401
        wrong = httpx.post(url + "/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        ok = httpx.post(url + "/v1/completions", json=BODY, headers={"Authorization": "Bearer proxy-secret"})
        assert ok.status_code == 200
        for instance in (p, d):
            sent = httpx.get(instance + "/_journal").json()[-1]["headers"]
            assert sent["authorization"] == "Bearer instance-secret"
    finally:
        proc.stop()


def run_serve(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pdproxy", "serve", *args], capture_output=True, text=True,
                          timeout=30, env=env)


def test_mismatched_toy_flags_are_a_clear_startup_error():
    done = run_serve("--prefiller-hosts", "a", "b", "--prefiller-ports", "8100")
    assert done.returncode == 2
    assert "--prefiller-hosts has 2 value(s) but --prefiller-ports has 1" in done.stderr
    assert "Traceback" not in done.stderr


def test_help_explains_every_toy_flag():
    done = run_serve("--help")
    for flag in ("--host", "--port", "--prefiller-hosts", "--prefiller-ports", "--decoder-hosts", "--decoder-ports",
                 "--prefill", "--decode", "--connect-timeout", "--read-timeout"):
        assert flag in done.stdout


def test_env_and_config_file_supply_settings(two_by_two, tmp_path):
    p, d = two_by_two["prefill"][0], two_by_two["decode"][0]
    config = tmp_path / "pdproxy.yaml"
    config.write_text(f"prefill: [{p}]\ndecode: [{d}]\nread-timeout: 7\n")
    port = free_port()
    proc, url = start_proxy("--config", str(config), port=port, env={"PDPROXY_RUN_LABEL": "from-env"})
    try:
        assert httpx.post(url + "/v1/completions", json=BODY).status_code == 200
        assert httpx.get(url + "/status").json()["mode"] == "pd"
        assert 'run="from-env"' in httpx.get(url + "/metrics").text
    finally:
        proc.stop()
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_setting: 1\n")
    done = run_serve("--config", str(bad))
    assert done.returncode == 2 and "no_such_setting" in done.stderr
