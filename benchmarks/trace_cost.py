"""What a request's telemetry costs in CPU, part by part, tracing on and off, in several trees side by side.

benchmarks/cpu_per_request.py measures whole requests through a running proxy; this isolates the
recorder (pdproxy/telemetry/) from the rest: each request goes through the calls pdproxy/pd.py makes
(Recorder.begin, set_request, leg_headers, routed, admitted, prefill_sent/done, decode_sent,
decode_headers, its 8-token stream fed to the scan, first_token, delivered, finish), in batches, with
tracing on (every span exported by the real OTLP/HTTP exporter to benchmarks/otlp_sink.py, which checks
that every span arrived) and off, alternating. Default settings: P/D, stall attribution on, a known
model, round_robin decisions.

Printed per tree, in microseconds of CPU per request (the loop's thread; a tree that exports from a
thread of its own, as before 2026-12-02, has that thread's CPU read from its own clock):
  begin, flow calls (set_request ... delivered), finish  -- what the event loop spends
  of finish: measure(), Metrics.record (each timed alone on the same requests), spans (finish with
  tracing on minus off: span building, encoding if on the loop, queueing)
  export (framing, encoding if done there, the HTTP send: on the loop, or the export thread's)
  the scan (stream.py, not telemetry) is shown for scale and left out of the totals.

Run:  python benchmarks/trace_cost.py pure=TREE compiled=TREE [before=TREE ...] [--rounds 5 --batch 256]
(a compiled TREE built with `PDPROXY_COMPILE=1 python3 setup.py build_ext --inplace`; a pure one e.g.
`git archive HEAD | tar -x -C DIR`)
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = ("begin", "flow", "finish", "measure", "metrics", "export", "scan")


def child(port: int, rounds: int, batch: int) -> None:
    """Runs inside one tree (PYTHONPATH): prints {part: {"on": us, "off": us}} medians over rounds."""
    asyncio.run(_child(port, rounds, batch))


async def _child(port: int, rounds: int, batch: int) -> None:
    from pdproxy import compiled
    from pdproxy.errors import DECODE, PREFILL
    from pdproxy.policies.base import Decision
    from pdproxy.protocol import new_uuid4
    from pdproxy.stream import ResponseScan
    from pdproxy.telemetry.measure import measure
    from pdproxy.telemetry.metrics import Metrics
    from pdproxy.telemetry.models import ModelNames
    try:
        from pdproxy.telemetry.export import HttpExporter as sink  # exports from the event loop
        on_loop = True
    except ImportError:
        from pdproxy.telemetry.otlp import HttpTransport as sink  # type: ignore[assignment,no-redef]
        on_loop = False
    from pdproxy.telemetry.recorder import Recorder
    from pdproxy.telemetry.stalls import StallRecords
    from pdproxy.telemetry.tracing import Tracing

    head = ('{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
            '"choices":[{"index":0,"delta":{"content":"')
    events = [("data: " + head + f"tok{i}" + '"},"logprobs":null,"finish_reason":null}]}\n\n').encode()
              for i in range(7)]
    events.append(("data: " + head + '!"},"logprobs":null,"finish_reason":"length"}]}\n\n').encode())
    events.append(('data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
                   '"usage":{"prompt_tokens":40,"completion_tokens":8,"total_tokens":48}}\n\n').encode())
    events.append(b"data: [DONE]\n\n")
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 8, "stream": True,
            "temperature": 0.0}
    prefill, decode = "127.0.0.1:8100", "127.0.0.1:8200"
    from pdproxy import runtime

    for tune in ("tune_gc", "tune_malloc"):  # as a worker starts serving, in the trees that have them
        getattr(runtime, tune, lambda: None)()
    drops: list[int] = []
    tracing = Tracing({"pd.mode": "pd"}, [sink(f"http://127.0.0.1:{port}/v1/traces")], 8192,
                      on_drop=lambda reason, count: drops.append(count))
    # the export's CPU: the loop's own clock while it sends, or the export thread's
    export_clock = time.CLOCK_THREAD_CPUTIME_ID if on_loop else time.pthread_getcpuclockid(tracing.worker.ident)
    recorders = {on: Recorder(Metrics(), tracing if on else None, stall_threshold=0.1, models=ModelNames(["m"]),
                              stalls=StallRecords()) for on in (True, False)}
    spare = Metrics()  # Metrics.record timed alone, on the same measurements, into series of its own
    clock = time.thread_time_ns

    async def one_batch(on: bool) -> dict[str, float]:
        rec = recorders[on]
        took: dict[str, int] = {}
        t0 = clock()
        traces = [rec.begin(route="/v1/chat/completions", operation="chat", chat=True, headers={},
                            request_id=new_uuid4(), pd_mode=True) for _ in range(batch)]
        t1 = clock()
        took["begin"] = t1 - t0
        for trace in traces:
            trace.set_request(body)
            trace.leg_headers(PREFILL)
            trace.routed(PREFILL, Decision("round_robin", "rotation"))
            trace.routed(DECODE, Decision("round_robin", "rotation"))
            trace.admitted(prefill, decode)
            trace.prefill_sent(prefill, 1)
            trace.prefill_done(prefill, 200, 1, "received")
            trace.leg_headers(DECODE)
            trace.decode_sent(decode)
            trace.scan = ResponseScan(True)
            trace.decode_headers(200)
        t2 = clock()
        for trace in traces:
            scan = trace.scan
            for event in events:
                scan.feed(event, time.monotonic_ns())
        t3 = clock()
        for trace in traces:
            trace.first_token()
            trace.delivered()
        t4 = clock()
        took["flow"], took["scan"] = (t2 - t1) + (t4 - t3), t3 - t2
        for trace in traces:
            trace.finish()
        t5 = clock()
        took["finish"] = t5 - t4
        w0 = time.clock_gettime_ns(export_clock)
        if on:  # until every span of the batch is sent: the export's CPU for these requests
            while tracing.queue or getattr(tracing, "sending", None):
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.02)
        took["export"] = time.clock_gettime_ns(export_clock) - w0 if on else 0
        t5 = clock()  # measure() and Metrics.record alone, with the export thread idle
        measured = []
        for trace in traces:
            measured.append(measure(trace.t, pd_mode=True, status=trace.status, failed_stage=trace.failed_stage,
                                    error_type=trace.error_type, chunk_times=trace.scan.chunk_times,
                                    chunk_tokens=trace.scan.chunk_tokens, usage=trace.scan.usage,
                                    server_metrics=trace.scan.server_metrics, stall_threshold=0.1))
        t6 = clock()
        took["measure"] = t6 - t5
        for m in measured:
            spare.record(m, "/v1/chat/completions", "m", "pd", "primary", "0" * 32 if on else None)
        took["metrics"] = clock() - t6
        return {k: v / batch / 1e3 for k, v in took.items()}

    for on in (True, False):  # warm up: series, caches, the connection
        await one_batch(on)
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            runs[on].append(await one_batch(on))
    if on_loop:
        await tracing.shutdown()
    else:
        tracing.shutdown()
    out: dict[str, object] = {"form": compiled.report()["form"], "dropped": sum(drops)}
    for part in PARTS:
        out[part] = {("on" if on else "off"): _median([run[part] for run in runs[on]]) for on in (True, False)}
    out["sent_spans"] = (rounds + 1) * batch * 5
    print(json.dumps(out))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _count(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/count")
    return json.loads(conn.getresponse().read())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="*", help="LABEL=TREE, e.g. pure=/tmp/pure compiled=/tmp/compiled")
    p.add_argument("--rounds", type=int, default=5, help="batches on and off, alternating, per run of a tree")
    p.add_argument("--batch", type=int, default=256, help="requests per batch")
    p.add_argument("--runs", type=int, default=2, help="each tree runs this many times, trees alternating")
    p.add_argument("--child", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.rounds, args.batch)
        return 0
    sys.path.insert(0, str(HERE))  # here, not at the top: the child runs in another tree and needs none of it
    import harness

    trees = dict(t.split("=", 1) for t in args.trees) or {"this": str(HERE.parent)}
    port = harness.free_port()
    sink = harness.Proc("otlp_sink", [sys.executable, str(HERE / "otlp_sink.py"), "--port", str(port)])
    try:
        harness.wait_port(port)
        best: dict[str, dict] = {}
        for run in range(args.runs):
            order = list(trees.items())
            for label, tree in (order if run % 2 == 0 else order[::-1]):  # no tree always last
                before, posts = _count(port)["spans"], _count(port)["requests"]
                out = harness.python_in(tree, [str(HERE / "trace_cost.py"), "--child", str(port), "--rounds",
                                               str(args.rounds), "--batch", str(args.batch)],
                                        env={"OTEL_BSP_SCHEDULE_DELAY": "20"})
                if out.returncode:
                    raise SystemExit(f"{label} ({tree}): {out.stderr.strip()}")
                res = json.loads(out.stdout)
                arrived = _count(port)["spans"] - before
                if res["dropped"] or arrived != res["sent_spans"]:
                    raise SystemExit(f"{label}: {res['dropped']} spans dropped, {arrived} of {res['sent_spans']} "
                                     "arrived: the figures would not count every span's cost")
                posts = _count(port)["requests"] - posts
                print(f"{label}: form {res['form']}, {arrived} spans received in {posts} export requests",
                      file=sys.stderr)
                kept = best.setdefault(label, res)  # the first run follows the order given: so do the columns
                for part in PARTS:  # the least disturbed run of each part
                    for k in ("on", "off"):
                        kept[part][k] = min(kept[part][k], res[part][k])
    finally:
        sink.stop()
    print("| us CPU per request | " + " | ".join(f"{label} off | {label} on" for label in best) + " |")
    print("|---|" + "---:|---:|" * len(best))

    def row(name: str, values: list[tuple[float, float]]) -> None:
        print(f"| {name} | " + " | ".join(f"{off:.1f} | {on:.1f}" for off, on in values) + " |")

    names = {"begin": "Recorder.begin", "flow": "flow calls (set_request ... delivered)", "finish": "finish",
             "measure": "  of which measure()", "metrics": "  of which Metrics.record",
             "export": "export (loop or thread)",
             "scan": "(stream scan, not telemetry)"}
    for part, name in names.items():
        if part == "export":
            row("  of which spans (finish on - off)", [(0.0, r["finish"]["on"] - r["finish"]["off"])
                                                        for r in best.values()])
        row(name, [(r[part]["off"], r[part]["on"]) for r in best.values()])
    loop = {label: {k: sum(r[part][k] for part in ("begin", "flow", "finish")) for k in ("on", "off")}
            for label, r in best.items()}
    row("**event loop total**", [(loop[label]["off"], loop[label]["on"]) for label in best])
    row("**with the export**", [(loop[label]["off"], loop[label]["on"] + r["export"]["on"])
                                for label, r in best.items()])
    print("\ntracing on - off, with the export: " + ", ".join(
        f"{label} {loop[label]['on'] + r['export']['on'] - loop[label]['off']:.1f} us"
        for label, r in best.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
