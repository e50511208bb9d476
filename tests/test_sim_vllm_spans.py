"""Simulated instances started with --otlp-traces-endpoint emit vLLM 0.23's `llm_request` span.

Real processes on loopback: P/D sims and a single sim behind two proxies writing trace files; the
decode exports over OTLP/gRPC (vLLM's default) to a real gRPC TraceService, the single sim over
OTLP/HTTP to oteltap, the prefill to an OTLP-JSON lines file (the sim's --otlp-traces-file).
The spans' shape (name, kind, scope, resource keys, attribute keys and value types, parentage,
request id) must be the recorded vLLM 0.23 spans' shape, role by role, and `pdproxy report`
splits every request with them.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from otlp import GrpcReceiver, TapReceiver
from procs import HOST, free_port, pdproxy, run as run_cmd, start_proxy
from real_traces import REAL_TRACES, otlp_spans

WORKLOAD = """
requests: 14
seed: 3
classes:
  - {name: stream, prompt: 40-60, output: 6-10, concurrency: 2}
  - {name: long, prompt: 1500, output: 2, rate: 4}
"""


def sim(role: str, service: str, *extra: str, env: dict | None = None):
    """A sim; `service` "" starts it without OTEL_SERVICE_NAME (it names itself vllm-<role>-<port>)."""
    port = free_port()
    proc = pdproxy("sim", "--role", role, "--host", HOST, "--port", str(port), "--model", "sim-model",
                   "--time-scale", "0.5", *extra, env={"OTEL_SERVICE_NAME": service, **(env or {})}, name=f"sim-{role}")
    url = f"http://{HOST}:{port}"
    proc.wait_http(url + "/health")
    return proc, url


def bench(url: str, d: Path, label: str) -> Path:
    out = d / f"{label}.jsonl"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", url, "--workload", str(d / "w.yaml"),
                        "--label", label, "--out", str(out), "--no-progress", "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return out


def _as_file_exporter(span: dict) -> None:
    """The receiver's protobuf JSON as the Collector's file exporter writes it: hex ids, integer kinds."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    for k in ("traceId", "spanId", "parentSpanId"):
        if span.get(k):
            span[k] = base64.b64decode(span[k]).hex()
    if isinstance(span.get("kind"), str):
        span["kind"] = Span.SpanKind.Value(span["kind"])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("simspans")
    (d / "w.yaml").write_text(WORKLOAD)
    grpc_rx, tap = GrpcReceiver(), TapReceiver()
    procs = []
    try:
        # the prefill as docs/reference/sim.md starts it: no OTEL_SERVICE_NAME
        pre, pre_url = sim("prefill", "", "--otlp-traces-file", str(d / "vllm-prefill.jsonl"))
        dec, dec_url = sim("decode", "vllm-decode", "--otlp-traces-endpoint", grpc_rx.endpoint)
        one, one_url = sim("single", "vllm-single", "--otlp-traces-endpoint", tap.endpoint + "/v1/traces",
                           env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
        procs += [pre, dec, one]
        pd_proxy, pd_url = start_proxy("--prefill", pre_url, "--decode", dec_url, "--trace-file", str(d / "pd.otlp"),
                                       "--run-label", "pd")
        single_proxy, single_url = start_proxy("--decode", one_url, "--trace-file", str(d / "single.otlp"),
                                               "--run-label", "single")
        procs += [pd_proxy, single_proxy]
        records = {"pd": bench(pd_url, d, "pd"), "single": bench(single_url, d, "single")}
    finally:
        for p in reversed(procs):
            p.stop()  # sims flush their batch span processors, proxies their trace files
    # the gRPC receiver's spans, as OTLP-JSON lines with hex ids (what a Collector's file exporter writes)
    with open(d / "vllm-decode.jsonl", "w") as f:
        for req in grpc_rx.requests:
            for rs in req.get("resourceSpans", []):
                for ss in rs.get("scopeSpans", []):
                    for sp in ss.get("spans", []):
                        _as_file_exporter(sp)
            f.write(json.dumps(req) + "\n")
    grpc_rx.stop()
    tap_spans = tap.spans()
    tap.stop()
    return {"dir": d, "records": records, "tap": tap_spans, "prefill_port": pre_url.rsplit(":", 1)[1]}


def _parents(files: list[Path]) -> dict[str, str]:
    """spanId → name of the proxy's spans."""
    return {sp["spanId"]: sp["name"] for f in files for _, _, sp in otlp_spans(f)}


def _shape(spans: list[tuple[dict, dict, dict]], parents: dict[str, str]) -> dict[str, dict]:
    """Per role (service, parent span name): kinds, scopes, resource keys, attribute key → value types."""
    out: dict[str, dict] = {}
    for res, scope, sp in spans:
        if sp["name"] != "llm_request" or sp.get("parentSpanId") not in parents:
            continue
        role = parents[sp["parentSpanId"]]
        s = out.setdefault(role, {"kinds": set(), "scopes": set(), "resource": set(), "attrs": set()})
        s["kinds"].add(sp["kind"])
        s["scopes"].add(scope.get("name"))
        s["resource"] |= set(res)
        # vLLM's attributes; the simulator's own (pdproxy.sim.*: which preset served) are checked apart
        s["attrs"] |= {(a["key"], next(iter(a["value"]))) for a in sp["attributes"]
                       if not a["key"].startswith("pdproxy.sim.")}
    return out


def roles(spans: list[tuple[dict, dict, dict]]) -> dict[str, str]:
    """spanId of each proxy stage span → "<pd.mode of its trace> <span name>" (e.g. "pd pd.decode")."""
    modes = {sp["traceId"]: a["value"]["stringValue"] for _, _, sp in spans
             for a in sp.get("attributes", []) if a["key"] == "pd.mode"}
    return {sp["spanId"]: f"{modes[sp['traceId']]} {sp['name']}" for _, _, sp in spans
            if sp["name"].startswith("pd.") and sp["traceId"] in modes}


def test_spans_have_the_recorded_vllm_shape(run):
    real_spans = otlp_spans(REAL_TRACES / "vllm023-pd-1gpu.otlp.jsonl.gz")
    want = _shape(real_spans, roles(real_spans))
    d = run["dir"]
    sim_spans = [s for f in (d / "vllm-prefill.jsonl", d / "vllm-decode.jsonl") for s in otlp_spans(f)]
    parents = roles([s for f in (d / "pd.otlp", d / "single.otlp") for s in otlp_spans(f)])
    got = _shape(sim_spans, parents)
    for role in ("pd pd.prefill", "pd pd.decode"):
        assert role in want and role in got, (role, sorted(want), sorted(got))
        assert got[role]["kinds"] == want[role]["kinds"] == {2}  # SERVER
        assert got[role]["scopes"] == want[role]["scopes"]
        assert got[role]["resource"] == want[role]["resource"]
        assert got[role]["attrs"] == want[role]["attrs"], role
    # the single sim's spans (OTLP/HTTP to oteltap) under the single proxy's pd.prefill, like the recording's
    tap = [sp for sp in run["tap"] if sp.get("name") == "llm_request"]
    assert {a["key"] for sp in tap for a in sp.get("attributes", []) if not a["key"].startswith("pdproxy.sim.")} \
        == {k for k, _ in want["single pd.prefill"]["attrs"]}
    # and each says which timing preset served it, so `pdproxy whatif` replays the run with that preset
    presets = {a["value"]["stringValue"] for _, _, sp in sim_spans if sp["name"] == "llm_request"
               for a in sp["attributes"] if a["key"] == "pdproxy.sim.preset"}
    assert presets == {"h200-llama8b"}
    assert tap and all(parents.get(sp.get("parentSpanId")) == "single pd.prefill" for sp in tap)


def test_spans_are_named_by_role_and_port_without_otel_service_name(run):
    d = run["dir"]
    services = {res["service.name"]["stringValue"] for f in ("vllm-prefill.jsonl", "vllm-decode.jsonl")
                for res, _, sp in otlp_spans(d / f) if sp["name"] == "llm_request"}
    # OTEL_SERVICE_NAME wins where it is set (the decode); without it, never unknown_service:python
    assert services == {f"vllm-prefill-{run['prefill_port']}", "vllm-decode"}


def test_request_ids_and_queue_meanings(run):
    d = run["dir"]
    roots = {sp["traceId"]: next(a["value"]["stringValue"] for a in sp["attributes"] if a["key"] == "pd.request_id")
             for _, _, sp in otlp_spans(d / "pd.otlp")
             if any(a["key"] == "pd.request_id" for a in sp.get("attributes", []))}
    kv = {sp["traceId"]: (int(sp["endTimeUnixNano"]) - int(sp["startTimeUnixNano"])) / 1e9
          for _, _, sp in otlp_spans(d / "pd.otlp") if sp["name"] == "pd.kv_transfer"}
    decode = [sp for _, _, sp in otlp_spans(d / "vllm-decode.jsonl") if sp["name"] == "llm_request"]
    assert len(decode) == len(roots) > 10
    for sp in decode:
        a = {x["key"]: next(iter(x["value"].values())) for x in sp["attributes"]}
        assert a["gen_ai.request.id"] == f"cmpl-{roots[sp['traceId']]}-0"
        queue, step = a["gen_ai.latency.time_in_queue"], a["gen_ai.latency.time_in_model_prefill"]
        # the decode's queue holds the KV pull: it and the first step fit inside the proxy's kv_transfer
        assert 0 < queue and queue + step < kv[sp["traceId"]]
        assert a["gen_ai.latency.time_to_first_token"] < a["gen_ai.latency.e2e"]


def test_report_splits_every_simulated_request(run):
    d = run["dir"]
    out = d / "r.json"
    files = [d / "pd.otlp", d / "single.otlp", d / "vllm-prefill.jsonl", d / "vllm-decode.jsonl"]
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", f"single={run['records']['single']}",
                        f"pd={run['records']['pd']}", *[x for f in files for x in ("--traces", str(f))],
                        "--json", str(out), "--no-table"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    by = {e["label"]: e for e in rep["runs"]}
    pd_split = by["pd"]["engine_split"]
    assert pd_split["requests"] == by["pd"]["stats"]["requests"]["ok"] and pd_split["id_mismatches"] == 0
    assert pd_split["parts"]["kv_transfer.kv_wait"]["p50"] > 0
    # the single sim sent its spans to oteltap, not to these files: its requests keep the proxy's columns only
    assert by["single"]["engine_split"] is None and by["single"]["stages"]["prefill"]["count"] > 0


STALL_WORKLOAD = """
requests: 24
seed: 4
classes:
  - {name: stream, prompt: 40, output: 40, concurrency: 3}
  - {name: long, prompt: 3000, output: 2, rate: 2}
"""


def _stall_run(d: Path, stalls: bool) -> dict:
    """A P/D run of streams plus long prompts; the report's stall attribution."""
    d.mkdir()
    (d / "w.yaml").write_text(STALL_WORKLOAD)
    # the recorded link (11.2 GB/s) moves a 3000-token KV in ~39 ms, below the 80 ms threshold here: a
    # 2.4 GB/s link makes each long prompt's pull a stall the report must see (or not, with the flag off)
    flag = ["--kv-bandwidth-gbps", "2.4", "--kv-pull-stalls-decode" if stalls else "--no-kv-pull-stalls-decode"]
    procs = []
    try:
        pre, pre_url = sim("prefill", "vllm-prefill", "--preset", "h200-llama8b-2gpu", "--time-scale", "1",
                           "--kv-bandwidth-gbps", "2.4", "--otlp-traces-file", str(d / "p.jsonl"))
        dec, dec_url = sim("decode", "vllm-decode", "--preset", "h200-llama8b-2gpu", "--time-scale", "1", *flag,
                           "--otlp-traces-file", str(d / "d.jsonl"))
        procs += [pre, dec]
        proxy, url = start_proxy("--prefill", pre_url, "--decode", dec_url, "--trace-file", str(d / "t.jsonl"))
        procs.append(proxy)
        rec = bench(url, d, "pd")
    finally:
        for p in reversed(procs):
            p.stop()
    out = d / "r.json"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", f"pd={rec}", "--stall-threshold-ms", "80",
                        *[x for f in ("t.jsonl", "p.jsonl", "d.jsonl") for x in ("--traces", str(d / f))],
                        "--json", str(out), "--no-table"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(out.read_text())["runs"][0]["stall_attribution"]


def test_decode_stalls_on_another_requests_kv_arrival(tmp_path):
    """--kv-pull-stalls-decode: streams stall while a long prompt's KV is pulled, as on two real H200s."""
    on, off = _stall_run(tmp_path / "on", True), _stall_run(tmp_path / "off", False)
    # a 3000-token KV takes ~165 ms on that link: the decode's steps wait for it
    assert on["by_cause"]["kv_arrival"]["share"] > 0.8
    assert on["by_cause"]["kv_arrival"]["time"] > 3 * off["stall_time"] + 0.2
    o = on["overlap"]
    assert o["with_large_kv_arrival"]["p50"] > 2 * o["others"]["p50"]
    # without the flag, a large KV arrival barely matters to the other streams (when any stream's decode
    # window held one: without the stall the windows are short and often miss the arrivals)
    o = off["overlap"]
    if o["with_large_kv_arrival"]["count"]:
        assert o["with_large_kv_arrival"]["p50"] < 1.5 * o["others"]["p50"] + 0.02


def test_a_dead_collector_does_not_break_serving_and_a_bad_protocol_is_refused():
    dead = f"http://{HOST}:{free_port()}"  # nothing listens there
    proc, url = sim("single", "vllm-single", "--otlp-traces-endpoint", dead, "--time-scale", "0.2")
    try:
        for _ in range(3):
            body = json.dumps({"model": "sim-model", "prompt": "a b c", "max_tokens": 4}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200 and json.loads(r.read())["choices"][0]["text"]
    finally:
        proc.stop()
    p = subprocess.run([sys.executable, "-m", "pdproxy", "sim", "--otlp-traces-endpoint", dead, "--port",
                        str(free_port())], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    assert p.returncode == 2 and "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" in p.stderr and "Traceback" not in p.stderr


def test_whatif_replays_with_the_preset_the_sims_spans_name(run):
    d = run["dir"]
    proc = run_cmd([sys.executable, "-m", "pdproxy", "whatif", "--traces", str(d / "pd.otlp"), "--traces",
                    str(d / "vllm-prefill.jsonl"), "--traces", str(d / "vllm-decode.jsonl"), "--gpus", "2",
                    "--setup", "1P1D", "--no-fit-run", "--jobs", "1"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "preset h200-llama8b: the one the recording names" in proc.stdout
    assert "Self-replay: the recorded set-up 1P1D" in proc.stdout
