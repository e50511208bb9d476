"""pdproxy serve passes vLLM's /tokenize and /detokenize to a decode instance: same auth, errors, a span."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import requests

from ledgers import ScriptedGroup
from otlp import attrs
from procs import free_port, start_proxy, start_sim
from waits import wait_until

pytestmark = pytest.mark.timeout(90)


def spans(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        for rs in json.loads(line).get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                out.extend(ss.get("spans", []))
    return out


def wait_spans(path: Path, name: str, n: int) -> list[dict]:
    def found() -> list[dict] | None:
        named = [s for s in spans(path) if s["name"] == name]
        return named if len(named) >= n else None

    return wait_until(found, f"{n} {name} spans in {path}", timeout=20, interval=0.2)


def test_tokenize_and_detokenize_through_the_proxy(tmp_path):
    sim, sim_url = start_sim("decode", "--preset", "instant", "--max-model-len", "8192")
    trace_file = tmp_path / "t.jsonl"
    proxy, url = start_proxy("--decode", sim_url, "--api-key", "k1", "--trace-file", str(trace_file))
    auth = {"Authorization": "Bearer k1"}
    try:
        body = {"model": "sim-model", "prompt": "bakodu fimeta one two"}
        direct = requests.post(sim_url + "/tokenize", json=body, timeout=10).json()
        r = requests.post(url + "/tokenize", json=body, headers=auth, timeout=10)
        assert r.status_code == 200 and r.json() == direct and direct["max_model_len"] == 8192
        chat = requests.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=auth,
                             timeout=10).json()
        assert chat["count"] == len(chat["tokens"]) > 5
        back = requests.post(url + "/detokenize", json={"tokens": direct["tokens"][1:]}, headers=auth, timeout=10)
        assert back.status_code == 200 and back.json() == {"prompt": "bakodu fimeta one two"}
        # the proxy's own key is checked and never forwarded; the instance's errors come back as they are
        denied = requests.post(url + "/tokenize", json=body, timeout=10)
        assert denied.status_code == 401 and "API key" in denied.json()["error"]["message"]
        unknown = requests.post(url + "/tokenize", json={"model": "nope", "prompt": "a"}, headers=auth, timeout=10)
        assert unknown.status_code == 404 and "does not exist" in unknown.json()["error"]["message"]
        journal = requests.get(sim_url + "/sim/requests", timeout=10).json()["requests"]
        assert all("authorization" not in e["headers"] for e in journal)
        got = wait_spans(trace_file, "POST /tokenize", 4)
    finally:
        proxy.stop()
        sim.stop()
    by_status = {attrs(s)["http.response.status_code"]: attrs(s) for s in got}
    assert set(by_status) == {200, 401, 404}
    ok = by_status[200]
    assert ok["http.route"] == "/tokenize" and ok["pd.decode.instance"] == sim_url.removeprefix("http://")
    assert by_status[401]["error.type"] == "unauthorized" and by_status[404]["error.type"] == "upstream_4xx"


def test_tokenize_with_the_decode_down_is_a_502_json_error():
    dead = f"http://127.0.0.1:{free_port()}"
    proxy, url = start_proxy("--decode", dead, "--health-check-interval", "0")
    try:
        r = requests.post(url + "/tokenize", json={"prompt": "a"}, timeout=30)
    finally:
        proxy.stop()
    assert r.status_code == 502
    err = r.json()["error"]
    assert "did not answer /tokenize" in err["message"] and err["code"] == "connect_error"


def test_tokenize_and_detokenize_pass_admission():
    """--max-inflight counts them: at capacity they are refused at once with 503, as completions are,
    instead of adding load the operator bounded."""
    d = ScriptedGroup("decode", 1)
    proxy, url = start_proxy("--decode", d.url, "--max-inflight", "1", "--max-queue", "0",
                             "--health-check-interval", "0")
    held: dict = {}
    worker = threading.Thread(target=lambda: held.update(r=requests.post(
        url + "/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2}, timeout=30)))
    try:
        d.script({"hold": True})  # the completion takes the only slot until released
        worker.start()
        wait_until(lambda: d.journal() or None, "the completion to reach the decode", timeout=10)
        for path in ("/tokenize", "/detokenize"):
            r = requests.post(url + path, json={"prompt": "a"}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", (path, r.text)
            assert r.headers["Retry-After"] == "1"
        assert [e["path"] for e in d.journal()] == ["/v1/completions"]  # neither reached the instance
        requests.post(d.url + "/_release", timeout=10)
        worker.join(30)
        assert held["r"].status_code == 200
        r = requests.post(url + "/tokenize", json={"prompt": "a"}, timeout=10)  # the slot is free again
        assert r.status_code == 200 and d.journal()[-1]["path"] == "/tokenize"
    finally:
        requests.post(d.url + "/_release", timeout=10)
        if worker.is_alive():
            worker.join(30)
        proxy.stop()
        d.stop()
