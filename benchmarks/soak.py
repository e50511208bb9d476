"""Soak: minutes of mixed faults and client cancellations through pdproxy, then three ledgers reconciled.

    python benchmarks/soak.py --duration 120

Starts two prefill and two decode simulated instances (`pdproxy sim`) with random faults (errors,
mid-stream disconnects, KV-load failures, stalls), a proxy whose OTLP collector is down for the
whole run (spans still go to a trace file), and a client that keeps --concurrency requests in
flight and abandons --cancel-rate of them at a random moment. At the end every request the client
sent must appear once in the proxy's trace (one root span with its `pd.request_id`) and once in
`pdproxy_requests_total`, with the same status; `lost` counts those that do not. Bounded: the run
stops after --duration seconds and everything it started is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


# -- the client ledger ----------------------------------------------------------------------


async def one_request(session: aiohttp.ClientSession, url: str, rid: str, rng: random.Random,
                      cancel_after: float | None, records: dict) -> None:
    body = {"model": "sim-model", "prompt": "word " * rng.randint(16, 400), "max_tokens": rng.randint(4, 48),
            "stream": rng.random() < 0.85, "ignore_eos": True}
    record = records[rid] = {"outcome": "pending", "status": None}

    async def call() -> None:
        async with session.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
            record["status"] = r.status
            text = (await r.read()).decode("utf-8", "replace")
        if r.status != 200:
            record["outcome"] = f"http_{r.status}:{json.loads(text)['error'].get('code')}"
        elif body["stream"]:
            events = [e for e in text.split("\n\n") if e]
            if events[-1] != "data: [DONE]":
                record["outcome"] = "broken_stream"  # must never happen: the proxy always ends with [DONE]
            elif '"error"' in events[-2] and events[-2].startswith('data: {"error"'):
                record["outcome"] = "stream_error:" + json.loads(events[-2][6:])["error"].get("code", "?")
            else:
                record["outcome"] = "ok"
        else:
            record["outcome"] = "ok" if "choices" in json.loads(text) else "bad_body"

    task = asyncio.ensure_future(call())
    if cancel_after is None:
        try:
            await task
        except Exception as exc:
            record["outcome"] = f"client_exception:{type(exc).__name__}"
        return
    done, _ = await asyncio.wait({task}, timeout=cancel_after)
    if done:
        try:
            task.result()
        except Exception as exc:
            record["outcome"] = f"client_exception:{type(exc).__name__}"
        return
    task.cancel()  # the client hangs up mid-request
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    record["outcome"] = "cancelled"


async def load(url: str, duration: float, concurrency: int, cancel_rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    records: dict[str, dict] = {}
    deadline = time.monotonic() + duration
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < deadline:
                i += 1
                cancel = rng.uniform(0.0, 0.4) if rng.random() < cancel_rate else None
                await one_request(session, url, f"soak-{seed}-{w}-{i}", rng, cancel, records)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return records


# -- the trace and metrics ledgers -------------------------------------------------------------


def trace_roots(path: Path) -> dict[str, list[dict]]:
    roots: dict[str, list[dict]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue
        for rs in message.get("resourceSpans", ()):
            for ss in rs.get("scopeSpans", ()):
                for span in ss.get("spans", ()):
                    if span.get("kind") != 2:
                        continue
                    a = {x["key"]: next(iter(x["value"].values())) for x in span.get("attributes", ())}
                    if a.get("pd.deployment") == "primary" and "pd.request_id" in a:
                        roots[a["pd.request_id"]].append(a)
    return roots


def request_counters(url: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pdproxy_requests_total{"):
                labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
                counts[(labels["code"].strip('"'), labels["failed_stage"].strip('"'))] += float(line.rsplit(" ", 1)[1])
    return counts


def spans_dropped(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith("pdproxy_spans_dropped_total"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--cancel-rate", type=float, default=0.1, help="share of requests the client abandons")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", help="where logs and the trace file go (default: a temporary directory)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pdproxy-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    with harness.Procs() as procs:
        urls = {"prefill": [], "decode": []}
        faults = {"prefill": ["--error-rate", "0.02"],
                  "decode": ["--error-rate", "0.02", "--disconnect-rate", "0.02", "--disconnect-after-chunks", "3",
                             "--kv-load-failure-rate", "0.03", "--stall-seconds", "3", "--stall-rate", "0.01",
                             "--stall-after-chunks", "2"]}
        for k, role in enumerate(("prefill", "prefill", "decode", "decode")):
            sim = procs.pdproxy("sim", "--role", role, "--time-scale", "0.1", "--seed", str(args.seed + k),
                                *faults[role], log=work / f"sim-{role}-{k}.log")
            urls[role].append(sim.url)
        dead_collector = f"http://{harness.HOST}:{harness.free_port()}"
        trace_file = work / "spans.jsonl"
        proxy = procs.pdproxy("serve", "--prefill", *urls["prefill"], "--decode", *urls["decode"],
                              "--read-timeout", "2", "--max-inflight", "64", "--trace-file", str(trace_file),
                              "--otlp-endpoint", dead_collector, "--otlp-protocol", "http/protobuf",
                              "--debug-endpoints", "--health-check-interval", "1", log=work / "proxy.log",
                              env={"OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
        url = proxy.url
        start_rt = get_json(url + "/debug/runtime")
        rss_start = harness.rss_bytes(proxy.pid)
        started = time.monotonic()
        records = asyncio.run(load(url, args.duration, args.concurrency, args.cancel_rate, args.seed))
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 30
        while get_json(url + "/debug/runtime")["inflight_requests"] and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        end_rt = get_json(url + "/debug/runtime")
        rss_end = harness.rss_bytes(proxy.pid)
        counters = request_counters(url)
        dropped = spans_dropped(url)
        roots: dict[str, list[dict]] = {}
        deadline = time.monotonic() + 30  # the trace file is written in batches: wait for the last one
        while time.monotonic() < deadline:
            roots = trace_roots(trace_file)
            if all(rid in roots for rid in records):
                break
            time.sleep(0.5)

    # reconcile: client ↔ trace ↔ metrics
    lost: list[str] = []
    by_reason: collections.Counter = collections.Counter()
    trace_counts: collections.Counter = collections.Counter()
    for rid, rec in records.items():
        found = roots.get(rid, [])
        if len(found) != 1:
            lost.append(f"{rid}: {len(found)} root spans (client saw {rec['outcome']})")
            continue
        a = found[0]
        code, stage = str(a["http.response.status_code"]), a.get("pd.failed_stage", "none")
        trace_counts[(code, stage)] += 1
        outcome = rec["outcome"]
        if outcome == "cancelled":  # the client never saw the end: whatever the proxy recorded stands
            agrees = True
            by_reason["cancelled by client" + ("" if code == "499" else f" (proxy had already answered {code})")] += 1
        elif outcome == "ok":
            agrees = code == "200" and stage == "none"
            by_reason["succeeded"] += 1
        elif outcome.startswith(("http_", "stream_error:")):
            agrees = stage != "none" and (outcome.startswith("stream_error:") or outcome[5:8] == code)
            by_reason[f"{outcome} at {stage}"] += 1
        else:
            agrees = False
        if not agrees:
            lost.append(f"{rid}: client saw {outcome}, trace says {code}/{stage}/{a.get('error.type')}")
    metric_total = sum(counters.values())
    if metric_total != len(records):
        lost.append(f"metrics count {metric_total:.0f} requests, the client sent {len(records)}")
    for key in set(counters) | set(trace_counts):
        if counters[key] != trace_counts[key]:
            lost.append(f"code={key[0]} failed_stage={key[1]}: metrics {counters[key]:.0f}, traces {trace_counts[key]}")

    succeeded = by_reason["succeeded"]
    print(f"soak: {elapsed:.0f} s, concurrency {args.concurrency}, cancel rate {args.cancel_rate:g}, seed {args.seed}")
    print("faults: prefill error 2%; decode error 2%, disconnect 2%, KV-load failure 3%, 3 s stall 1% (read timeout 2 s);"
          " OTLP collector down for the whole run")
    print(f"sent:      {len(records)}  ({len(records) / elapsed:.1f} req/s)")
    print(f"succeeded: {succeeded}")
    print(f"failed:    {sum(v for k, v in by_reason.items() if k != 'succeeded' and not k.startswith('cancelled'))}")
    print(f"cancelled: {sum(v for k, v in by_reason.items() if k.startswith('cancelled'))}")
    print("by reason (client view, stage from the trace):")
    for reason, count in sorted(by_reason.items(), key=lambda kv: -kv[1]):
        print(f"  {count:6d}  {reason}")
    print(f"lost:      {len(lost)}")
    for line in lost[:20]:
        print(f"  {line}")
    print(f"ledgers:   client {len(records)}, traces {sum(trace_counts.values())}, metrics {metric_total:.0f}")
    print(f"spans dropped towards the dead collector (counted): {dropped:.0f}")
    print(f"proxy RSS: start {rss_start / 2**20:.1f} MiB, end {rss_end / 2**20:.1f} MiB")
    print(f"proxy tasks {start_rt['tasks']} -> {end_rt['tasks']}, open fds {start_rt['open_fds']} -> {end_rt['open_fds']}, "
          f"in flight at end {end_rt['inflight_requests']}, instance in-flight {sorted(set(end_rt['instance_inflight'].values()))}")
    print(f"logs and trace file: {work}")
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
