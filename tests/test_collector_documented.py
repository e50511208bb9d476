"""The documented collector set-up works as written.

collector/README.md's block of commands is run as it is written, the real Jaeger and the real
collector of .tools/ started by those lines (`collector/run.sh`), with only the ports moved to free
loopback ones (every listener of otelcol.yaml and jaeger.yaml is an environment variable) and
`OTELCOL_DECISION_WAIT` shortened so the test takes seconds. The proxy serves simulated instances
and exports to the collector as the block's `pdproxy serve` line says. After the decision wait the
counts derived from the traces equal the proxy's own, and they stay equal with no traffic: kept
traces go to Jaeger, not back into the collector (the issue's set-up counted 262 requests as 309,
then 1,047, then 1,622 with no traffic). And `collector/run.sh` refuses, in one line, a trace store
endpoint that is the collector's own receiver.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest

from gotools import collector_binary
from jaeger import jaeger_binary
from ledgers import counter
from procs import HOST, Proc, free_port, start_proxy, start_sim
from waits import scaled, wait_until

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "collector" / "README.md"
MARK = "<!-- tests/test_collector_documented.py runs these lines as written"
DECISION_WAIT = 1.5  # seconds (OTELCOL_DECISION_WAIT); the configuration's 60 s would take minutes
REQUESTS, FAILED = 40, 3
BODY = {"model": "sim-model", "prompt": "a b c d", "max_tokens": 4, "stream": False}


def documented_lines() -> list[str]:
    """The command lines of the marked block, comments dropped."""
    text = DOC.read_text()
    block = text[text.index(MARK):].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def split(line: str) -> tuple[dict[str, str], list[str]]:
    """A shell line's leading VAR=value assignments and its words (a trailing `&` dropped)."""
    words = shlex.split(line.rstrip("&").strip())
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def moved(text: str, ports: dict[int, int]) -> str:
    """`text` with every host:port's port replaced by its free stand-in, and hosts on loopback."""
    return re.sub(r":(\d{4,5})\b", lambda m: f":{ports[int(m.group(1))]}", text)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def jaeger_trace(query: str, trace_id: str) -> list[dict]:
    try:
        with urllib.request.urlopen(f"{query}/api/v3/traces/{trace_id}", timeout=5) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return []
        raise
    return [s for rs in body["result"].get("resourceSpans", []) for ss in rs.get("scopeSpans", [])
            for s in ss.get("spans", [])]


