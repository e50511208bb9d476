"""Degraded routing says why, on real processes (issue 43, item 1).

precise_prefix routes by the engines' KV events; when it cannot, it falls back to the approximate index. Each such
decision carries its reason on the leg span (`pd.route.fallback_reason`) and is counted per instance whose state
caused it (`pdproxy_route_fallbacks_total{role, server_address, reason}`), and /status's per-instance
`approximate_fallbacks` agrees with /metrics. Started without any KV-event flag, the proxy warns; its start-up log
names each pool's policy."""

from __future__ import annotations

import time

import httpx

from procs import HOST, free_port, start_proxy, start_sim
from real_traces import otlp_spans
from waits import scaled


def get(url: str) -> httpx.Response:
    r = httpx.get(url, timeout=scaled(20))
    r.raise_for_status()
    return r


def complete(url: str, path: str, body: dict) -> None:
    httpx.post(url + path, json={"model": "sim-model", "max_tokens": 2, **body}, timeout=scaled(20)).raise_for_status()


def fallbacks(url: str) -> dict[str, float]:
    return {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in get(url + "/metrics").text.splitlines() if line.startswith("pdproxy_route_fallbacks_total{")}


def status_fallbacks(url: str) -> dict[str, int]:
    return {i["url"][7:]: i["scores"]["approximate_fallbacks"] for i in get(url + "/status").json()["instances"]["decode"]}


def leg_reasons(trace_file, count: int) -> list[str | None]:
    deadline = time.monotonic() + scaled(10)
    while True:
        spans = [sp for _, _, sp in otlp_spans(trace_file)] if trace_file.exists() else []
        decode = [sp for sp in spans if sp["name"] == "pd.decode"]
        if len(decode) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return sorted(next((a["value"]["stringValue"] for a in sp["attributes"] if a["key"] == "pd.route.fallback_reason"),
                       None) or "" for sp in decode)


def test_fallbacks_have_a_reason_counted_per_instance(tmp_path):
    procs = []
    try:
        prefill, p_url = start_sim("prefill", "--preset", "instant")
        procs.append(prefill)
        decodes = []
        for _ in range(2):
            decode, d_url = start_sim("decode", "--preset", "instant")
            procs.append(decode)
            decodes.append(d_url)
        a, b = (u[7:] for u in decodes)
        common = ["--prefill", p_url, "--decode", decodes[0], "--decode", decodes[1], "--decode-policy",
                  "precise_prefix", "--health-check-interval", "0"]

        # no KV-event flag: warned at start; every decision falls back, counted at both candidates
        trace_file = tmp_path / "off.jsonl"
        proxy, url = start_proxy(*common, "--trace-file", str(trace_file))
        procs.append(proxy)
        for k in range(3):
            complete(url, "/v1/completions", {"prompt": f"a prompt {k}"})
        expected = {f'reason="events_off",role="decode",server_address="{address}"': 3.0 for address in (a, b)}
        assert fallbacks(url) == expected
        assert status_fallbacks(url) == {a: 3, b: 3}
        assert leg_reasons(trace_file, 3) == ["events_off"] * 3
        log = proxy.output()
        assert "precise_prefix (decode) without KV events" in log, log
        assert "prefill pool (1) by round_robin, decode pool (2) by precise_prefix" in log, log

        # events configured, nobody publishing: not flowing, counted at the instances whose stream is silent
        trace_file = tmp_path / "silent.jsonl"
        proxy, url = start_proxy(*common, "--trace-file", str(trace_file), "--kv-events-endpoint",
                                 f"tcp://{HOST}:{free_port()}", "--kv-events-replay-endpoint",
                                 f"tcp://{HOST}:{free_port()}")
        procs.append(proxy)
        for k in range(2):
            complete(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {k}"}]})
        expected = {f'reason="events_not_flowing",role="decode",server_address="{address}"': 2.0 for address in (a, b)}
        assert fallbacks(url) == expected
        assert status_fallbacks(url) == {a: 2, b: 2}
        assert leg_reasons(trace_file, 2) == ["events_not_flowing"] * 2
        assert "without KV events" not in proxy.output()
    finally:
        for proc in procs:
            proc.stop()
