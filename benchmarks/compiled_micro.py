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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

# Runs inside each tree: prints {case: microseconds per call}, best of `repeat`.
CHILD = r'''
import asyncio, json, sys, timeit
from pdproxy import compiled
from pdproxy.stream import ResponseScan
from pdproxy.telemetry.otlp import KIND_SERVER, SpanData, encode_span
from pdproxy.telemetry.measure import Timeline, measure
from pdproxy.protocol import CHAT, validate, prefill_body, decode_payload, parse_body
from pdproxy.policies.request import RequestView
from pdproxy.admission import Admission
from pdproxy.errors import ProxyError
from pdproxy.migration.continuation import Continuation
from pdproxy.policies.load_aware import Reading
from pdproxy.pool import Pool
from pdproxy.upstream import _Connection, _InstancePool, _request_bytes

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


urls = [f"http://127.0.0.1:{8100 + k}" for k in range(4)]
pools = {name: Pool("decode", urls, name) for name in ("round_robin", "load_aware", "consistent_hash")}
for k, inst in enumerate(pools["load_aware"].instances):
    pools["load_aware"].policy.readings[inst.url] = Reading(k, 2.0 * k, 0.25, 1e18)  # never stale
view = RequestView(body, {"X-Session-Id": "session-42"}, True)  # consistent_hash: by the session


def picker(pool):
    def pick():
        instance, decision = pool.pick(view)
        with instance.reserved():
            pass
    return pick


class Transport:  # stands in for the socket: the client's own work is what is timed
    def write(self, data): pass
    def close(self): pass
    def abort(self): pass
    def pause_reading(self): pass
    def resume_reading(self): pass


loop = asyncio.new_event_loop()
# read_timeout 0: no timer per silence (it would pile up in a loop that never runs)
try:
    instance_pool = _InstancePool(loop, "http://127.0.0.1:8200", 5.0, 0.0, 256, 4.0, None)  # tls: plain HTTP
except TypeError:  # a tree from before upstream TLS
    instance_pool = _InstancePool(loop, "http://127.0.0.1:8200", 5.0, 0.0, 256, 4.0)
legs_headers = {"Content-Type": "application/json", "X-Request-Id": "req-123", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
answer = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]  # the head comes with the first event, the end with [DONE]
answer[0] = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
             b"date: Tue, 01 Dec 2026 00:00:00 GMT\r\nserver: uvicorn\r\n\r\n") + answer[0]
answer[-1] += b"0\r\n\r\n"


def resolved(coro):
    """The value of a coroutine that completes without waiting (the loop is not needed)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("it waited")


def request_bytes():
    _request_bytes(instance_pool, "/v1/chat/completions", raw, legs_headers)


def exchange():
    request = _request_bytes(instance_pool, "/v1/chat/completions", raw, legs_headers)
    if instance_pool.idle:
        conn = instance_pool.idle.pop()
    else:
        conn = _Connection(instance_pool)
        conn.connection_made(Transport())
    response = conn.send(request)
    for part in answer:
        conn.data_received(part)
        resolved(response.readany())
    assert response.at_eof and response.status == 200
    response.release()  # back to the idle list


def proxy_error_event():
    ProxyError(502, "decode instance broke the stream", error_type="decode_disconnected", stage="decode").sse_event()


def proxy_error_response():
    ProxyError(503, "no capacity", error_type="overloaded", stage="queue", retry_after=1).response()


admission = Admission(64, 64, 5.0)


async def admitted():
    admission.check()
    with admission.take() or await admission.queue():
        pass


def admit():
    resolved(admitted())


cont = Continuation({**body, "temperature": 0}, True)
tap_events = [b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                      **({"prompt_token_ids": [1, 2, 3, 4, 5]} if i == 0 else {}),
                                      "choices": [{"index": 0, "delta": {"content": f"tok{i}"}, "token_ids": [100 + i],
                                                   "finish_reason": None}]}).encode() + b"\n\n" for i in range(8)]


def tapped():
    tap = cont.tap()
    for e in tap_events:
        tap.feed(e)
    cont.obstacle(tap)


cases = {"scan, 10 events one per read": scan_events, "scan, 10 events in one read": scan_whole,
         "OTLP encode root span (10 attributes)": span, "measure() 8-token request": measured,
         "request checks (parse, validate, legs' bodies, prefix key)": checks,
         "Pool.pick + reserved, round_robin (4 instances)": picker(pools["round_robin"]),
         "Pool.pick + reserved, load_aware": picker(pools["load_aware"]),
         "Pool.pick + reserved, consistent_hash": picker(pools["consistent_hash"]),
         "upstream: a leg's request bytes": request_bytes,
         "upstream: request + 10-event chunked answer, one read per event": exchange,
         "ProxyError + its SSE error event": proxy_error_event,
         "ProxyError + its JSON response (aiohttp)": proxy_error_response,
         "admission: check + take (with)": admit,
         "mid-stream tap: 8 events with token ids": tapped}
out = {"form": compiled.report()["form"]}
for name, fn in cases.items():
    n = 2000
    out[name] = min(timeit.repeat(fn, number=n, repeat=repeat)) / n * 1e6
print(json.dumps(out))
'''


def run(tree: str, repeat: int) -> dict:
    out = harness.python_in(tree, ["-c", CHILD, str(repeat)])
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
