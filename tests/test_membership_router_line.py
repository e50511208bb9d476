"""vllm-router's launch line as it is (issue 53, item 2): the same arguments start vllm-router and pdproxy,
both serve; an unknown flag gets serve's own usage."""

import shutil
import subprocess
import sys

import httpx
import pytest

from procs import HOST, Proc, free_port, start_scripted


@pytest.mark.skipif(shutil.which("vllm-router") is None, reason="vllm-router not installed")
def test_one_launch_line_starts_both():
    (p, p_url), (d, d_url) = start_scripted("prefill"), start_scripted("decode")
    procs = [p, d]
    try:
        line = ["--vllm-pd-disaggregation", "--prefill", p_url, "8998", "--decode", d_url, "--policy", "random",
                "--host", HOST, "--prometheus-host", HOST, "--worker-startup-timeout-secs", "30",
                "--eviction-interval-secs", "120", "--log-level", "warning"]
        urls = {}
        for name, argv in (("vllm-router", ["vllm-router"]), ("pdproxy", [sys.executable, "-m", "pdproxy", "serve"])):
            port = free_port()
            proc = Proc([*argv, *line, "--port", str(port), "--prometheus-port", str(free_port())], name=name)
            procs.append(proc)
            urls[name] = f"http://{HOST}:{port}"
            proc.wait_http(urls[name] + "/health", timeout=30)
        for name, url in urls.items():
            r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 3}, timeout=20)
            assert r.status_code == 200, (name, r.text)
        workers = httpx.get(urls["pdproxy"] + "/workers").json()["workers"]
        assert {(w["worker_type"], w["bootstrap_port"]) for w in workers} == {("prefill", 8998), ("decode", None)}
        assert ("vllm-router flag(s) with no effect here: --eviction-interval-secs, --prometheus-host, "
                "--prometheus-port, --worker-startup-timeout-secs") in procs[-1].output()
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_an_unknown_flag_gets_serves_usage():
    r = subprocess.run([sys.executable, "-m", "pdproxy", "serve", "--decode", "http://127.0.0.1:1", "--bogus"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("usage: pdproxy serve") and "unrecognized arguments: --bogus" in r.stderr
