"""Selective disaggregation on real processes: a prompt whose uncached part on its decode is short skips the prefill.

A simulated prefill and decode (the decode publishing its KV events), pdproxy with --pd-min-prefill-tokens 32:
a long new prompt is disaggregated; once its KV arrived on the decode (the decode's BlockStored), the same prompt
plus a few tokens goes straight to the decode (no prefill leg, no kv_transfer_params); so does a short prompt;
chat, tokenized by the decode's /tokenize, is short too. Each decision is on the root span and counted."""

from __future__ import annotations

import json
import time
import urllib.request

from procs import HOST, free_port, start_proxy, start_sim
from real_traces import otlp_spans
from waits import scaled


def post(url: str, path: str, body: dict) -> None:
    req = urllib.request.Request(url + path, data=json.dumps({"model": "sim-model", "max_tokens": 2, **body}).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": body.pop("id", "x")})
    with urllib.request.urlopen(req, timeout=scaled(20)) as r:
        assert r.status == 200


def get(url: str):
    with urllib.request.urlopen(url, timeout=scaled(10)) as r:
        text = r.read().decode()
        return json.loads(text) if r.headers.get("Content-Type", "").startswith("application/json") else text


def attrs(span: dict) -> dict:
    return {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}


def roots_chat_tokens(roots: list[dict]) -> str | None:
    """The chat request's uncached count: all its tokens, as the decode's /tokenize counted them."""
    chat = [r for r in roots if r.get("gen_ai.operation.name") == "chat"]
    return chat[0].get("pd.disaggregation.uncached_tokens") if chat else None


def test_short_uncached_prompts_skip_the_prefill(tmp_path):
    pub, replay = free_port(), free_port()
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{HOST}:{pub}",
                         "replay_endpoint": f"tcp://{HOST}:{replay}"})
    procs = []
    try:
        prefill, p_url = start_sim("prefill", "--time-scale", "0.1")
        procs.append(prefill)
        decode, d_url = start_sim("decode", "--time-scale", "0.1", "--kv-events-config", config)
        procs.append(decode)
        address = d_url.removeprefix("http://")
        trace_file = tmp_path / "proxy.jsonl"
        proxy, url = start_proxy("--prefill", p_url, "--decode", d_url, "--pd-min-prefill-tokens", "32",
                                 "--kv-events-instance", f"{address}=tcp://{HOST}:{pub}",
                                 "--kv-events-replay-instance", f"{address}=tcp://{HOST}:{replay}",
                                 "--trace-file", str(trace_file))
        procs.append(proxy)
        deadline = time.monotonic() + scaled(15)
        while not get(url + "/status")["kv_events"][address]["flowing"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        long = [1000 + k for k in range(200)]
        post(url, "/v1/completions", {"prompt": long})  # 200 uncached tokens: through the prefill
        while get(url + "/status")["kv_events"][address]["blocks"] < 12:  # its KV arrived on the decode
            assert time.monotonic() < deadline, get(url + "/status")
            time.sleep(0.02)
        post(url, "/v1/completions", {"prompt": long + list(range(5000, 5010))})  # 18 left: decode only
        post(url, "/v1/completions", {"prompt": list(range(7000, 7020))})  # 20 tokens, none cached: decode only
        # chat: tokenized by the decode's own /tokenize (its chat template), a few tokens: decode only
        post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]})

        prefilled = [e["body"] for e in get(p_url + "/sim/requests")["requests"] if e["path"].startswith("/v1/")]
        decoded = [e["body"] for e in get(d_url + "/sim/requests")["requests"] if e["path"].startswith("/v1/")]
        assert [b["prompt"][:1] for b in prefilled] == [[1000]]
        assert len(decoded) == 4
        assert ["kv_transfer_params" in b for b in decoded] == [True, False, False, False]

        metrics = get(url + "/metrics")
        counts = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("pdproxy_disaggregation_decisions_total{")}
        assert counts == {'decision="disaggregated",reason="long_uncached"': 1.0,
                          'decision="decode_only",reason="short_uncached"': 3.0}, counts
        deadline = time.monotonic() + scaled(10)
        while True:
            roots = [attrs(sp) for _, _, sp in otlp_spans(trace_file) if not sp.get("parentSpanId")]
            if len(roots) >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        verdicts = sorted((r["pd.disaggregation"], r["pd.disaggregation.reason"], r.get("pd.disaggregation.held_tokens"),
                           r.get("pd.disaggregation.uncached_tokens"), "pd.prefill.instance" in r) for r in roots)
        assert verdicts == sorted([("disaggregated", "long_uncached", "0", "200", True),
                                   ("decode_only", "short_uncached", "192", "18", False),
                                   ("decode_only", "short_uncached", "0", "20", False),
                                   ("decode_only", "short_uncached", "0", roots_chat_tokens(roots), False)]), verdicts
        assert roots_chat_tokens(roots) not in (None, "0")
    finally:
        for proc in procs:
            proc.stop()


