"""Issue 19's end-to-end check on real processes: simulated instances that tokenize like a real model
(~2.3 tokens per word, /tokenize), pdproxy serve in front, pdproxy bench and pdproxy report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from procs import start_proxy, start_sim

pytestmark = pytest.mark.timeout(300)
SIM = ("--preset", "h200-llama8b-2gpu", "--time-scale", "0.5")


def bench(url: str, out: Path, *args: str) -> list[dict]:
    p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", url, "--out", str(out), "--no-progress",
                        "--quiet", *args], capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["prompts"]["method"] == "tokenize"  # exact: learned from the server's /tokenize
    return [x for x in lines if x["type"] == "request"]


def journal(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(url + "/sim/requests", timeout=5) as r:
        return {e["headers"].get("x-request-id"): e["body"] for e in json.loads(r.read())["requests"]}


@pytest.fixture(scope="module")
def pd():
    procs = []
    try:
        pre = [start_sim("prefill", *SIM) for _ in range(2)]
        dec = [start_sim("decode", *SIM) for _ in range(2)]
        procs += [p for p, _ in pre + dec]
        proxy, url = start_proxy("--prefill", *[u for _, u in pre], "--decode", *[u for _, u in dec])
        procs.append(proxy)
        yield url, [u for _, u in pre], [u for _, u in dec]
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.mark.parametrize("args, asked", [
    (("--prompt-len", "1000"), 1000),
    (("--prompt-len", "3000"), 3000),
    (("--endpoint", "chat", "--prompt-len", "600"), 600),
])
def test_prompts_are_the_asked_tokens_and_outputs_exact_through_pdproxy(pd, tmp_path, args, asked):
    url, prefills, decodes = pd
    reqs = bench(url, tmp_path / "r.jsonl", *args, "--output-len", "24", "--requests", "6", "--concurrency", "3",
                 "--seed", "1")
    assert len(reqs) == 6 and all(r["ok"] for r in reqs), [r["error_detail"] for r in reqs]
    for r in reqs:
        assert abs(r["prompt_tokens"] - asked) <= 0.01 * asked  # (in fact exact)
        assert r["prompt_tokens_requested"] == asked and r["prompt_words"] < asked / 2  # ~2.3 tokens per word
        assert r["output_tokens"] == 24 == r["max_tokens"] and r["finish_reason"] == "length"
    sent = {}
    for d in decodes:
        sent.update(journal(d))
    for r in reqs:
        body = sent[r["request_id"]]
        assert body["min_tokens"] == body["max_tokens"] == 24 and body["ignore_eos"] is True


def test_shared_prefixes_and_conversations_are_sized_in_tokens_and_asked_in_full(pd, tmp_path):
    """Issue 29: prefix_len was counted in words, so a class asked for 900 tokens was sent 2,992 and the
    report flagged it `900 → 2992 (off)`. The prefix is in the target's tokens now, and each request asks
    for what it is sent: prefix plus the class's own tokens, every earlier turn of a conversation too."""
    url, _, _ = pd
    reqs = bench(url, tmp_path / "p.jsonl", "--prompt-len", "900", "--shared-prefixes", "3", "--prefix-len",
                 "1200", "--output-len", "8", "--requests", "6", "--concurrency", "3", "--seed", "2")
    assert len(reqs) == 6 and all(r["ok"] for r in reqs), [r["error_detail"] for r in reqs]
    for r in reqs:
        assert r["prompt_tokens_requested"] == 2100
        assert abs(r["prompt_tokens"] - 2100) <= 2, r["prompt_tokens"]  # exact where the words add up (±1 each)
    turns = bench(url, tmp_path / "s.jsonl", "--prompt-len", "300", "--sessions", "2", "--turns", "3",
                  "--output-len", "8", "--requests", "6", "--concurrency", "1", "--seed", "3")
    assert all(r["ok"] for r in turns)
    asked = [r["prompt_tokens_requested"] for r in sorted(turns, key=lambda r: r["seq"])]
    assert asked[:2] == [300, 300] and asked[2] > 600 and asked[4] > asked[2]  # each turn repeats the ones before
    for r in turns:
        assert abs(r["prompt_tokens"] - r["prompt_tokens_requested"]) <= 3, r
    report = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", f"p={tmp_path / 'p.jsonl'}", "--json",
                        str(report), "--no-table"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lengths = json.loads(report.read_text())["runs"][0]["stats"]["lengths"]["default"]["prompt"]
    assert lengths["requested"] == 2100 and not lengths["flagged"], lengths


def test_report_of_a_2p2d_run_has_a_row_per_instance_and_the_killed_decode_stands_out(tmp_path):
    procs = []
    trace_file = tmp_path / "traces.jsonl"
    try:
        pre = [start_sim("prefill", "--preset", "h200-llama8b-2gpu") for _ in range(2)]
        dec = [start_sim("decode", "--preset", "h200-llama8b-2gpu") for _ in range(2)]
        procs += [p for p, _ in pre + dec]
        proxy, url = start_proxy("--prefill", *[u for _, u in pre], "--decode", *[u for _, u in dec],
                                 "--trace-file", str(trace_file))
        procs.append(proxy)
        victim, victim_url = dec[1]
        stop = threading.Event()

        def kill_mid_run() -> None:
            """Once the victim has finished a few requests and is streaming others, like on the real run."""
            while not stop.wait(0.05):
                with urllib.request.urlopen(victim_url + "/sim/state", timeout=5) as r:
                    state = json.loads(r.read())
                if state["requests_total"] >= 6 and state["running"] >= 2:
                    os.killpg(victim.popen.pid, signal.SIGKILL)
                    return

        killer = threading.Thread(target=kill_mid_run)
        killer.start()
        try:
            bench(url, tmp_path / "r.jsonl", "--prompt-len", "300", "--output-len", "200", "--duration", "8",
                  "--concurrency", "6", "--label", "pd", "--mode", "pd", "--gpu-count", "4")
        finally:
            stop.set()
            killer.join()
        assert victim.popen.poll() is not None, "the decode was never killed: the load did not reach it"
    finally:
        for p in reversed(procs):
            p.stop()  # the proxy writes out its trace file
    out = tmp_path / "report.json"
    page = tmp_path / "report.html"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", str(tmp_path / "r.jsonl"), "--traces",
                        str(trace_file), "--json", str(out), "--html", str(page)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "160"})
    assert p.returncode == 0, p.stderr
    run = json.loads(out.read_text())["runs"][0]
    rows = {(i["role"], i["address"]): i for i in run["instances"]}
    expected = {("prefill", u.removeprefix("http://")) for _, u in pre} | \
               {("decode", u.removeprefix("http://")) for _, u in dec}
    assert set(rows) == expected and all(i["requests"] > 0 for i in rows.values())
    killed = rows[("decode", victim_url.removeprefix("http://"))]
    assert killed["failed"] >= 1 and set(killed["failures"]) <= {"stream_error", "stream_broken",
                                                                "incomplete_stream", "http_502"}
    assert all(i["failed"] == 0 for k, i in rows.items() if i is not killed), rows
    assert sum(i["failed"] for i in rows.values()) == run["stats"]["requests"]["failed"]
    assert all(i["ttft"]["count"] and i["kv_wait"]["count"] and i["max_itl"]["count"] for i in rows.values()), rows
    assert "Per decode instance, pd" in p.stdout and victim_url.removeprefix("http://") in p.stdout
    assert page.read_text().count("<table class=instances") == 2  # a prefill's and a decode's, each its own columns
