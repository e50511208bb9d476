"""`pdproxy trace ID`: the waterfall of one recorded request, from a trace file and from trace stores' APIs.

The stores are a loopback HTTP server answering in the three JSON shapes pdproxy reads: Jaeger's
api/v3 (OTLP JSON under `result`), Jaeger's api/traces (its own span JSON, converted here
independently of pdproxy) and Tempo's /api/traces (OTLP JSON under `batches`, ids in base64).
Every source must give the same waterfall as the file.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from real_traces import REAL_TRACES, otlp_spans

REQUEST = "bench-0210e3e3-stream-42"  # a P/D stream of the 2-GPU recording
CALIBRATION = "b1c08acd-0c94-40c3-942f-8717efff7ae2"  # 1 GPU, 64 prompt tokens


def trace_cmd(*args: str, columns: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns)} if columns else {k: v for k, v in os.environ.items()
                                                                   if k != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "pdproxy", "trace", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture(scope="module")
def real():
    return REAL_TRACES


@pytest.fixture(scope="module")
def one_trace(real):
    """(trace id, [(resource, scope, span)]) of REQUEST, read without pdproxy."""
    spans = otlp_spans(real / "vllm023-pd-2gpu.otlp.jsonl.gz")
    tid = next(sp["traceId"] for _, _, sp in spans
               if any(a["key"] == "pd.request_id" and a["value"].get("stringValue") == REQUEST
                      for a in sp.get("attributes", [])))
    return tid, [s for s in spans if s[2]["traceId"] == tid]


def test_waterfall_from_a_file(real):
    p = trace_cmd(CALIBRATION, "--traces", str(real / "vllm023-pd-1gpu.otlp.jsonl.gz"), columns=80)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines)
    text = p.stdout
    for name in (" pd.prefill", " pd.kv_transfer", " pd.decode", "  vllm-prefill", "  vllm-decode"):
        assert any(line.startswith(name) for line in lines), name
    # the 591.6 ms pd.kv_transfer of this request is 544.5 ms of the decode's KV wait, the largest part
    # ... and of the 36.4 ms outside the decode's engine timers, 0.1 ms is the proxy's measured hand-off,
    # 33.2 ms the decode's intake before its engine queue, 3.1 ms HTTP (wrapped between parts)
    assert ("kv_transfer 591.6 = handoff 0.1 + decode intake 33.2 + kv wait 544.5\n"
            "    + first step 10.7 + http 3.1\n") in text
    assert "largest: kv_transfer: decode's wait for the KV 544.5 ms (83% of E2E)" in text
    # a prefix that only this request has will do; one that several have lists them, whole ids to copy
    assert trace_cmd(CALIBRATION[:8], "--traces", str(real / "vllm023-pd-1gpu.otlp.jsonl.gz"),
                     columns=80).stdout == p.stdout
    several = trace_cmd("bench-623c9df3-long-", "--traces", str(real / "vllm023-pd-1gpu.otlp.jsonl.gz"))
    assert several.returncode == 1 and not several.stdout
    listed = several.stderr.splitlines()
    assert re.match(r"pdproxy trace: 'bench-623c9df3-long-' is a prefix of (\d+) requests", listed[0]), listed[0]
    count = int(re.match(r".* of (\d+) requests", listed[0]).group(1))
    rows = [re.fullmatch(r"  (bench-623c9df3-long-\d+)  ([0-9a-f]{32})  primary, TTFT [\d,.]+ ms", x) for x in listed[1:]]
    assert count == len(rows) > 1 and all(rows), listed
    for m in rows[:2]:  # each listed id picks its request
        assert trace_cmd(m.group(1), "--traces", str(real / "vllm023-pd-1gpu.otlp.jsonl.gz")).returncode == 0
    many = trace_cmd("bench-", "--traces", str(real / "vllm023-pd-1gpu.otlp.jsonl.gz"))
    assert many.returncode == 1 and "is a prefix of 190 requests" in many.stderr and "... and 170 more" in many.stderr
    # the same waterfall at the width of a file or a pipe (100 columns): the split fits on fewer lines
    wide = trace_cmd(CALIBRATION, "--traces", str(real / "vllm023-pd-1gpu.otlp.jsonl.gz"))
    assert max(map(len, wide.stdout.splitlines())) <= 100 < max(map(len, wide.stdout.splitlines())) + 10
    assert "kv_transfer 591.6 = handoff 0.1 + decode intake 33.2 + kv wait 544.5 + first step 10.7 + http 3.1\n" \
        in wide.stdout


def test_by_trace_id_and_unknown_id(real, one_trace):
    f = str(real / "vllm023-pd-2gpu.otlp.jsonl.gz")
    by_request = trace_cmd(REQUEST, "--traces", f)
    by_trace = trace_cmd(one_trace[0], "--traces", f)
    assert by_request.returncode == by_trace.returncode == 0
    assert by_request.stdout == by_trace.stdout
    assert f"large KV arrivals (>= 1024 tok) on 127.0.0.1:8200 in its decode window: 1" in by_request.stdout
    missing = trace_cmd("no-such-request", "--traces", f)
    assert missing.returncode == 1 and "no request trace" in missing.stderr


def _b64(hex_id: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_id)).decode()


def _otlp(spans: list) -> list[dict]:
    out = []
    for res, scope, sp in spans:
        out.append({"resource": {"attributes": [{"key": k, "value": v} for k, v in res.items()]},
                    "scopeSpans": [{"scope": scope, "spans": [copy.deepcopy(sp)]}]})
    return out


def _jaeger_v1(tid: str, spans: list) -> dict:
    """Jaeger's query-API JSON for the spans (microseconds, tags, references, processes)."""
    kinds = {1: "internal", 2: "server", 3: "client"}
    processes, out = {}, []
    for res, _, sp in spans:
        pid = "p" + str(len(processes) + 1)
        processes[pid] = {"serviceName": res["service.name"]["stringValue"],
                          "tags": [{"key": k, "type": "string", "value": v.get("stringValue", "")}
                                   for k, v in res.items() if k != "service.name"]}
        tags = [{"key": "span.kind", "type": "string", "value": kinds.get(sp.get("kind"), "internal")}]
        for a in sp.get("attributes", []):
            (t, v), = a["value"].items()
            typ = {"stringValue": "string", "intValue": "int64", "doubleValue": "float64", "boolValue": "bool"}.get(t)
            if typ:
                tags.append({"key": a["key"], "type": typ, "value": int(v) if typ == "int64" else v})
        start_ns, end_ns = int(sp["startTimeUnixNano"]), int(sp["endTimeUnixNano"])
        refs = [{"refType": "CHILD_OF", "traceID": tid, "spanID": sp["parentSpanId"]}] if sp.get("parentSpanId") else []
        out.append({"traceID": tid, "spanID": sp["spanId"], "operationName": sp["name"], "references": refs,
                    "startTime": start_ns // 1000, "duration": end_ns // 1000 - start_ns // 1000, "tags": tags,
                    "logs": [], "processID": pid})
    return {"data": [{"traceID": tid, "spans": out, "processes": processes}]}


