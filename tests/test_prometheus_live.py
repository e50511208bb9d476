"""Every PromQL expression of the dashboards, executed against a real Prometheus.

Real processes on 127.0.0.1: simulated prefill/decode/single instances (`pdproxy sim`), the proxy
(`pdproxy serve`, with a shadow baseline), and Prometheus from the Debian package scraping the
proxy every second with exemplar storage on. A small aiohttp client of this file drives a bounded
load and records its own timings: TTFT, every token gap (split per token from streamed usage, as
docs/reference/telemetry.md defines it), per-request tail ITL and TPOT. Then:

* every expression of every dashboard runs as a range query with the dashboards' default variable
  values and must return data (the collector-derived series of pdproxy-traces.json do not exist
  here, with no collector: those must evaluate without error; tests/test_collector_e2e.py runs
  them all with the real collector);
* the quantile panels, evaluated over the measured window with model/deployment/run set, must agree
  with the client's numpy percentiles within the histogram's bucket resolution;
* counts, error and stall shares, exemplars and the variables' label values are checked too;
* the shipped recording rules and alerts (deploy/prometheus/rules/) load healthy, the recordings
  equal their expressions on this data, and the alerts this load should trip are pending.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import string
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import yaml

from procs import FILES, HOST, Proc, free_port, start_proxy, start_sim
from test_grafana_dashboards import load_dashboards, prom_targets, substitute, variable_values
from waits import scaled, wait_until

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "rules"
RUN = "live-test"
MODEL = "sim-model"
STALL_THRESHOLD = 0.1
SCRAPE_INTERVAL = 1.0  # seconds

# Series that only the collector's connectors produce (see collector/otelcol.yaml).
# routing by KV events: series only a proxy with --kv-events-* and precise_prefix exposes
KV_EVENT_SERIES = re.compile(r'pdproxy_kv_event|pdproxy_route_fallbacks|policy="precise_prefix"')
COLLECTOR_SERIES = re.compile(r"\b(traces_span_metrics_\w+|pdproxy_trace_\w+)")

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------------------------
# The client and its own measurements


@dataclass
class Record:
    chat: bool
    status: int = 0
    aborted: bool = False
    error: bool = False
    sent_ns: int = 0
    end_ns: int = 0
    chunk_times: list[int] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    request_id: str = ""  # sent as X-Request-Id: the proxy's pd.request_id, to match its trace

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.aborted and not self.error

    @property
    def ttft(self) -> float | None:
        return (self.chunk_times[0] - self.sent_ns) / 1e9 if self.chunk_times else None

    @property
    def per_token(self) -> bool:
        return bool(self.chunk_tokens) and all(k > 0 for k in self.chunk_tokens)

    def gaps(self) -> list[float]:
        """Token gaps as docs/reference/telemetry.md defines them, computed independently of the proxy (chunk
        gaps when the stream gave no per-chunk token counts)."""
        per_token = self.per_token
        out = []
        for i in range(1, len(self.chunk_times)):
            gap = (self.chunk_times[i] - self.chunk_times[i - 1]) / 1e9
            k = self.chunk_tokens[i] if per_token else 1
            out.extend([gap / k] * k)
        return out

    @property
    def tpot(self) -> float | None:
        n = self.completion_tokens or len(self.chunk_times)
        if n > 1 and len(self.chunk_times) > 1:
            return (self.chunk_times[-1] - self.chunk_times[0]) / 1e9 / (n - 1)
        return None


async def one_request(session: aiohttp.ClientSession, url: str, i: int, chat: bool, abort_after: int | None) -> Record:
    rec = Record(chat=chat, request_id=f"live-{i}-{time.monotonic_ns()}")
    # one-letter words are one token each in the simulator's tokenizer: 32-95 prompt tokens, which decode A's
    # 16 blocks can preempt without starving the load (longer prompts would push TTFT past the SLO alerts)
    prompt = " ".join(string.ascii_lowercase[j % 26] for j in range(32 + (i * 7) % 64))
    # every eighth without per-chunk usage: its gaps are per chunk (pdproxy_chunk_gap_seconds)
    body = {"model": MODEL, "max_tokens": 24 + (i % 3) * 8, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": i % 8 != 3}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    rec.sent_ns = time.perf_counter_ns()
    async with session.post(url + path, json=body, headers={"X-Request-Id": rec.request_id}) as resp:
        rec.status = resp.status
        if resp.status != 200:
            await resp.read()
            rec.end_ns = time.perf_counter_ns()
            return rec
        buf, seen = b"", 0
        async for data in resp.content.iter_any():
            now = time.perf_counter_ns()
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                payload = event.strip()[len(b"data:"):].strip() if event.strip().startswith(b"data:") else b""
                if not payload or payload == b"[DONE]":
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    rec.error = True
                    continue
                choices = obj.get("choices") or []
                bearing = any((c.get("delta") or {}).get("content") if chat else c.get("text") for c in choices)
                tokens = 0
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens
                    completion = usage.get("completion_tokens") or 0
                    if completion > rec.completion_tokens:
                        tokens = completion - rec.completion_tokens
                        rec.completion_tokens = completion
                        bearing = bearing or bool(choices)
                if bearing:
                    rec.chunk_times.append(now)
                    rec.chunk_tokens.append(tokens)
                    seen += 1
            if abort_after is not None and seen >= abort_after:
                rec.aborted = True
                resp.close()  # the client goes away mid-stream
                break
    rec.end_ns = time.perf_counter_ns()
    return rec


async def drive(url: str, n: int, concurrency: int, first: int = 0, abort_every: int = 0) -> list[Record]:
    queue = list(range(first, first + n))
    records: list[Record] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            i = queue.pop(0)
            abort = 3 if abort_every and i % abort_every == abort_every - 1 else None
            records.append(await one_request(session, url, i, chat=i % 4 == 1, abort_after=abort))

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return records


# ---------------------------------------------------------------------------------------------
# Prometheus


class Prometheus:
    def __init__(self, target: str) -> None:
        self.binary = shutil.which("prometheus")
        if not self.binary:
            pytest.skip("prometheus not installed (Debian package prometheus; .ci/run installs it)")
        self.dir = FILES.scratch("prometheus")
        config = {"global": {"scrape_interval": f"{SCRAPE_INTERVAL:g}s", "scrape_timeout": "1s",
                             "evaluation_interval": "1s"},
                  "rule_files": [str(RULES / "*.yml")],  # the shipped recording rules and alerts, as they are
                  "scrape_configs": [{"job_name": "pdproxy", "static_configs": [{"targets": [target]}]}]}
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        self.url = f"http://{HOST}:{port}"
        self.proc = Proc([self.binary, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
                          f"--web.listen-address={HOST}:{port}", "--enable-feature=exemplar-storage",
                          "--log.level=warn"], name="prometheus")
        self.proc.wait_http(self.url + "/-/ready", timeout=30)

    def api(self, path: str, **params) -> dict:
        data = urllib.parse.urlencode(params).encode()
        with urllib.request.urlopen(urllib.request.Request(self.url + path, data=data), timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def get(self, path: str) -> dict:
        """The endpoints that only answer GET (/api/v1/rules, /api/v1/alerts)."""
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def instant(self, expr: str, at: float) -> list[dict]:
        return self.api("/api/v1/query", query=expr, time=f"{at:.3f}")["result"]

    def range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict]:
        return self.api("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=step)["result"]

    def wait_for(self, expr: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + scaled(timeout)
        while time.monotonic() < deadline:
            if self.instant(expr, time.time()):
                return
            time.sleep(0.25)
        raise TimeoutError(f"no data for {expr}:\n{self.proc.output()}")

    def last_scrape(self) -> float:
        """When Prometheus last scraped the proxy (0 before the first scrape)."""
        got = self.instant('timestamp(up{job="pdproxy"})', time.time())
        return float(got[0]["value"][1]) if got else 0.0

    def wait_scrapes(self, n: int = 2) -> None:
        """Until n scrapes have happened after now: what the proxy counted so far is in the store, with
        a sample after it (rate() over a window from now on sees everything that follows)."""
        since = time.time()
        wait_until(lambda: self.last_scrape() >= since + (n - 1) * SCRAPE_INTERVAL, f"{n} scrapes after {since:.1f}",
                   timeout=20, interval=0.2)

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Run:
    prom: Prometheus
    records: list[Record]
    start: float
    end: float
    proxy_log: str


@pytest.fixture(scope="module")
def run() -> Run:
    procs: list[Proc] = []
    prom = None
    try:
        prefill, p_url = start_sim("prefill", "--seed", "1")
        # decode A has too little KV cache for its share of the load: running sequences get
        # preempted and stall until they are recomputed (a real decode stall, one token after a
        # long gap). Decode B fails some KV pulls (HTTP 500).
        decode_a, a_url = start_sim("decode", "--seed", "2", "--num-gpu-blocks", "16", "--max-model-len", "256",
                                    "--time-scale", "2")
        decode_b, b_url = start_sim("decode", "--seed", "3", "--kv-load-failure-rate", "0.1")
        baseline, s_url = start_sim("single", "--seed", "4")
        procs += [prefill, decode_a, decode_b, baseline]
        # spans go to a port nothing listens on: exports fail and are counted as dropped spans
        env = {"OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
        proxy, url = start_proxy("--prefill", p_url, "--decode", a_url, "--decode", b_url, "--shadow-url", s_url,
                                 "--run-label", RUN, "--decode-retries", "0", "--eject-after-failures", "0",
                                 "--health-check-interval", "1", "--stall-threshold", str(STALL_THRESHOLD),
                                 "--otlp-endpoint", f"http://{HOST}:{free_port()}", "--otlp-protocol", "http/protobuf", env=env)
        procs.append(proxy)
        prom = Prometheus(url.removeprefix("http://"))

        # Warm-up: creates the label sets (routes, both deployments) before the measured window,
        # so rate() over that window sees every observation of it.
        asyncio.run(drive(url, 16, 4, first=10_000))
        prom.wait_for(f'pdproxy_ttft_seconds_count{{deployment="shadow", route="chat_completions", run="{RUN}"}}')
        prom.wait_for('pdproxy_spans_dropped_total')
        prom.wait_scrapes(2)  # the warm-up is in the store before the window opens
        start = time.time()
        prom.wait_scrapes(1)  # a sample inside the window before the load
        records = asyncio.run(drive(url, 160, 8, abort_every=20))
        # shadow copies finish after the client's requests; the last scrapes must include them
        prom.wait_for(f'sum(pdproxy_inflight_requests) == 0 and sum(pdproxy_instance_inflight) == 0')
        prom.wait_scrapes(2)
        end = time.time()
        yield Run(prom, records, start, end, proxy.output())
    finally:
        if prom:
            prom.stop()
        for p in procs:
            p.stop()


# ---------------------------------------------------------------------------------------------
# Every expression returns data


def all_targets():
    for name, d in load_dashboards().items():
        values = variable_values(d)
        for panel, target in prom_targets(d):
            yield name, panel["title"], target, values


def test_every_dashboard_expression_returns_data(run):
    empty, collector_only, kv_events_only, checked = [], [], [], 0
    for name, title, target, values in all_targets():
        expr = substitute(target["expr"], values, "4s")
        result = run.prom.range(expr, run.start, run.end)
        has_data = any(not math.isnan(float(v)) for series in result for _, v in series["values"])
        if COLLECTOR_SERIES.search(expr) and not re.search(r"\bpdproxy_(?!trace_)\w+\{", expr):
            collector_only.append(f"{name} / {title}: {expr[:80]}")
            continue  # evaluated without error; no collector here to produce the series
        if KV_EVENT_SERIES.search(expr):
            kv_events_only.append(f"{name} / {title}")
            continue  # evaluated without error; this proxy routes without KV events (their alerts: promtool)
        checked += 1
        if not has_data:
            empty.append(f"{name} / {title}: {expr}")
    print(f"\n{checked} expressions returned data; {len(collector_only)} read collector-derived series, run with the "
          "collector in tests/test_collector_e2e.py:")
    print("\n".join("  " + c for c in collector_only))
    assert not empty, "expressions without data:\n" + "\n".join(empty) + "\n\nproxy log tail:\n" + run.proxy_log[-3000:]
    assert checked >= 55


def test_template_variables_find_their_values(run):
    d = load_dashboards()["pdproxy-overview.json"]
    for v in d["templating"]["list"]:
        if v["type"] != "query":
            continue
        metric, matchers, label = re.fullmatch(r"label_values\((\w+)(\{.*\})?, *(\w+)\)", v["definition"]).groups()
        selector = metric + substitute(matchers or "", {"run": RUN}, "1m")
        found = run.prom.api("/api/v1/series", **{"match[]": selector, "start": run.start, "end": run.end})
        values = {s.get(label) for s in found}
        expected = {"run": {RUN}, "model": {MODEL}, "deployment": {"primary", "shadow"}}[v["name"]]
        assert expected <= values, (v["name"], values)


# ---------------------------------------------------------------------------------------------
# Quantile panels agree with the client


def bounds_for(metric: str) -> tuple[float, ...]:
    from pdproxy.telemetry.names import GAP_BUCKETS, LATENCY_BUCKETS

    return LATENCY_BUCKETS if metric in {"pdproxy_ttft_seconds", "pdproxy_e2e_seconds"} else GAP_BUCKETS


def allowed_range(values: list[float], q: float, bounds: tuple[float, ...], slack: tuple[float, float]) -> tuple[float, float]:
    """The bucket bounds around the client's q-quantile, widened for what separates the two views.

    Client and proxy stamp the same events a hop apart, so a request's value differs by a few ms
    (`slack`: absolute, relative) and observations near the quantile can swap ranks (RANK_SLACK of
    them either side). Snapped outwards to bucket bounds: the histogram cannot resolve more.
    """
    abs_slack, rel_slack = slack
    rank = RANK_SLACK / len(values)
    low = float(np.percentile(values, max(0.0, q - rank) * 100))
    high = float(np.percentile(values, min(1.0, q + rank) * 100))
    low -= abs_slack + rel_slack * low
    high += abs_slack + rel_slack * high
    lo = max([0.0] + [b for b in bounds if b <= low])
    hi = min([b for b in bounds if b >= high] or [math.inf])
    return lo, hi


def client_truth(records: list[Record]) -> dict[str, list[float]]:
    """The same populations the proxy observes: failed and abandoned requests included (the
    client only talks to the primary deployment). Populations matter more than precision here:
    with two decode instances of different speed the E2E distribution is bimodal, and a median
    over a different set of requests can land in the other mode."""
    return {
        "pdproxy_ttft_seconds": [r.ttft for r in records if r.ttft is not None],
        "pdproxy_e2e_seconds": [(r.end_ns - r.sent_ns) / 1e9 for r in records],
        "pdproxy_itl_seconds": [g for r in records if r.per_token for g in r.gaps()],
        "pdproxy_chunk_gap_seconds": [g for r in records if not r.per_token for g in r.gaps()],
        "pdproxy_request_itl_max_seconds": [max(r.gaps()) for r in records if r.gaps()],
        "pdproxy_request_itl_p99_seconds": [float(np.percentile(r.gaps(), 99)) for r in records if r.gaps()],
        "pdproxy_tpot_seconds": [r.tpot for r in records if r.tpot is not None],
    }


# The client's TTFT includes its own send and the relay back (a few ms on loopback, more when both
# cores are busy); single gaps jitter by the scheduling of two event loops. With two decode
# instances of different speed TTFT and E2E are bimodal, and a median between the modes moves a
# long way when a few requests change rank: hence the rank slack, in observations.
RANK_SLACK = 5
SLACK = {"pdproxy_ttft_seconds": (0.010, 0.10), "pdproxy_e2e_seconds": (0.010, 0.10),
         "pdproxy_itl_seconds": (0.002, 0.15), "pdproxy_chunk_gap_seconds": (0.002, 0.15),
         "pdproxy_request_itl_max_seconds": (0.004, 0.10),
         "pdproxy_request_itl_p99_seconds": (0.004, 0.10), "pdproxy_tpot_seconds": (0.001, 0.10)}

QUANTILE = re.compile(r"^histogram_quantile\(([\d.]+), sum by \(le(?:, (\w+))?\) \(rate\((\w+)_bucket\{([^}]*)\}\[[^\]]+\]\)\)\)$")


def test_quantile_panels_agree_with_the_client(run):
    truth = client_truth(run.records)
    window = f"{math.ceil(run.end - run.start)}s"
    rows, failures = [], []
    seen = set()
    for name, title, target, values in all_targets():
        m = QUANTILE.match(target["expr"])
        if not m or m.group(3) not in truth:
            continue
        q, by, metric, matchers = float(m.group(1)), m.group(2), m.group(3), m.group(4)
        if (q, metric, by) in seen:
            continue
        seen.add((q, metric, by))
        values = {**values, "model": MODEL, "deployment": "primary", "run": RUN}
        result = run.prom.instant(substitute(target["expr"], values, window), run.end)
        if by == "deployment":
            result = [s for s in result if s["metric"].get("deployment") == "primary"]
        assert len(result) == 1, (target["expr"], result)
        measured = float(result[0]["value"][1])
        expected = float(np.percentile(truth[metric], q * 100))
        lo, hi = allowed_range(truth[metric], q, bounds_for(metric), SLACK[metric])
        ok = lo <= measured <= hi
        rows.append(f"{metric:34s} p{q * 100:<4g} {'by ' + by if by else '':14s} client {expected * 1000:8.2f} ms  "
                    f"PromQL {measured * 1000:8.2f} ms  allowed [{lo * 1000:.1f}, {hi * 1000:.1f}] ms  n={len(truth[metric])}"
                    f"{'' if ok else '  <-- MISMATCH'}")
        if not ok:
            failures.append(rows[-1])
    print("\nquantile panels vs client-side truth (measured window):\n" + "\n".join(rows))
    assert len(seen) >= 14, seen
    assert not failures, "\n".join(failures)


def test_counts_and_shares_agree_with_the_client(run):
    records = run.records
    window = f"{math.ceil(run.end - run.start)}s"
    sel = f'model="{MODEL}", deployment="primary", run="{RUN}"'

    def counter_delta(expr: str) -> float:
        a = run.prom.instant(expr, run.start)
        b = run.prom.instant(expr, run.end)
        return (float(b[0]["value"][1]) if b else 0.0) - (float(a[0]["value"][1]) if a else 0.0)

    # every request counted exactly once, failures by the stage that failed
    assert counter_delta(f"sum(pdproxy_requests_total{{{sel}}})") == len(records)
    client_failed = [r for r in records if not r.ok]
    upstream_failed = [r for r in client_failed if not r.aborted]
    aborted = [r for r in records if r.aborted]
    assert len(upstream_failed) >= 1 and len(aborted) >= 4
    # clients that went away: docs/reference/telemetry.md names their failed stage `client`; the proxy reports
    # the stage that was open (decode) with error_type client_disconnect, so count by error type.
    # A client can also leave after the proxy wrote the last byte: that request succeeded.
    gone = counter_delta(f'sum(pdproxy_request_errors_total{{{sel}, error_type="client_disconnect"}})')
    assert 1 <= gone <= len(aborted)
    failed = counter_delta(f'sum(pdproxy_requests_total{{{sel}, failed_stage!="none"}})')
    assert failed - gone == len(upstream_failed)

    # output tokens from usage: exact for finished streams; an abandoned stream counts what the
    # proxy relayed before it noticed (at least what the client read, at most max_tokens = 40)
    tokens = counter_delta(f'sum(pdproxy_tokens_total{{{sel}, type="output"}})')
    finished = sum(r.completion_tokens for r in records if not r.aborted)
    assert finished + sum(r.completion_tokens for r in aborted) <= tokens <= finished + 40 * len(aborted), (tokens, finished)

    # stalls: the proxy's counter against its own max-gap histogram, exactly (same requests)
    stalled = counter_delta(f"sum(pdproxy_requests_with_stall_total{{{sel}}})")
    above = counter_delta(f"sum(pdproxy_request_itl_max_seconds_count{{{sel}}})") - \
        counter_delta(f'sum(pdproxy_request_itl_max_seconds_bucket{{{sel}, le="{STALL_THRESHOLD}"}})')
    assert stalled == above > 0

    # the dashboards' ratio panels over the measured window
    d = load_dashboards()["pdproxy-overview.json"]
    values = {**variable_values(d), "model": MODEL, "deployment": "primary", "run": RUN}

    def panel_value(title: str, legend: str | None = None) -> float:
        from test_grafana_dashboards import panels

        (p,) = [p for p in panels(d) if p["title"] == title]
        t = next(t for t in p["targets"] if legend is None or t["legendFormat"] == legend)
        result = run.prom.instant(substitute(t["expr"], values, window), run.end)
        assert len(result) == 1, (title, result)
        return float(result[0]["value"][1])

    with_gaps = [r for r in records if r.gaps()]
    client_stall_share = sum(max(r.gaps()) > STALL_THRESHOLD for r in with_gaps) / len(with_gaps)
    client_error_share = len(client_failed) / len(records)
    stall_counter = panel_value("Requests with a stall")
    stall_hist = panel_value("Share of requests with a stall [per-request max gap]", "max gap > $stall s")
    error_share = panel_value("Failed requests")
    ttft_slo = panel_value("TTFT SLO attainment (TTFT ≤ $ttft_slo s)")
    client_slo = np.mean([r.ttft <= float(values["ttft_slo"]) for r in records if r.ttft is not None])
    print(f"\nstall share: client {client_stall_share:.3f}, stall counter {stall_counter:.3f}, max-gap histogram {stall_hist:.3f}"
          f"\nerror share: client {client_error_share:.3f}, PromQL {error_share:.3f}"
          f"\nTTFT <= {values['ttft_slo']} s: client {client_slo:.3f}, PromQL {ttft_slo:.3f}")
    # Exact counts are checked above from raw counter values. These are the panels' rate ratios,
    # which lose the first increment of a series born inside the window (a label set's first
    # stall or first failure): a few requests out of ~150.
    assert client_stall_share > 0.05
    assert stall_counter == pytest.approx(stall_hist, abs=0.03)
    assert stall_counter == pytest.approx(client_stall_share, abs=0.05)
    assert error_share == pytest.approx(client_error_share, abs=0.03)
    assert ttft_slo == pytest.approx(client_slo, abs=0.05)


def test_ttft_stage_split_adds_up(run):
    """Stacked stage means = mean TTFT: the stage spans share their boundaries."""
    window = f"{math.ceil(run.end - run.start)}s"
    sel = f'model="{MODEL}", deployment="primary", run="{RUN}", failed_stage="none"'
    # over successful requests only, so both sides average the same population
    ok_sel = f'model="{MODEL}", deployment="primary", run="{RUN}"'
    stages = run.prom.instant(
        f'sum by (stage) (rate(pdproxy_stage_duration_seconds_sum{{{ok_sel}, stage=~"queue|prefill|kv_transfer"}}[{window}]))'
        f' / sum by (stage) (rate(pdproxy_stage_duration_seconds_count{{{ok_sel}, stage=~"queue|prefill|kv_transfer"}}[{window}]))',
        run.end)
    split = {s["metric"]["stage"]: float(s["value"][1]) for s in stages}
    ttft = run.prom.instant(f"sum(rate(pdproxy_ttft_seconds_sum{{{ok_sel}}}[{window}])) / "
                            f"sum(rate(pdproxy_ttft_seconds_count{{{ok_sel}}}[{window}]))", run.end)
    mean_ttft = float(ttft[0]["value"][1])
    print(f"\nstage means (ms): { {k: round(v * 1000, 2) for k, v in split.items()} }, sum "
          f"{sum(split.values()) * 1000:.2f}; mean TTFT {mean_ttft * 1000:.2f}")
    assert set(split) == {"queue", "prefill", "kv_transfer"}
    # failed requests (KV load failures) have stage durations but no TTFT: allow their share
    assert sum(split.values()) == pytest.approx(mean_ttft, rel=0.15)
    assert sel  # the failed_stage label is on requests_total only; documented in the panel


def test_exemplars_link_observations_to_trace_ids(run):
    data = run.prom.api("/api/v1/query_exemplars", query=f'pdproxy_ttft_seconds_bucket{{run="{RUN}"}}',
                        start=f"{run.start:.3f}", end=f"{run.end:.3f}")
    exemplars = [e for series in data for e in series["exemplars"]]
    assert exemplars, "no exemplars stored: OpenMetrics negotiation or exemplar storage is off"
    for e in exemplars:
        assert re.fullmatch(r"[0-9a-f]{32}", e["labels"]["trace_id"]), e
    tail = run.prom.api("/api/v1/query_exemplars", query=f'pdproxy_request_itl_max_seconds_bucket{{run="{RUN}"}}',
                        start=f"{run.start:.3f}", end=f"{run.end:.3f}")
    assert any(float(e["value"]) > STALL_THRESHOLD for s in tail for e in s["exemplars"]), "stalled requests carry exemplars"


# ---------------------------------------------------------------------------------------------
# The shipped rules (deploy/prometheus/rules/) under this load


def rule_state(prom: Prometheus, timeout: float = 45.0) -> list[dict]:
    """The rule groups once every rule has been evaluated (the SLO group runs every 30 s)."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        groups = prom.get("/api/v1/rules")["groups"]
        if all(r.get("lastEvaluation", "").startswith("0001") is False and r["health"] != "unknown"
               for g in groups for r in g["rules"]) or time.monotonic() > deadline:
            return groups
        time.sleep(1)