def metric_values(text: str, name: str) -> dict[str, float]:
    return {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{")}


def traces_by_request(trace_file, count: int) -> dict[str, list[dict]]:
    """request id -> its spans (name and attributes), once `count` root spans are in the file."""
    deadline = time.monotonic() + scaled(10)
    while True:
        spans = [sp for _, _, sp in otlp_spans(trace_file)] if trace_file.exists() else []
        roots = {sp["traceId"]: attrs(sp)["pd.request_id"] for sp in spans if not sp.get("parentSpanId")}
        if len(roots) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out: dict[str, list[dict]] = {}
    for sp in spans:
        out.setdefault(roots.get(sp["traceId"], "?"), []).append({"name": sp["name"], **attrs(sp)})
    return out


def test_decode_only_counts_the_whole_prompt_and_is_traced_as_it_ran(tmp_path):
    """A prompt longer than the hashed key (65,536 tokens) is counted whole: 70,000 tokens are not "at most
    66,000 to compute". A short prompt sent decode-only shows what ran: its prompt computed on the decode, no
    prefill leg (no prefill attempts, no kv_transfer) and no prefill-stage observation."""
    procs = []
    try:
        prefill, p_url = start_sim("prefill", "--preset", "instant", "--max-model-len", "131072")
        procs.append(prefill)
        decode, d_url = start_sim("decode", "--preset", "instant", "--max-model-len", "131072")
        procs.append(decode)
        trace_file = tmp_path / "proxy.jsonl"
        proxy, url = start_proxy("--prefill", p_url, "--decode", d_url, "--pd-min-prefill-tokens", "66000",
                                 "--trace-file", str(trace_file))
        procs.append(proxy)
        post(url, "/v1/completions", {"prompt": [1000 + k % 5000 for k in range(70_000)], "id": "long"})
        post(url, "/v1/completions", {"prompt": list(range(7000, 7020)), "id": "short"})
        prefilled = [e["body"] for e in get(p_url + "/sim/requests")["requests"] if e["path"].startswith("/v1/")]
        assert [len(b["prompt"]) for b in prefilled] == [70_000]
        metrics = get(url + "/metrics")
        assert metric_values(metrics, "pdproxy_disaggregation_decisions_total") == {
            'decision="disaggregated",reason="long_uncached"': 1.0,
            'decision="decode_only",reason="short_uncached"': 1.0}
        stages = {k: v for k, v in metric_values(metrics, "pdproxy_stage_duration_seconds_count").items()}
        counts = {stage: sum(v for k, v in stages.items() if f'stage="{stage}"' in k) for stage in
                  ("prefill", "kv_transfer", "decode")}
        assert counts == {"prefill": 1.0, "kv_transfer": 1.0, "decode": 2.0}, counts

        traces = traces_by_request(trace_file, 2)
        long, short = {s["name"]: s for s in traces["long"]}, {s["name"]: s for s in traces["short"]}
        root = next(s for s in traces["long"] if "pd.disaggregation" in s)
        assert root["pd.disaggregation.uncached_tokens"] == "70000", root
        assert long["pd.prefill"]["pd.prefill.attempts"] == "1" and "pd.kv_transfer" in long
        assert f'{long["pd.prefill"]["server.address"]}:{long["pd.prefill"]["server.port"]}' == p_url[7:]
        assert "pd.kv_transfer" not in short and "pd.prefill.attempts" not in short["pd.prefill"], short
        assert f'{short["pd.prefill"]["server.address"]}:{short["pd.prefill"]["server.port"]}' == d_url[7:]
        assert short["pd.prefill"]["pd.prefill.on_decode"] is True
        assert short["pd.prefill"]["vllm.request_phase"] == "prefill"
    finally:
        for proc in procs:
            proc.stop()


def test_without_token_ids_the_request_is_disaggregated():
    from pdproxy.routing.selective import SelectiveDisaggregation
    from pdproxy.policies.request import RequestView

    rule = SelectiveDisaggregation(32)
    chat = RequestView({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert (rule.decide(chat, "d:1").decision, rule.decide(chat, "d:1").reason) == ("disaggregated", "no_token_ids")
    chat.token_ids = [1, 2, 3]  # as an instance's /tokenize gives them for a chat with a media part
    assert (rule.decide(chat, "d:1").decision, rule.decide(chat, "d:1").reason) == ("disaggregated", "not_countable")
    chat.whole = True  # ... and for a chat of text alone
    assert rule.decide(chat, "d:1").decode_only
    assert not rule.decide(RequestView({"prompt": list(range(40))}), "d:1").decode_only  # 40 > 32, none held


WORKLOAD = """
requests: 12
seed: 3
classes:
  - {name: short, prompt: 12, output: 4, concurrency: 1}
  - {name: long, prompt: 300, output: 4, concurrency: 1}
"""


def test_the_report_has_a_row_for_it(tmp_path):
    import subprocess
    import sys

    procs = []
    try:
        prefill, p_url = start_sim("prefill", "--time-scale", "0.1")
        procs.append(prefill)
        decode, d_url = start_sim("decode", "--time-scale", "0.1")
        procs.append(decode)
        proxy, url = start_proxy("--prefill", p_url, "--decode", d_url, "--pd-min-prefill-tokens", "32",
                                 "--trace-file", str(tmp_path / "proxy.jsonl"))
        procs.append(proxy)
        (tmp_path / "w.yaml").write_text(WORKLOAD)
        bench = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", url, "--workload",
                                str(tmp_path / "w.yaml"), "--label", "selective", "--out", str(tmp_path / "rec.jsonl"),
                                "--no-progress", "--quiet"], capture_output=True, text=True, timeout=scaled(120))
        assert bench.returncode == 0, bench.stderr
    finally:
        for proc in procs:
            proc.stop()
    report = subprocess.run([sys.executable, "-m", "pdproxy", "report", str(tmp_path / "rec.jsonl"), "--traces",
                             str(tmp_path / "proxy.jsonl"), "--json", str(tmp_path / "r.json")],
                            capture_output=True, text=True, timeout=scaled(120))
    assert report.returncode == 0, report.stderr
    (run,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    verdicts = run["disaggregation"]
    # no events here: nothing is known to be held, so the prompt's length decides (12 tokens: decode only; 300: disaggregated)
    assert verdicts["requests"] == 12 and 0 < verdicts["decode_only"] < 12, verdicts
    assert set(verdicts["reasons"]) == {"decode_only: short_uncached", "disaggregated: long_uncached"}
    assert "decode only (selective disaggregation)" in report.stdout
