"""The compiled modules one at a time: pure Python against mypyc, on the same machine in one run.

benchmarks/cpu_per_request.py says what compiling does to a whole request; this says where it
comes from (or does not): each function the profile names, timed in a pure tree and a compiled one,
alternating, best of `--repeat` (the least disturbed by other load).

Run:  python benchmarks/compiled_micro.py PURE_TREE COMPILED_TREE [--repeat 7]
(COMPILED_TREE built with `PDPROXY_COMPILE=1 pip install -e .`; PURE_TREE e.g. `git archive HEAD | tar -x -C DIR`)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# Runs inside each tree: prints {case: microseconds per call}, best of `repeat`.
CHILD = r'''
import json, sys, timeit
from pdproxy import compiled
from pdproxy.stream import ResponseScan
from pdproxy.telemetry.otlp import KIND_SERVER, SpanData, encode_span
from pdproxy.telemetry.measure import Timeline, measure
from pdproxy.protocol import CHAT, validate, prefill_body, decode_payload, parse_body
from pdproxy.policies.request import RequestView

repeat = int(sys.argv[1])
head = ('{"id":"cmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
        '"choices":[{"index":0,"delta":{"content":"')
events = [("data: " + head + f'tok{i}' + '"},"logprobs":null,"finish_reason":null}]}\n\n').encode() for i in range(8)]
events.append(("data: " + head + '"},"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":5,'
               '"completion_tokens":8,"total_tokens":13}}\n\n').encode())
events.append(b"data: [DONE]\n\n")
whole = b"".join(events)
attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.stream": True, "gen_ai.usage.output_tokens": 300,
         "pd.itl.p99": 0.0123, "pd.ttft": 0.05, "pd.e2e": 0.3, "gen_ai.response.finish_reasons": ["length"],
         "server.port": 8100, "pd.request_id": "req-123", "gen_ai.request.model": "m"}
body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 8, "stream": True}
raw = json.dumps(body).encode()
times = [1_000_000 * i for i in range(1, 9)]


def scan_events():
    s = ResponseScan(True)
    for i, e in enumerate(events):
        s.feed(e, i)


def scan_whole():
    ResponseScan(True).feed(whole, 1)


def span():
    encode_span(SpanData("chat m", KIND_SERVER, 1 << 100, 0x1111, 0x2222, 10, 20, attrs, None, None, False))


def measured():
    t = Timeline(0, 10, 20, 30, 40, 50, 9_000_000)
    measure(t, pd_mode=True, status=200, failed_stage=None, error_type=None, chunk_times=times,
            chunk_tokens=[1] * 8, usage={"prompt_tokens": 5, "completion_tokens": 8}, server_metrics=None,
            stall_threshold=0.1)


def checks():
    parsed, _ = parse_body(raw)
    v = validate(parsed, CHAT)
    prefill_body(v)
    decode_payload(v, raw, {"remote_engine_id": "x"})
    RequestView(v, {}, True).prefix


cases = {"scan, 10 events one per read": scan_events, "scan, 10 events in one read": scan_whole,
         "OTLP encode root span (10 attributes)": span, "measure() 8-token request": measured,
         "request checks (parse, validate, legs' bodies, prefix key)": checks}
out = {"form": compiled.report()["form"]}
for name, fn in cases.items():
    n = 2000
    out[name] = min(timeit.repeat(fn, number=n, repeat=repeat)) / n * 1e6
print(json.dumps(out))
'''


def run(tree: str, repeat: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(repeat)], cwd=tree, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": tree})
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pure")
    p.add_argument("compiled")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3, help="pure and compiled alternate this many times")
    args = p.parse_args()
    best: dict[str, dict[str, float]] = {"pure": {}, "compiled": {}}
    for _ in range(args.rounds):
        for label, tree in (("pure", args.pure), ("compiled", args.compiled)):
            res = run(tree, args.repeat)
            print(f"{label}: form {res.pop('form')}", file=sys.stderr)
            for k, v in res.items():
                best[label][k] = min(v, best[label].get(k, v))
    print("| per call (best of all runs) | pure us | compiled us | compiled / pure |\n|---|---:|---:|---:|")
    for k, pure in best["pure"].items():
        comp = best["compiled"][k]
        print(f"| {k} | {pure:.1f} | {comp:.1f} | {comp / pure:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