def _tempo(spans: list) -> dict:
    batches = _otlp(spans)
    for rs in batches:
        for sp in rs["scopeSpans"][0]["spans"]:
            sp["traceId"], sp["spanId"] = _b64(sp["traceId"]), _b64(sp["spanId"])
            if sp.get("parentSpanId"):
                sp["parentSpanId"] = _b64(sp["parentSpanId"])
    return {"batches": batches}


def _attr(sp: dict, key: str):
    return next((next(iter(a["value"].values())) for a in sp.get("attributes", []) if a["key"] == key), None)


@pytest.fixture(scope="module")
def store(one_trace, real):
    """A loopback server answering as Jaeger (api/v3, api/traces) and Tempo for the 2-GPU recording."""
    tid, spans = one_trace
    by_trace: dict[str, list] = {}
    for s in otlp_spans(real / "vllm023-pd-2gpu.otlp.jsonl.gz"):
        by_trace.setdefault(s[2]["traceId"], []).append(s)
    roots = {t: next((sp for _, _, sp in ss if _attr(sp, "pd.request_id")), None) for t, ss in by_trace.items()}
    answers = {
        f"/jaeger/api/v3/traces/{tid}": {"result": {"resourceSpans": _otlp(spans)}},
        f"/jaeger1/api/traces/{tid}": _jaeger_v1(tid, spans),
    }
    asked: list[str] = []

    def on_instance(instance: str, start_ns: int, end_ns: int) -> list[str]:
        return [t for t, r in roots.items() if r is not None and _attr(r, "pd.decode.instance") == instance
                and start_ns <= int(r["startTimeUnixNano"]) <= end_ns]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            asked.append(self.path)
            body = answers.get(url.path)
            q = parse_qs(url.query)
            if url.path.startswith("/tempo/api/traces/") and url.path.rsplit("/", 1)[1] in by_trace:
                body = _tempo(by_trace[url.path.rsplit("/", 1)[1]])
            if url.path == "/jaeger1/api/traces" and q["service"] == ["pdproxy"]:
                tags = json.loads(q["tags"][0])
                if tags == {"pd.request_id": REQUEST}:
                    body = {"data": [{"traceID": tid}]}
                elif "pd.decode.instance" in tags:  # search by tag and time (microseconds)
                    found = on_instance(tags["pd.decode.instance"], int(q["start"][0]) * 1000, int(q["end"][0]) * 1000)
                    body = {"data": [_jaeger_v1(t, by_trace[t])["data"][0] for t in found]}
            if url.path == "/tempo/api/search":
                if q["q"] == [f'{{ span.pd.request_id = "{REQUEST}" }}']:
                    body = {"traces": [{"traceID": tid}]}
                elif q["q"][0].startswith("{ span.pd.decode.instance = "):  # TraceQL, seconds
                    instance = q["q"][0].split('"')[1]
                    found = on_instance(instance, int(q["start"][0]) * 10**9, int(q["end"][0]) * 10**9)
                    body = {"traces": [{"traceID": t} for t in found]}
                elif q["q"] == ['{ resource.service.name = "pdproxy" }']:  # a window of traffic
                    a, b = int(q["start"][0]) * 10**9, int(q["end"][0]) * 10**9
                    found = sorted(t for t, r in roots.items() if r is not None and a <= int(r["startTimeUnixNano"]) <= b)
                    body = {"traces": [{"traceID": _b64(t)} for t in found[:int(q["limit"][0])]]}
            data = json.dumps(body).encode() if body is not None else b'{"error": "not found"}'
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", asked
    server.shutdown()
    server.server_close()


