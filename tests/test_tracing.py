"""One trace per request with four stage spans, exported to real OTLP receivers."""

import json
import time

import httpx
import numpy as np
import pytest

from otlp import GrpcReceiver, TapReceiver, attrs, duration_ns
from procs import free_port, start_proxy, start_scripted
from waits import scaled, wait_until

BODY = {"model": "tiny", "prompt": "one two three", "max_tokens": 16, "stream": True}
CLIENT_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"


def chunk(text, completion_tokens=None, finish=None):
    event = {"id": "cmpl-t", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if completion_tokens is not None:
        event["usage"] = {"prompt_tokens": 3, "completion_tokens": completion_tokens, "total_tokens": 3 + completion_tokens}
    return "data: " + json.dumps(event) + "\n\n"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    tap = TapReceiver()
    p_proc, p_url = start_scripted("prefill")
    d_proc, d_url = start_scripted("decode")
    proxy, url = start_proxy("--prefill", p_url, "--decode", d_url, "--prefill-retries", "0", "--decode-retries", "0",
                             "--served-model-name", "tiny",  # the scripted instances list another name
                             "--otlp-endpoint", tap.endpoint, "--otlp-protocol", "http/protobuf",
                             "--trace-file", str(trace_file), "--run-label", "trace-test",
                             "--resource-attr", "vllm.version=0.23.0", "--resource-attr", "gpu.kind=H200",
                             "--health-check-interval", "0", env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        yield {"tap": tap, "p": p_url, "d": d_url, "url": url, "file": trace_file}
    finally:
        for proc in (proxy, p_proc, d_proc):
            proc.stop()
        tap.stop()


def script(url, *steps):
    httpx.post(url + "/_reset", json={})
    httpx.post(url + "/_script", json=list(steps))


CLIENT = httpx.Client(timeout=20)  # built once: building one costs tens of ms, which is not TTFT


def stream(url, body=BODY, headers=None):
    """Client-side truth: when the request left, when each event arrived."""
    started = time.monotonic()
    arrivals, text = [], ""
    with CLIENT.stream("POST", url + "/v1/completions", json=body, headers=headers or {}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
            text += line + "\n"
    return r, started, arrivals, text


def by_name(spans):
    return {s["name"]: s for s in spans}


def test_span_tree_continues_the_client_trace_and_reaches_the_instances(traced):
    script(traced["d"], {"chunks": [chunk(f" w{i}") for i in range(6)] + ["data: [DONE]\n\n"], "chunk_delay": 0.02})
    script(traced["p"])
    r, *_ = stream(traced["url"], headers={"traceparent": CLIENT_PARENT, "tracestate": "vendor=1"})
    spans = traced["tap"].trace(CLIENT_TRACE, 5)
    named = by_name(spans)
    assert set(named) == {"text_completion tiny", "pd.queue", "pd.prefill", "pd.kv_transfer", "pd.decode"}
    root = named["text_completion tiny"]
    assert root["parentSpanId"] == "b7ad6b7169203331" and root["kind"] == 2  # SERVER, child of the client's span
    for name, kind in (("pd.queue", 1), ("pd.prefill", 3), ("pd.kv_transfer", 1), ("pd.decode", 3)):
        assert named[name]["parentSpanId"] == root["spanId"] and named[name]["kind"] == kind
    # each instance got traceparent naming its leg's span, and the client's tracestate
    p_seen = httpx.get(traced["p"] + "/_journal").json()[0]["headers"]
    d_seen = httpx.get(traced["d"] + "/_journal").json()[0]["headers"]
    assert p_seen["traceparent"] == f"00-{CLIENT_TRACE}-{named['pd.prefill']['spanId']}-01"
    assert d_seen["traceparent"] == f"00-{CLIENT_TRACE}-{named['pd.decode']['spanId']}-01"
    assert p_seen["tracestate"] == d_seen["tracestate"] == "vendor=1"
    a = attrs(root)
    assert a["pd.request_id"] == r.headers["x-request-id"] and a["gen_ai.operation.name"] == "text_completion"
    assert a["pd.prefill.instance"] == traced["p"].removeprefix("http://")
    assert a["pd.run"] == "trace-test" and a["http.response.status_code"] == 200


@pytest.fixture(scope="module")
def every_gap(traced):
    """A second proxy on the same instances whose stall threshold is 0: every gap it measured is a
    `pd.stall` event on pd.decode, so its ITL figures can be checked against its own record exactly."""
    proxy, url = start_proxy("--prefill", traced["p"], "--decode", traced["d"], "--prefill-retries", "0",
                             "--decode-retries", "0", "--served-model-name", "tiny", "--stall-threshold", "0",
                             "--otlp-endpoint", traced["tap"].endpoint, "--otlp-protocol", "http/protobuf",
                             "--health-check-interval", "0", env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        yield {**traced, "url": url}
    finally:
        proxy.stop()


def recorded_gaps(decode_span, count):
    """The proxy's own gaps, per unit, from its pd.stall events (threshold 0; a gap of exactly 0 ns, two
    events in one read, is no event); with each event's (start ns, gap s, tokens)."""
    events = [(int(e["timeUnixNano"]), attrs(e)["pd.stall.duration"], attrs(e)["pd.stall.tokens"])
              for e in decode_span.get("events", []) if e["name"] == "pd.stall"]
    per_unit = [gap / k for _, gap, k in events for _ in range(k)]
    return sorted(per_unit + [0.0] * (count - len(per_unit))), events


def test_ttft_is_the_sum_of_stages_and_matches_the_client(every_gap):
    """What the proxy measured lies inside what the client saw (one monotonic clock for both), contains
    what the instances were scripted to spend, and its ITL figures are those of the gaps it recorded."""
    script(every_gap["p"], {"delay": 0.05})
    script(every_gap["d"], {"delay": 0.03, "chunks": [chunk(f" w{i}") for i in range(8)] + ["data: [DONE]\n\n"],
                            "chunk_delay": 0.025})
    r, started, arrivals, _ = stream(every_gap["url"])
    named = by_name(_trace_of(every_gap, r.headers["x-request-id"]))
    a = attrs(named["text_completion tiny"])
    ttft = a["gen_ai.response.time_to_first_chunk"]
    assert 0.08 < ttft <= arrivals[0] - started  # prefill 50 ms + decode 30 ms were inside it; the client's outside
    stages_ns = sum(duration_ns(named[s]) for s in ("pd.queue", "pd.prefill", "pd.kv_transfer"))
    assert abs(ttft * 1e9 - stages_ns) < 1000  # exact up to float rounding
    client_gaps = [b - a_ for a_, b in zip(arrivals, arrivals[1:])]
    assert a["pd.itl.count"] == len(client_gaps) == 7 and a["pd.itl.unit"] == "chunk"
    gaps, events = recorded_gaps(named["pd.decode"], 7)
    assert a["pd.stalls"] == len(events) and len(events) >= 1
    assert a["pd.itl.mean"] == pytest.approx(sum(gaps) / 7, abs=1e-6)
    assert a["pd.itl.p50"] == pytest.approx(float(np.percentile(gaps, 50)), abs=1e-6)
    assert a["pd.itl.p99"] == pytest.approx(float(np.percentile(gaps, 99)), abs=1e-6)
    assert a["pd.itl.max"] == pytest.approx(gaps[-1], abs=1e-6) and a["pd.itl.max"] >= a["pd.itl.p99"] >= a["pd.itl.p50"]
    # the proxy saw its first and last chunk between the request leaving and the client's last chunk
    assert 0 < sum(gaps) <= arrivals[-1] - started
    first_chunk = int(named["text_completion tiny"]["startTimeUnixNano"]) + ttft * 1e9
    assert min(start for start, _, _ in events) >= first_chunk - 1e4  # no gap before the first chunk (10 µs rounding)
    assert max(start + gap * 1e9 for start, gap, _ in events) <= int(named["pd.decode"]["endTimeUnixNano"]) + 1e4
    kv = attrs(named["pd.kv_transfer"])
    assert kv["pd.kv_transfer.definition"] == "upper_bound"
    assert 0 <= kv["pd.handoff.gap"] < duration_ns(named["pd.kv_transfer"]) / 1e9
    assert kv["pd.kv_transfer.estimated"] == pytest.approx(duration_ns(named["pd.kv_transfer"]) / 1e9 - a["pd.itl.p50"],
                                                           abs=1e-6)


def test_gaps_are_per_token_when_the_stream_reports_usage(every_gap):
    # 3 events carrying 1, 2 and 3 tokens (continuous usage stats), then a stall
    events = [chunk("a", 1), chunk("bc", 3), chunk("def", 6)]
    script(every_gap["p"])
    script(every_gap["d"], {"chunks": events + ["data: [DONE]\n\n"], "chunk_delay": 0.03, "stall_after": 2,
                            "stall": 0.2})
    r, *_ = stream(every_gap["url"], {**BODY, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    named = by_name(_trace_of(every_gap, r.headers["x-request-id"]))
    a = attrs(named["text_completion tiny"])
    assert a["pd.itl.unit"] == "token" and a["pd.itl.count"] == 5  # 2 + 3 tokens after the first event
    assert a["gen_ai.usage.output_tokens"] == 6
    gaps, recorded = recorded_gaps(named["pd.decode"], 5)
    assert [k for _, _, k in recorded] == [2, 3]  # one event per gap, with the tokens of the event that ended it
    stall = recorded[1][1]
    assert a["pd.itl.max"] == pytest.approx(stall / 3, abs=1e-6)  # the stall spread over its 3 tokens
    assert a["pd.itl.max"] == pytest.approx(gaps[-1], abs=1e-6)
    assert stall >= recorded[0][1]  # the scripted 0.2 s pause is the longer gap


def test_stalls_are_counted_per_token_against_the_threshold():
    """The rule behind pd.stalls, on fixed times: a gap counts when its per-token share is above the threshold."""
    from pdproxy.telemetry.measure import Timeline, measure

    ms = 1_000_000
    times = [0, 30 * ms, 260 * ms]  # 30 ms, then 230 ms before an event of 3 tokens: 77 ms per token

    def stalls(tokens, threshold):
        m = measure(Timeline(received=0), pd_mode=False, status=200, failed_stage=None, error_type=None,
                    chunk_times=times, chunk_tokens=tokens, usage=None, server_metrics=None, stall_threshold=threshold)
        return m.stalls, m.itl_unit

    assert stalls([1, 2, 3], 0.1) == (0, "token")  # 0.23 s / 3 tokens stays under 0.1 s per token
    assert stalls([1, 2, 3], 0.07) == (3, "token")  # above it: each of the 3 tokens' share is a stall
    assert stalls([], 0.1) == (1, "chunk")  # token counts unknown: per event


def test_failed_requests_have_complete_error_traces(traced):
    script(traced["p"], {"status": 500, "body": {"error": {"message": "boom"}}})
    script(traced["d"])
    r, *_ = stream(traced["url"])
    assert r.status_code == 502
    named = by_name(_trace_of(traced, r.headers["x-request-id"], count=3))
    root = named["text_completion tiny"]
    assert root["status"]["code"] == 2 and attrs(root)["pd.failed_stage"] == "prefill"
    assert attrs(root)["error.type"] == "upstream_5xx" and attrs(root)["http.response.status_code"] == 502
    assert named["pd.prefill"]["status"]["code"] == 2 and named["pd.queue"]["status"]["code"] != 2

    script(traced["p"])
    script(traced["d"], {"abort_after": 2})
    r, *_ = stream(traced["url"])
    named = by_name(_trace_of(traced, r.headers["x-request-id"]))
    assert attrs(named["text_completion tiny"])["pd.failed_stage"] == "decode"
    assert named["pd.decode"]["status"]["code"] == 2


def test_trace_file_holds_otlp_json_with_the_fixed_conditions(traced):
    script(traced["p"])
    script(traced["d"])
    r, *_ = stream(traced["url"])
    rid = r.headers["x-request-id"]
    deadline = time.monotonic() + scaled(5)
    while rid not in traced["file"].read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [json.loads(line) for line in traced["file"].read_text().splitlines()]
    resource = {a["key"]: list(a["value"].values())[0] for a in lines[0]["resourceSpans"][0]["resource"]["attributes"]}
    assert resource["service.name"] == "pdproxy" and resource["pd.run"] == "trace-test"
    assert resource["vllm.version"] == "0.23.0" and resource["gpu.kind"] == "H200" and resource["pd.mode"] == "pd"
    spans = [s for line in lines for rs in line["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert all(len(s["traceId"]) == 32 and len(s["spanId"]) == 16 for s in spans)
    assert any(attrs(s).get("pd.request_id") == rid for s in spans)


def test_metrics_come_from_the_same_measurement_with_exemplars(traced):
    script(traced["p"])
    script(traced["d"])
    r, *_ = stream(traced["url"])
    root = by_name(_trace_of(traced, r.headers["x-request-id"]))["text_completion tiny"]
    text = httpx.get(traced["url"] + "/metrics", headers={"Accept": "application/openmetrics-text"}).text
    assert f'trace_id="{root["traceId"]}"' in text  # the newest request is the exemplar on its buckets
    assert "pdproxy_request_itl_max_seconds_bucket" in text and 'stage="kv_transfer"' in text


def test_single_mode_emits_the_same_tree_without_kv_transfer(traced):
    tap = traced["tap"]
    proxy, url = start_proxy("--decode", traced["d"], "--otlp-endpoint", tap.endpoint, "--otlp-protocol",
                             "http/protobuf", "--health-check-interval", "0", "--served-model-name", "tiny",
                             env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        script(traced["d"], {"delay": 0.04})
        r, started, arrivals, _ = stream(url, headers={"traceparent": "00-11111111111111111111111111111111-2222222222222222-01"})
        named = by_name(tap.trace("11111111111111111111111111111111", 4))
        assert set(named) == {"text_completion tiny", "pd.queue", "pd.prefill", "pd.decode"}
        a = attrs(named["text_completion tiny"])
        assert a["pd.mode"] == "single"
        assert abs((duration_ns(named["pd.queue"]) + duration_ns(named["pd.prefill"])) / 1e9
                   - a["gen_ai.response.time_to_first_chunk"]) < 1e-6
        seen = httpx.get(traced["d"] + "/_journal").json()[0]["headers"]["traceparent"]
        assert seen.split("-")[2] == named["pd.prefill"]["spanId"]
    finally:
        proxy.stop()


def test_span_names_and_model_attributes_are_bounded_to_served_models(traced):
    """A client-chosen model name never names a span nor fills the attribute the collector keys on;
    names the instance lists in /v1/models do, and an answer can pick among them but not add one."""
    tap = traced["tap"]
    proxy, url = start_proxy("--decode", traced["d"], "--otlp-endpoint", tap.endpoint, "--otlp-protocol",
                             "http/protobuf", "--health-check-interval", "0", env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    stages = ("pd.queue", "pd.prefill", "pd.decode")

    def traced_request(trace_id, model, steps=()):
        script(traced["d"], *steps)
        stream(url, {**BODY, "model": model}, headers={"traceparent": f"00-{trace_id}-2222222222222222-01"})
        return by_name(tap.trace(trace_id, 4))

    try:
        wait_until(lambda: "scripted-model" in httpx.get(url + "/status").json()["model_labels"]["learned"],
                   "the proxy to read the instance's /v1/models (right after start-up)")

        named = traced_request("a" * 32, "made-up-1")  # served by nobody: the instance answers without `model`
        assert set(named) == {"text_completion", *stages}
        root = attrs(named["text_completion"])
        assert root["gen_ai.request.model"] == "other" and root["pd.request.model"] == "made-up-1"
        assert {attrs(named[s])["gen_ai.request.model"] for s in stages} == {"other"}

        named = traced_request("b" * 32, "scripted-model")  # listed by the instance's /v1/models
        assert set(named) == {"text_completion scripted-model", *stages}
        root = attrs(named["text_completion scripted-model"])
        assert root["gen_ai.request.model"] == "scripted-model" and "pd.request.model" not in root

        def answered_as(model):
            answer = {"id": "cmpl-m", "model": model, "choices": [{"index": 0, "text": " a", "finish_reason": None}]}
            return [{"chunks": ["data: " + json.dumps(answer) + "\n\n", "data: [DONE]\n\n"]}]

        # an answer naming the requested model (an echoing server) teaches nothing: only listings do
        named = traced_request("c" * 32, "answered-model", answered_as("answered-model"))
        assert "text_completion" in named and attrs(named["text_completion"])["gen_ai.request.model"] == "other"
        named = traced_request("d" * 32, "answered-model")
        assert attrs(named["text_completion"])["gen_ai.request.model"] == "other"
        assert httpx.get(url + "/status").json()["model_labels"]["learned"] == ["scripted-model"]
        # but it picks among known names: an alias answered by the listed model is labelled with it
        named = traced_request("e" * 32, "alias", answered_as("scripted-model"))
        assert attrs(named["text_completion scripted-model"])["gen_ai.request.model"] == "scripted-model"
    finally:
        proxy.stop()


def test_grpc_export(traced):
    receiver = GrpcReceiver()
    proxy, url = start_proxy("--decode", traced["d"], "--health-check-interval", "0", "--served-model-name", "tiny",
                             env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                  "OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        script(traced["d"])
        stream(url)
        deadline = time.monotonic() + scaled(10)
        while "pd.decode" not in receiver.span_names() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {"pd.queue", "pd.prefill", "pd.decode", "text_completion tiny"} <= set(receiver.span_names())
    finally:
        proxy.stop()
        receiver.stop()


def test_dead_collector_never_breaks_serving_and_drops_are_counted(traced):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy, url = start_proxy("--prefill", traced["p"], "--decode", traced["d"], "--otlp-endpoint", dead,
                             "--otlp-protocol", "http/protobuf", "--span-queue-size", "20", "--health-check-interval", "0",
                             env={"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
    try:
        httpx.post(traced["d"] + "/_reset", json={})
        durations = []
        for _ in range(30):
            started = time.monotonic()
            assert httpx.post(url + "/v1/completions", json={**BODY, "stream": False}, timeout=10).status_code == 200
            durations.append(time.monotonic() - started)
        assert max(durations) < scaled(1.0)  # the exporter's retries happen off the serving path
        deadline = time.monotonic() + scaled(10)
        dropped = 0.0
        while time.monotonic() < deadline:
            metrics = httpx.get(url + "/metrics").text
            dropped = sum(float(line.split()[-1]) for line in metrics.splitlines()
                          if line.startswith("pdproxy_spans_dropped_total"))
            if dropped >= 30:
                break
            time.sleep(0.2)
        assert dropped >= 30
    finally:
        proxy.stop()


def _trace_of(traced, request_id, count=5):
    """Find a request's trace by its request id attribute, then wait for all its spans."""
    deadline = time.monotonic() + scaled(10)
    while time.monotonic() < deadline:
        for s in traced["tap"].spans():
            if attrs(s).get("pd.request_id") == request_id:
                return traced["tap"].trace(s["traceId"], count)
        time.sleep(0.1)
    raise AssertionError(f"no trace for request {request_id}")