def test_rules_load_and_evaluate_healthy(run):
    files = [yaml.safe_load(p.read_text())["groups"] for p in sorted(RULES.glob("*.yml"))]
    expected = {g["name"]: len(g["rules"]) for groups in files for g in groups}
    groups = rule_state(run.prom)
    assert {g["name"]: len(g["rules"]) for g in groups} == expected
    unhealthy = [(r["name"], r["health"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"]
    assert not unhealthy, unhealthy
    kinds = [r["type"] for g in groups for r in g["rules"]]
    print(f"\n{len(groups)} rule groups loaded: {kinds.count('recording')} recording rules, {kinds.count('alerting')} alerts, all healthy")
    assert kinds.count("alerting") >= 12


RECORDED = {
    "run_model_deployment:pdproxy_ttft_seconds:p99_5m": "histogram_quantile(0.99, sum by (run, model, deployment, le) (rate(pdproxy_ttft_seconds_bucket[5m])))",
    "run_model_deployment:pdproxy_request_itl_max_seconds:p99_5m":
        "histogram_quantile(0.99, sum by (run, model, deployment, le) (rate(pdproxy_request_itl_max_seconds_bucket[5m])))",
    'run_model_deployment_stage:pdproxy_stage_duration_seconds:p99_5m{stage="kv_transfer"}':
        'histogram_quantile(0.99, sum by (run, model, deployment, stage, le) (rate(pdproxy_stage_duration_seconds_bucket{stage="kv_transfer"}[5m])))',
    "run_model_deployment:pdproxy_requests_with_stall:ratio_rate5m":
        "(sum by (run, model, deployment) (rate(pdproxy_requests_with_stall_total[5m]))"
        " or 0 * sum by (run, model, deployment) (rate(pdproxy_request_itl_max_seconds_count[5m])))"
        " / sum by (run, model, deployment) (rate(pdproxy_request_itl_max_seconds_count[5m]))",
    "run_model_deployment:pdproxy_ttft_slo_miss:ratio_rate5m":
        'sum by (run, model, deployment) (rate(pdproxy_ttft_seconds_count[5m]) - ignoring(le) rate(pdproxy_ttft_seconds_bucket{le="2.0"}[5m]))'
        " / sum by (run, model, deployment) (rate(pdproxy_ttft_seconds_count[5m]))",
}


def test_recording_rules_equal_their_expressions_under_load(run):
    rule_state(run.prom)
    sel = f'run="{RUN}", model="{MODEL}"'
    rows = []
    for recorded, direct in RECORDED.items():
        name, _, matchers = recorded.partition("{")
        extra = ", " + matchers.rstrip("}") if matchers else ""
        # an evaluation after the load (the SLO group runs every 30 s)
        deadline = time.monotonic() + scaled(40)
        while True:
            got = run.prom.instant(f"timestamp({name}{{{sel}{extra}}})", time.time())
            if (got and min(float(s["value"][1]) for s in got) > run.end) or time.monotonic() > deadline:
                break
            time.sleep(1)
        # the shadow is a single instance here: no kv_transfer stage
        assert {s["metric"]["deployment"] for s in got} == {"primary"} | ({"shadow"} if "kv_transfer" not in recorded else set()), got
        for s in got:
            at = float(s["value"][1])  # when the rule wrote it: evaluate the expression at that instant
            deployment = s["metric"]["deployment"]
            one = f'{name}{{{sel}{extra}, deployment="{deployment}"}}'
            value = float(run.prom.instant(one, at)[0]["value"][1])
            expect = [x for x in run.prom.instant(direct, at) if x["metric"].get("deployment") == deployment
                      and x["metric"].get("run") == RUN and x["metric"].get("model") == MODEL]
            assert len(expect) == 1, (direct, expect)
            rows.append(f"{name:62s} {deployment:8s} recorded {value:.4f}  expression {float(expect[0]['value'][1]):.4f}")
            assert math.isfinite(value), rows[-1]
            assert value == pytest.approx(float(expect[0]["value"][1]), rel=1e-6, abs=1e-9), rows[-1]
    print("\n" + "\n".join(rows))
    # the series the alerts read exist for this run too
    for name in ("run_model_deployment:pdproxy_requests:rate5m", "run_model_deployment:pdproxy_requests_failed:ratio_rate5m",
                 "run_model_deployment_stage:pdproxy_request_errors_upstream:ratio_rate5m"):
        assert run.prom.instant(f'{name}{{run="{RUN}"}}', time.time()), name
    signals = {s["metric"]["signal"] for s in run.prom.instant(f'run_model_signal:pdproxy_shadow_vs_primary:5m{{run="{RUN}"}}', time.time())}
    assert signals == {"ttft_p90_ratio", "tail_itl_max_p90_ratio", "failed_ratio_diff"}


def test_alerts_follow_the_live_series(run):
    """Spans go to a dead port here: the telemetry-blind alert must be active. The rest must agree with
    the series they read: an alert is active exactly when its condition holds on this data."""
    rule_state(run.prom)
    active = {}
    for a in run.prom.get("/api/v1/alerts")["alerts"]:
        active.setdefault(a["labels"]["alertname"], []).append(a)
    print(f"\nactive alerts: { {k: [a['state'] for a in v] for k, v in active.items()} }")
    dropped = active.get("PdproxySpansDropped", [])
    assert "export_failed" in {a["labels"]["reason"] for a in dropped}
    assert all(a["state"] in {"pending", "firing"} for a in dropped)

    # the instance alerts read the backend address from the proxy's own server_address; `instance`
    # stays Prometheus's target label (the proxy), and nothing is renamed to exported_instance
    health = run.prom.instant("pdproxy_instance_healthy", time.time())
    assert health and all(s["metric"]["server_address"].startswith(HOST) and "exported_instance" not in s["metric"]
                          and s["metric"]["instance"] != s["metric"]["server_address"]
                          for s in health), health
    ejected = [s for s in health if float(s["value"][1]) == 0]
    assert bool(ejected) == ("PdproxyInstanceEjected" in active)

    # error ratio by stage: active for exactly the stages over the bound
    ratios = run.prom.instant(f'run_model_deployment_stage:pdproxy_request_errors_upstream:ratio_rate5m{{deployment="primary", run="{RUN}"}}'
                              f' > 0.02 and on (run, model, deployment) run_model_deployment:pdproxy_requests:rate5m > 0.1', time.time())
    assert {s["metric"]["stage"] for s in ratios} == {a["labels"]["stage"] for a in active.get("PdproxyStageErrorRatioHigh", [])}
    # stalls from KV arrivals: pending or firing exactly while its own condition holds (the decodes here do
    # not hold their steps during pulls, but preempted streams on decode A coincide with KV arrivals)
    (kv_rule,) = [r for g in yaml.safe_load((RULES / "pdproxy-alerts.yml").read_text())["groups"] for r in g["rules"]
                  if r.get("alert") == "PdproxyDecodeStallsFromKVArrivals"]
    holds = run.prom.instant(kv_rule["expr"], time.time())
    assert bool(holds) == ("PdproxyDecodeStallsFromKVArrivals" in active), (holds, active.keys())
    for quiet in ("PdproxyNoHealthyInstance", "PdproxyAdmissionQueueBacklog", "PdproxyOverloadRefusals",
                  "PdproxyTTFTSLOBurnSlow", "PdproxyTraceMetricsIncomplete"):
        assert quiet not in active, (quiet, active[quiet])