def _body(stdout: str) -> list[str]:
    """The waterfall without the lines that need other requests' traces (a store gives one trace)."""
    return [line for line in stdout.splitlines() if not line.startswith(("large KV arrivals", "  +"))]


@pytest.mark.parametrize("flag,path,ident", [
    ("--jaeger", "/jaeger", "trace"), ("--jaeger", "/jaeger1", "trace"), ("--jaeger", "/jaeger1", "request"),
    ("--tempo", "/tempo", "trace"), ("--tempo", "/tempo", "request"),
])
def test_waterfall_from_a_trace_store(store, real, one_trace, flag, path, ident):
    base, asked = store
    ref = trace_cmd(REQUEST, "--traces", str(real / "vllm023-pd-2gpu.otlp.jsonl.gz"))
    p = trace_cmd(one_trace[0] if ident == "trace" else REQUEST, flag, base + path)
    assert p.returncode == 0, p.stderr
    assert any(a.startswith(path + "/api/") for a in asked)
    if path == "/jaeger":  # this store answers api/v3 only: no search for the other requests
        assert _body(p.stdout) == _body(ref.stdout)
    else:  # the requests on the same decode around this one came from the store's search: the same view
        assert p.stdout == ref.stdout
        assert any("pd.decode.instance" in unquote(a) for a in asked)


def test_store_without_the_trace(store):
    base, _ = store
    p = trace_cmd("0" * 32, "--tempo", base + "/tempo")
    assert p.returncode == 1 and "no request trace" in p.stderr
    p = trace_cmd("0" * 32, "--jaeger", "http://127.0.0.1:9")  # nothing listens: a clear error, no traceback
    assert p.returncode == 2 and "pdproxy trace:" in p.stderr and "Traceback" not in p.stderr