def requests_by_stage(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            stage = re.search(label + r'="([^"]*)"', line).group(1)
            out[stage] = out.get(stage, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    lines = documented_lines()
    assert lines[0] == "collector/build.sh && tools/build-jaeger.sh"
    collector_binary(), jaeger_binary()  # the first line: both built (a no-op when fresh)
    ports = {int(p): free_port() for p in set(re.findall(r":(\d{4,5})\b", " ".join(lines)))}
    started: list[Proc] = []
    try:
        jaeger_env, jaeger_args = split(moved(lines[1], ports))
        assert jaeger_args[0] == ".tools/jaeger/jaeger"
        query = f"{HOST}:{free_port()}"  # the documented line leaves the query API on :16686
        jaeger = Proc([str(REPO / jaeger_args[0]), *jaeger_args[1:]], name="jaeger", env={
            **jaeger_env, "JAEGER_QUERY_HTTP_ENDPOINT": query, "JAEGER_QUERY_GRPC_ENDPOINT": f"{HOST}:{free_port()}",
            "JAEGER_LOG_LEVEL": "warn"})
        started.append(jaeger)
        health = jaeger_env["JAEGER_HEALTH_ENDPOINT"]
        jaeger.wait_http(f"http://{health}/status")

        collector_env, collector_args = split(moved(lines[2], ports))
        assert collector_args == ["collector/run.sh"] and "TEMPO_OTLP_ENDPOINT" in collector_env
        doc_grpc = int(re.search(r"--otlp-endpoint http://[\w.]+:(\d+)", lines[3]).group(1))
        listen = {  # what the documented line leaves at otelcol.yaml's defaults, on free loopback ports
            "OTELCOL_OTLP_GRPC_ENDPOINT": f"{HOST}:{ports[doc_grpc]}", "OTELCOL_OTLP_HTTP_ENDPOINT": f"{HOST}:{free_port()}",
            "OTELCOL_PROMETHEUS_ENDPOINT": f"{HOST}:{free_port()}", "OTELCOL_HEALTH_ENDPOINT": f"{HOST}:{free_port()}",
            "OTELCOL_TELEMETRY_HOST": HOST, "OTELCOL_TELEMETRY_PORT": str(free_port()),
            "OTELCOL_DECISION_WAIT": f"{DECISION_WAIT:g}s"}
        collector = Proc(["bash", str(REPO / collector_args[0])], name="otelcol", env={**collector_env, **listen})
        started.append(collector)
        # health_check answers 503 until every pipeline has started
        wait_until(lambda: httpx.get(f"http://{listen['OTELCOL_HEALTH_ENDPOINT']}/").status_code == 200
                   or collector.popen.poll(), "the collector to be healthy", timeout=30)
        assert collector.popen.poll() is None, collector.output()

        serve_env, serve_args = split(moved(lines[3], ports))
        assert serve_args[:2] == ["pdproxy", "serve"]
        endpoint = serve_args[serve_args.index("--otlp-endpoint") + 1]
        pre, pre_url = start_sim("prefill", "--preset", "instant")
        dec, dec_url = start_sim("decode", "--preset", "instant")
        started += [pre, dec]
        trace_file = tmp_path_factory.mktemp("documented") / "spans.jsonl"
        # the documented line's telemetry flags as written; the instances are this test's
        proxy, url = start_proxy("--otlp-endpoint", endpoint, "--run-label", "my-run", "--prefill", pre_url,
                                 "--decode", dec_url, "--decode-retries", "0", "--prefill-retries", "0",
                                 "--health-check-interval", "0", "--trace-file", str(trace_file),
                                 env={**serve_env, "OTEL_BSP_SCHEDULE_DELAY": "100"})
        started.append(proxy)
        yield {"url": url, "decode": dec_url, "query": f"http://{query}", "collector": collector, "listen": listen,
               "trace_file": trace_file, "proxy": proxy}
    finally:
        for proc in reversed(started):
            proc.stop()


def test_derived_counts_equal_the_proxys_after_decision_wait_and_do_not_grow(stack):
    r = httpx.post(stack["decode"] + "/sim/faults", json={"faults": [{"kind": "error", "status": 500,
                                                                       "times": FAILED}]})
    assert r.status_code == 200, r.text
    started = time.monotonic()
    with httpx.Client(timeout=20) as client:
        codes = [client.post(stack["url"] + "/v1/completions", json=BODY).status_code for _ in range(REQUESTS)]
    assert codes.count(200) == REQUESTS - FAILED

    proxy_metrics = lambda: httpx.get(stack["url"] + "/metrics").text  # noqa: E731
    derived = lambda: scrape(f"http://{stack['listen']['OTELCOL_PROMETHEUS_ENDPOINT']}/metrics")  # noqa: E731
    proxy_counts = requests_by_stage(proxy_metrics(), "pdproxy_requests_total", "failed_stage")
    assert sum(proxy_counts.values()) == REQUESTS and sum(v for k, v in proxy_counts.items() if k != "none") == FAILED

    def exported() -> dict:
        (otlp,) = [e for e in httpx.get(stack["url"] + "/status").json()["telemetry"]["exporters"] if e["kind"] == "otlp"]
        return otlp

    wait_until(lambda: exported()["spans_sent"] and httpx.get(stack["url"] + "/status").json()["telemetry"]["queue"][
        "spans"] == 0, "the proxy to export every span")
    # the decision wait passes for the last trace, and the sampled copies go to the trace store
    time.sleep(max(0.0, DECISION_WAIT + 2 - (time.monotonic() - started)))
    first = wait_until(lambda: (c := requests_by_stage(derived(), "pdproxy_trace_requests_total", "pd_failed_stage"))
                       == proxy_counts and c, "the trace-derived counts to equal the proxy's", timeout=15)
    telemetry = scrape(f"http://{HOST}:{stack['listen']['OTELCOL_TELEMETRY_PORT']}/metrics")
    accepted = counter(telemetry, "otelcol_receiver_accepted_spans")
    sent = exported()
    assert sent["spans_dropped"] == 0 and sent["state"] == "ok"

    # no traffic for two decision waits and the exporter's flush: nothing comes back in, nothing is counted again
    quiet = 2 * DECISION_WAIT + 1
    time.sleep(scaled(quiet))
    later = requests_by_stage(derived(), "pdproxy_trace_requests_total", "pd_failed_stage")
    telemetry = scrape(f"http://{HOST}:{stack['listen']['OTELCOL_TELEMETRY_PORT']}/metrics")
    print(f"\nproxy {proxy_counts}; from traces after the decision wait {first}, {quiet:g} s later "
          f"{later}; spans the proxy sent {sent['spans_sent']}, the collector accepted {accepted:.0f}, then "
          f"{counter(telemetry, 'otelcol_receiver_accepted_spans'):.0f}")
    assert later == proxy_counts
    assert counter(telemetry, "otelcol_receiver_accepted_spans") == accepted == sent["spans_sent"]
    assert counter(telemetry, "otelcol_exporter_sent_spans", exporter="otlp_grpc/tempo") > 0

    # the kept traces are in the trace store: every failed request's (the errors policy), whole
    failed = set()
    for line in stack["trace_file"].read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                failed |= {s["traceId"] for s in ss["spans"] if not s.get("parentSpanId")
                           and s.get("status", {}).get("code") == 2}
    assert len(failed) == FAILED
    for trace_id in failed:
        spans = wait_until(lambda: jaeger_trace(stack["query"], trace_id), f"trace {trace_id} in Jaeger")
        assert len({s["spanId"] for s in spans}) == len(spans) >= 3  # root, queue, prefill...; none twice


@pytest.mark.parametrize("endpoint", ["localhost:{port}", "127.0.0.1:{port}", "http://localhost:{port}",
                                      "[::1]:{port}"])
def test_run_sh_refuses_a_trace_store_that_is_the_collector_itself(endpoint):
    port = free_port()
    env = {"OTELCOL_OTLP_GRPC_ENDPOINT": f"0.0.0.0:{port}", "TEMPO_OTLP_ENDPOINT": endpoint.format(port=port),
           "OTELCOL_BIN": str(collector_binary())}
    r = subprocess.run(["bash", str(REPO / "collector" / "run.sh")], capture_output=True, text=True, timeout=60,
                       env={**__import__("os").environ, **env})
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"collector/check.py: error: exporter otlp_grpc/tempo sends to {env['TEMPO_OTLP_ENDPOINT']}, "
                           f"which is this collector's own otlp receiver (grpc on 0.0.0.0:{port})")


def test_the_issues_command_is_refused_and_a_store_elsewhere_is_not():
    binary = str(collector_binary())
    check = ["python3", str(REPO / "collector" / "check.py"), "--binary", binary]
    env = {**__import__("os").environ, "TEMPO_OTLP_ENDPOINT": "localhost:4317"}  # the issue's, defaults otherwise
    r = subprocess.run(check, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "own otlp receiver (grpc on 0.0.0.0:4317)" in r.stderr, r.stderr
    for store in (f"127.0.0.1:{free_port()}", "tempo.invalid:4317"):
        r = subprocess.run(check, capture_output=True, text=True, timeout=60, env={**env, "TEMPO_OTLP_ENDPOINT": store})
        assert r.returncode == 0 and not r.stderr, r.stderr


def test_readme_collector_lines_are_the_tested_ones():
    """Wherever the docs start the collector, the line is one this test runs (or `validate`)."""
    tested = set(documented_lines())
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), DOC]:
        for line in path.read_text().splitlines():
            line = line.strip()
            if re.search(r"collector/run\.sh\s*&?$|otelcol-pdproxy --config", line) and not line.startswith("#"):
                assert line in tested, f"{path.name}: {line}"
