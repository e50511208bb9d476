"""With tracing off (--no-tracing) the proxy makes no spans, yet a client's trace context still reaches
both legs untouched: vLLM's `llm_request` spans of the prefill and of the decode join the client's
trace, children of the client's span, with its tracestate. Real processes on loopback: P/D sims that
write their spans to files, and the proxy as a server."""

from __future__ import annotations

import httpx

from procs import start_proxy, start_sim
from real_traces import otlp_spans

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACESTATE = "vendor=opaque-value"


def test_client_context_reaches_both_legs_with_tracing_off(tmp_path):
    files = {role: tmp_path / f"vllm-{role}.jsonl" for role in ("prefill", "decode")}
    procs = []
    try:
        for role, path in files.items():
            proc, url = start_sim(role, "--time-scale", "0.2", "--otlp-traces-file", str(path))
            procs.append((proc, url))
        proxy, url = start_proxy("--prefill", procs[0][1], "--decode", procs[1][1], "--no-tracing")
        procs.append((proxy, url))
        body = {"model": "sim-model", "prompt": "a b c d", "max_tokens": 3}
        traced = httpx.post(url + "/v1/completions", json=body, timeout=30, headers={
            "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": TRACESTATE, "X-Request-Id": "ctx-1"})
        assert traced.status_code == 200, traced.text
        plain = httpx.post(url + "/v1/completions", json=body, timeout=30, headers={"X-Request-Id": "plain-1"})
        assert plain.status_code == 200, plain.text
    finally:
        for proc, _ in reversed(procs):
            proc.stop()  # the sims flush their spans on the way out
    for role, path in files.items():
        spans = [sp for _, _, sp in otlp_spans(path) if sp["name"] == "llm_request"]
        assert len(spans) == 2, (role, len(spans))
        joined = [sp for sp in spans if sp["traceId"] == TRACE_ID]
        assert len(joined) == 1, (role, [sp["traceId"] for sp in spans])
        assert joined[0].get("parentSpanId") == PARENT_ID, (role, joined[0].get("parentSpanId"))
        assert joined[0].get("traceState", "") == TRACESTATE, (role, joined[0].get("traceState"))
        # without a client context the proxy, tracing nothing, sends none: vLLM starts its own trace
        (own,) = [sp for sp in spans if sp["traceId"] != TRACE_ID]
        assert not own.get("parentSpanId"), (role, own.get("parentSpanId"))