def test_stalls_from_the_bench_record_with_their_cause(real):
    """The recording has no pd.stall events; the client's record gives the gaps' times."""
    p = trace_cmd(REQUEST, "--traces", str(real / "vllm023-pd-2gpu.otlp.jsonl.gz"),
                  "--records", str(real / "bench-2gpu-pd.jsonl.gz"), "--stall-threshold-ms", "40")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "stalls (bench record, above 40 ms): 1" in lines
    stall = lines[lines.index("stalls (bench record, above 40 ms): 1") + 1]
    # the 60 ms gap coincides with the arrival of a 4.5k-token prompt's KV on the same decode
    assert re.fullmatch(r"  \+[\d,.]+ ms: 6\d\.\d ms kv_arrival with bench-0210e3e3-long-\d+ \(45\d\d tok\)", stall)
    assert "!" in next(line for line in lines if line.startswith(" pd.decode"))


XPYD = REAL_TRACES.parent / "real-xpyd-2026-12-01b"  # pdproxy 2P2D in front of real vLLM 0.23 (its README)


def test_waterfall_and_report_name_where_each_leg_ran_and_why():
    """The slow TTFTs of a run can cluster on one prefill: the waterfall and the report's slowest list
    say which instance each leg ran on and the routing decision that sent it there."""
    p = trace_cmd("bench-88412b25-agent-1", "--traces", str(XPYD / "pd-a.jsonl.gz"))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[2:4] == ["prefill 127.0.0.1:8101 (cache_aware cache_miss)",
                          "decode  127.0.0.1:8201 (load_aware engine_load)"], lines[:5]
    r = subprocess.run([sys.executable, "-m", "pdproxy", "report", str(XPYD / "bench-pd-88412b25.jsonl.gz"),
                        "--traces", str(XPYD / "pd-a.jsonl.gz"), "--json", "-", "--no-table"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    slowest = json.loads(r.stdout)["runs"][0]["slowest"]["ttft"]
    assert slowest and all(set(s["placement"]) == {"prefill", "decode"} for s in slowest)
    assert all(re.fullmatch(r"127\.0\.0\.1:810[01] \(cache_aware \w+\)", s["placement"]["prefill"]) for s in slowest)
    table = subprocess.run([sys.executable, "-m", "pdproxy", "report", str(XPYD / "bench-pd-88412b25.jsonl.gz"),
                            "--traces", str(XPYD / "pd-a.jsonl.gz")], capture_output=True, text=True, timeout=120,
                           env={"COLUMNS": "140", "PATH": ""})
    first = slowest[0]
    assert f"  prefill    {first['placement']['prefill']}" in table.stdout, table.stdout[-3000:]


def test_help_names_no_option_that_does_not_exist():
    p = trace_cmd("--help")
    assert p.returncode == 0 and "LOOKBACK" not in p.stdout and "10 s before" in p.stdout


def test_report_of_a_window_in_tempo(store, real, tmp_path):
    """Tempo's search (TraceQL on the proxy's service, seconds) then each trace: the window's requests, whole."""
    base, asked = store
    starts = sorted(int(sp["startTimeUnixNano"]) for _, _, sp in otlp_spans(real / "vllm023-pd-2gpu.otlp.jsonl.gz")
                    if _attr(sp, "pd.request_id") and not sp["name"].startswith("pd."))
    a, b = starts[0] // 10**9, starts[39] // 10**9  # whole seconds, as Tempo takes them
    expected = sum(1 for t in starts if a * 10**9 <= t <= (b + 1) * 10**9)
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", "--tempo", base + "/tempo", "--start", str(a),
                        "--end", str(b), "--json", str(out), "--no-table"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    assert sum(e["stats"]["requests"]["measured"] for e in rep["runs"]) == expected >= 40
    assert all(e["engine_split"] for e in rep["runs"])  # the instances' spans came with each trace
    assert any("resource.service.name" in unquote(x) for x in asked)
