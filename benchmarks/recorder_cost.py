"""What the live stall attribution costs the recorder, in CPU µs per request, on against off.

In this process, without a proxy or sockets: the one recorder (pdproxy/telemetry/recorder.py) with the
stall attribution on and off, interleaved round by round so both see the same machine state; spans are
built and encoded to OTLP, then dropped; metrics are recorded. benchmarks/overhead.py runs it when its
targets include pdproxy-noattr and sets it against the whole proxy's CPU per request.

Run:  python benchmarks/recorder_cost.py [--rounds 9] [--requests 5000] [--stall-every 0 10]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # pdproxy, also when not installed


def recorder_cost(rounds: int, requests: int, stall_every: int, every_ms: float = 10.0,
                  inflight: int = 64) -> dict[str, float]:
    """CPU µs per request of the one recorder (pdproxy/telemetry/recorder.py) with the live stall attribution
    on and off, in this process, interleaved round by round so both see the same machine state.

    Each request goes the P/D way (admitted, prefill done, decode sent, 16 token events 5 ms apart,
    finished) on one decode, every `stall_every`-th with one 150 ms gap in the middle (0: none); a new one
    every `every_ms` of its own timeline (100 requests/s on the decode by default: a stall then coincides
    with ~15 other KV arrivals), `inflight` of them open at once. The attribution path (the record's query, the pd.stall event's cause, the links) runs once
    per request. Spans are built and encoded to OTLP, then dropped; metrics are recorded.
    """
    from pdproxy.telemetry.metrics import Metrics
    from pdproxy.telemetry.recorder import Recorder
    from pdproxy.telemetry.stalls import StallRecords
    from pdproxy.telemetry.tracing import Tracing

    class Drop:
        async def send(self, payload: bytes) -> bool:
            return True

        async def close(self) -> None:
            pass

    ms = 1_000_000

    async def one_round(attribution: bool) -> float:
        tracing = Tracing({"service.name": "bench"}, [Drop()], 1 << 17, on_drop=lambda reason, count: None)
        recorder = Recorder(Metrics(), tracing, stall_threshold=0.1,
                            stalls=StallRecords() if attribution else None)
        open_: list = []
        base = time.monotonic_ns()
        start = time.process_time()
        for i in range(requests):
            trace = recorder.begin(route="completions", operation="text_completion", chat=False, headers={},
                                   request_id=f"r{i}", pd_mode=True)
            at = base + int(i * every_ms * ms)  # this request's own timeline
            trace.admitted("127.0.0.1:8100", "127.0.0.1:8200")
            trace.prefill_done("127.0.0.1:8100", 200, 1, "{}")
            trace.t.prefill_done = at
            trace.decode_sent("127.0.0.1:8200")
            trace.decode_headers(200)
            first = at + 20 * ms  # its KV arrives in 20 ms
            gap = 150 * ms if stall_every and i % stall_every == 0 else 0
            trace.scan.chunk_times = [first + 5 * ms * k + (gap if k >= 8 else 0) for k in range(16)]
            trace.scan.chunk_tokens = [1] * 16
            trace.scan.usage = {"prompt_tokens": 200 + i % 7, "completion_tokens": 16}
            trace.scan.done = True
            open_.append(trace)
            if len(open_) > inflight:
                open_.pop(0).finish()
        for trace in open_:
            trace.finish()
        await tracing.shutdown()  # every span framed and handed over: its CPU is in the round's
        return (time.process_time() - start) / requests * 1e6

    on, off = [], []
    for r in range(rounds):  # alternate which goes first
        for attribution in ((True, False) if r % 2 == 0 else (False, True)):
            (on if attribution else off).append(asyncio.run(one_round(attribution)))
    return {"on_us": float(np.median(on)), "off_us": float(np.median(off)), "rounds": rounds, "requests": requests,
            "every_ms": every_ms, "stall_every": stall_every}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=9, help="rounds on and off, alternating which goes first")
    p.add_argument("--requests", type=int, default=5000, help="requests per round")
    p.add_argument("--stall-every", type=int, nargs="+", default=[0, 10],
                   help="every k-th request stalls once (0: none); one measurement per value")
    args = p.parse_args()
    print("| stalls | on µs/req | off µs/req | on / off |\n|---|---:|---:|---:|")
    for k in args.stall_every:
        cost = recorder_cost(rounds=args.rounds, requests=args.requests, stall_every=k)
        which = f"1 in {k}" if k else "none"
        print(f"| {which} | {cost['on_us']:.1f} | {cost['off_us']:.1f} | {cost['on_us'] / cost['off_us']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
