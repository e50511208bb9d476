"""`pdproxy bench` against simulated vLLM instances (real processes on loopback).

The simulator's request journal (`GET /sim/requests`) is the independent witness of what the bench
sent, and its /tokenize (a sub-word rule, ~2.3 tokens per word) counts the prompts; summary statistics
are recomputed here from the request lines with numpy.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from procs import HOST, Proc, free_port, start_sim


def bench(out: Path, url: str, *args: str, expect: int = 0) -> tuple[dict, list[dict], dict]:
    p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", url, "--out", str(out), "--no-progress",
                        *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == expect, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    return read(out)


def read(path: Path) -> tuple[dict, list[dict], dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["type"] == "run" and lines[-1]["type"] == "summary"
    return lines[0], [x for x in lines if x["type"] == "request"], lines[-1]


def tokenize(url: str, prompt: str) -> int:
    req = urllib.request.Request(url + "/tokenize", data=json.dumps({"prompt": prompt}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())["count"]


def journal(url: str, clear: bool = False) -> list[dict]:
    with urllib.request.urlopen(url + "/sim/requests", timeout=5) as r:
        entries = json.loads(r.read())["requests"]
    if clear:
        urllib.request.urlopen(urllib.request.Request(url + "/sim/requests", method="DELETE"), timeout=5).read()
    return entries


@pytest.fixture(scope="module")
def sim():
    proc, url = start_sim("single", "--time-scale", "0.5")
    yield url
    proc.stop()


def test_records_match_what_the_server_saw(sim: str, tmp_path: Path) -> None:
    journal(sim, clear=True)
    header, reqs, summary = bench(tmp_path / "r.jsonl", sim, "--requests", "24", "--concurrency", "4",
                                  "--prompt-len", "20-60", "--output-len", "5-12", "--warmup-requests", "4",
                                  "--seed", "5", "--label", "direct", "--gpu-count", "1", "--condition", "vllm.dtype=bf16")
    assert header["conditions"] == {"gpu.count": "1", "vllm.dtype": "bf16", "pd.run": "direct"}
    assert len(reqs) == 24 and all(r["ok"] for r in reqs)
    seen = {e["headers"]["x-request-id"]: e for e in journal(sim)}
    for r in reqs:
        e = seen[r["request_id"]]
        assert e["headers"]["traceparent"].split("-")[1] == r["trace_id"]
        # lengths are the server's tokens: exactly what was asked, whatever the words
        assert len(e["body"]["prompt"].split()) == r["prompt_words"] < r["prompt_tokens"]
        assert r["prompt_tokens"] == r["prompt_tokens_requested"] == tokenize(sim, e["body"]["prompt"])
        assert e["body"]["max_tokens"] == e["body"]["min_tokens"] == r["max_tokens"] == r["output_tokens"] == r["chunks"]
        assert e["body"]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert "text" not in r and "prompt" not in r  # no text unless --save-text
        assert r["warmup"] == (r["seq"] < 4)
        assert len(r["itl"]) == r["chunks"] - 1 and r["e2e"] == pytest.approx(r["ttft"] + sum(r["itl"]), abs=1e-5)

    # the summary, recomputed from the request lines
    st = summary["stats"]
    measured = [r for r in reqs if not r["warmup"]]
    assert st["requests"] == {"total": 24, "warmup": 4, "measured": 20, "ok": 20, "failed": 0, "error_rate": 0.0,
                              "errors": {}}
    ttft = [r["ttft"] for r in measured]
    gaps = [g for r in measured for g in r["itl"]]  # one token per chunk here, so chunk gaps = token gaps
    maxes = [max(r["itl"]) for r in measured]
    p99s = [np.percentile(r["itl"], 99) for r in measured]
    for p in (50, 90, 99):
        assert st["ttft"][f"p{p}"] == pytest.approx(np.percentile(ttft, p))
        assert st["itl"][f"p{p}"] == pytest.approx(np.percentile(gaps, p))
        assert st["tail_itl"]["per_request_max"][f"p{p}"] == pytest.approx(np.percentile(maxes, p))
        assert st["tail_itl"]["per_request_p99"][f"p{p}"] == pytest.approx(np.percentile(p99s, p))
    window = max(r["start_time"] + r["end"] for r in measured) - min(r["start_time"] for r in measured)
    assert st["throughput"]["output_tokens_per_s"] == pytest.approx(sum(r["output_tokens"] for r in measured) / window)
    assert st["throughput"]["requests_per_s"] == pytest.approx(20 / window)
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in measured]
    assert st["tpot"]["p50"] == pytest.approx(np.percentile(tpot, 50))
    assert st["itl"]["unit"] == "token"


def test_same_seed_sends_identical_bodies(sim: str, tmp_path: Path) -> None:
    def bodies(seed: str, name: str) -> dict:
        journal(sim, clear=True)
        _, reqs, _ = bench(tmp_path / name, sim, "--requests", "8", "--concurrency", "3", "--prompt-len", "short",
                           "--output-len", "2-6", "--seed", seed)
        seen = {e["headers"]["x-request-id"]: e["body"] for e in journal(sim)}
        return {r["index"]: seen[r["request_id"]] for r in reqs}

    a, b, c = bodies("9", "a.jsonl"), bodies("9", "b.jsonl"), bodies("10", "c.jsonl")
    assert a == b and sorted(a) == list(range(8))
    assert all(a[i]["prompt"] != c[i]["prompt"] for i in a)


def test_failures_are_counted_with_reasons(tmp_path: Path) -> None:
    proc, url = start_sim("single", "--time-scale", "0.5", "--error-rate", "0.25", "--error-status", "503",
                          "--disconnect-rate", "0.2", "--disconnect-after-chunks", "2", "--seed", "3")
    try:
        wl = tmp_path / "w.yaml"
        wl.write_text("requests: 40\nseed: 1\nclasses:\n"
                      "  - {name: ok, prompt: 10, output: 6, concurrency: 3}\n"
                      "  - {name: long, prompt: 4600, output: 4, concurrency: 1, requests: 3}\n")
        _, reqs, summary = bench(tmp_path / "f.jsonl", url, "--workload", str(wl))
    finally:
        proc.stop()
    assert len(reqs) == 40
    reasons: dict[str, int] = {}
    for r in reqs:
        if not r["ok"]:
            reasons[r["error"]] = reasons.get(r["error"], 0) + 1
            assert r["ttft"] is None or r["error"] in ("stream_broken", "incomplete_stream")
    # prompts just under max-model-len are sent and counted (400s would be the bench's fault) ...
    long = [r for r in reqs if r["class"] == "long"]
    assert len(long) == 3 and all(r["status"] != 400 for r in long)
    assert all(r["prompt_tokens"] == 4600 for r in long if r["ok"])
    # ... the injected 503s and cut streams show up with their own reasons
    assert reasons.get("http_503", 0) > 0
    assert reasons.get("stream_broken", 0) + reasons.get("incomplete_stream", 0) > 0
    st = summary["stats"]["requests"]
    assert st["errors"] == reasons and st["failed"] == sum(reasons.values())
    assert st["error_rate"] == pytest.approx(sum(reasons.values()) / 40)
    assert summary["stats"]["ttft"]["count"] == 40 - st["failed"]


def test_connection_refused_is_a_failure_not_a_crash(tmp_path: Path) -> None:
    dead = f"http://{HOST}:{free_port()}"
    _, reqs, summary = bench(tmp_path / "d.jsonl", dead, "--requests", "3", "--concurrency", "1", expect=1)
    assert [r["error"] for r in reqs] == ["connect_error"] * 3
    assert summary["stats"]["requests"]["error_rate"] == 1.0


def test_workload_over_the_servers_limit_stops_before_the_run(tmp_path: Path) -> None:
    proc, url = start_sim("single", "--preset", "instant", "--max-model-len", "2048")
    try:
        journal(url, clear=True)
        p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", url, "--out", str(tmp_path / "x.jsonl"),
                            "--no-progress", "--requests", "3", "--concurrency", "1", "--prompt-len", "2000",
                            "--output-len", "64"], capture_output=True, text=True, timeout=60)
        sent = journal(url)
    finally:
        proc.stop()
    assert p.returncode == 2 and "Traceback" not in p.stderr
    msg = " ".join(p.stderr.split())
    assert "prompts up to 2000 tokens + outputs up to 64 tokens = 2064 tokens, over the server's max_model_len of " \
           "2048" in msg
    assert sent == [] and not (tmp_path / "x.jsonl").exists()  # not one request, not one record


def test_chat_prompts_are_counted_through_the_template(sim: str, tmp_path: Path) -> None:
    journal(sim, clear=True)
    _, reqs, _ = bench(tmp_path / "chat.jsonl", sim, "--endpoint", "chat", "--requests", "6", "--concurrency", "2",
                       "--prompt-len", "100-300", "--output-len", "7", "--seed", "2")
    seen = {e["headers"]["x-request-id"]: e["body"] for e in journal(sim)}
    for r in reqs:
        assert r["ok"] and r["prompt_tokens"] == r["prompt_tokens_requested"] and 100 <= r["prompt_tokens"] <= 300
        assert r["output_tokens"] == 7 and seen[r["request_id"]]["min_tokens"] == 7
    assert len({r["prompt_tokens"] for r in reqs}) > 1
    short = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", sim, "--endpoint", "chat",
                            "--out", str(tmp_path / "s.jsonl"), "--no-progress", "--requests", "1",
                            "--concurrency", "1", "--prompt-len", "5"], capture_output=True, text=True, timeout=60)
    assert short.returncode == 2 and "shorter than what every prompt starts with" in " ".join(short.stderr.split())


def test_chat_ttft_skips_the_role_chunk(sim: str, tmp_path: Path) -> None:
    _, reqs, _ = bench(tmp_path / "c.jsonl", sim, "--endpoint", "chat", "--requests", "4", "--concurrency", "2",
                       "--prompt-len", "40", "--output-len", "5")
    assert all(r["ok"] and r["chunks"] == 5 == r["output_tokens"] for r in reqs), reqs


def test_sweep_runs_one_file_per_value(sim: str, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", sim, "--out-dir", str(tmp_path),
                        "--no-progress", "--requests", "6", "--concurrency", "1", "--prompt-len", "10",
                        "--output-len", "3", "--sweep", "concurrency=1,3", "--label", "sw"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    files = [Path(x) for x in p.stdout.splitlines() if x.endswith(".jsonl")]
    assert len(files) == 2
    heads = [read(f)[0] for f in files]
    assert [h["workload"]["classes"][0]["concurrency"] for h in heads] == [1, 3]
    assert [h["sweep"] for h in heads] == [{"axis": "concurrency", "value": "1"}, {"axis": "concurrency", "value": "3"}]
    assert [h["label"] for h in heads] == ["sw-concurrency=1", "sw-concurrency=3"]
    assert all(len(read(f)[1]) == 6 for f in files)


def test_poisson_rate_for_a_duration(sim: str, tmp_path: Path) -> None:
    _, reqs, summary = bench(tmp_path / "p.jsonl", sim, "--rate", "25", "--arrival", "poisson", "--duration", "1.2",
                             "--warmup-seconds", "0.2", "--prompt-len", "10", "--output-len", "3", "--seed", "4")
    assert 12 <= len(reqs) <= 60
    offsets = sorted(r["start_offset"] for r in reqs)
    assert offsets[-1] < 1.25
    assert all(r["warmup"] == (r["start_offset"] < 0.2) for r in reqs)
    assert summary["stats"]["requests"]["warmup"] == sum(r["warmup"] for r in reqs) > 0


def test_fixed_corpus_in_order_and_save_text(sim: str, tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    prompts = [{"prompt": "alpha beta gamma", "max_tokens": 2}, {"prompt": "one two three four five"},
               {"prompt": "x y", "max_tokens": 4}]
    corpus.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    journal(sim, clear=True)
    _, reqs, _ = bench(tmp_path / "k.jsonl", sim, "--corpus", str(corpus), "--requests", "5", "--concurrency", "1",
                       "--output-len", "3", "--save-text")
    seen = {e["headers"]["x-request-id"]: e["body"] for e in journal(sim)}
    sent = [(seen[r["request_id"]]["prompt"], seen[r["request_id"]]["max_tokens"]) for r in sorted(reqs, key=lambda r: r["index"])]
    assert sent == [("alpha beta gamma", 2), ("one two three four five", 3), ("x y", 4), ("alpha beta gamma", 2),
                    ("one two three four five", 3)]
    assert all(isinstance(r["text"], str) and r["text"] for r in reqs)  # kept only because of --save-text
    assert [r["prompt_tokens_requested"] for r in reqs] == [None] * 5  # sent as they are, counted by the server
    # a corpus prompt over the server's limit stops the run before it starts, naming the prompt
    corpus.write_text(json.dumps({"prompt": "word " * 2400, "max_tokens": 8}) + "\n")  # >= 2 tokens a word
    p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", sim, "--corpus", str(corpus), "--out",
                        str(tmp_path / "big.jsonl"), "--no-progress", "--requests", "1", "--concurrency", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and f"{corpus}: prompt 1 has" in " ".join(p.stderr.split()), p.stderr


def test_without_tokenize_lengths_are_refitted_from_usage_and_said_once(tmp_path: Path) -> None:
    """A server without /tokenize: text at a guessed ratio, corrected from the answers' usage.prompt_tokens."""
    sim_proc, sim_url = start_sim("single", "--preset", "instant", "--tokens-per-word", "2.8",
                                  "--max-model-len", "4608")
    port = free_port()
    backend = Proc([sys.executable, str(Path(__file__).with_name("no_tokenize_backend.py")), "--port", str(port),
                    "--upstream", sim_url], name="no-tokenize")
    url = f"http://{HOST}:{port}"
    try:
        backend.wait_http(url + "/health")
        out = tmp_path / "u.jsonl"
        p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", url, "--out", str(out), "--no-progress",
                            "--requests", "12", "--concurrency", "1", "--prompt-len", "1000", "--output-len", "4"],
                           capture_output=True, text=True, timeout=120)
        over = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", url, "--out",
                               str(tmp_path / "o.jsonl"), "--no-progress", "--requests", "1", "--concurrency", "1",
                               "--prompt-len", "4600", "--output-len", "64"], capture_output=True, text=True, timeout=60)
    finally:
        backend.stop()
        sim_proc.stop()
    assert p.returncode == 0, p.stderr
    err = " ".join(p.stderr.split())
    assert err.count("has no /tokenize") == 1 and "refitted from the answers' usage.prompt_tokens" in err
    header, reqs, _ = read(out)
    assert header["prompts"]["method"] == "usage"
    got = [r["prompt_tokens"] for r in reqs]
    assert got[0] > 1150  # built at 2.3 tokens per word; this server makes 2.8
    assert all(abs(n - 1000) < 30 for n in got[3:]), got  # refitted after the first answers
    assert all(r["output_tokens"] == 4 for r in reqs)
    # the limit comes from /v1/models then: still no request over it
    assert over.returncode == 2 and "over the server's max_model_len of 4608" in " ".join(over.stderr.split())


def test_a_model_the_server_does_not_serve_stops_before_the_run(sim: str, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", sim, "--model", "nope", "--out",
                        str(tmp_path / "m.jsonl"), "--no-progress", "--requests", "1", "--concurrency", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "/tokenize answered HTTP 404: The model `nope` does not exist." in " ".join(p.stderr.split())


def test_without_model_the_served_one_is_asked_for(tmp_path: Path) -> None:
    """Before: --model defaulted to sim-model and anything else failed with a bare 404 per request."""
    proc, url = start_sim("single", "--time-scale", "0.2", "--model", "llama-served")
    try:
        journal(url, clear=True)
        header, reqs, _ = bench(tmp_path / "r.jsonl", url, "--requests", "4", "--concurrency", "2",
                                "--prompt-len", "20", "--output-len", "4")
        assert header["workload"]["model"] == "llama-served" and all(r["ok"] for r in reqs)
        assert {e["body"]["model"] for e in journal(url)} >= {"llama-served"}
    finally:
        proc.stop()
