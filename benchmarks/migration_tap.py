"""What arming a stream for mid-stream migration costs the relay (--migrate-mid-stream).

An armed stream carries vLLM 0.23's `token_ids` on every event and goes through
`migration.TokenTap` (a JSON parse and re-serialisation per event, to keep the ids and hide them)
before the scanner; an unarmed one is only scanned (mostly without a parse: pdproxy/stream.py).
Both are measured here side by side, interleaved, in one process, on the same vLLM-shaped events
read the way the relay reads them (several events per read), and the ratio is printed.

Run:  python benchmarks/migration_tap.py [--events 200000] [--per-read 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdproxy.migration import TokenTap  # noqa: E402
from pdproxy.stream import ResponseScan  # noqa: E402


def stream(events: int, with_ids: bool) -> list[bytes]:
    """vLLM 0.23 completions chunks ("a word" per event), `per_read` to a read, as bytes."""
    head = {"id": "cmpl-bench", "object": "text_completion", "created": 1796116636, "model": "m"}
    out = []
    for i in range(events):
        choice = {"index": 0, "text": f" w{i % 97}", "logprobs": None, "finish_reason": None, "stop_reason": None,
                  "prompt_token_ids": [1, 2, 3] if (with_ids and i == 0) else None,
                  "token_ids": [1000 + i % 5000] if with_ids else None}
        out.append(b"data: " + json.dumps({**head, "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n")
    return out


def reads(events: list[bytes], per_read: int) -> list[bytes]:
    return [b"".join(events[i:i + per_read]) for i in range(0, len(events), per_read)]


def relay_plain(chunks: list[bytes]) -> float:
    scan = ResponseScan(chat=False)
    start = time.perf_counter()
    for data in chunks:
        scan.feed(data, 0)
    return time.perf_counter() - start


def relay_armed(chunks: list[bytes]) -> float:
    scan, tap = ResponseScan(chat=False), TokenTap(chat=False, keep_ids=False)
    start = time.perf_counter()
    for data in chunks:
        scan.feed(tap.feed(data), 0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--per-read", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    plain_reads = reads(stream(args.events, False), args.per_read)
    armed_reads = reads(stream(args.events, True), args.per_read)
    plain, armed = [], []
    for _ in range(args.rounds):  # interleaved, so both see the same machine state
        plain.append(relay_plain(plain_reads))
        armed.append(relay_armed(armed_reads))
    p, a = statistics.median(plain), statistics.median(armed)
    per = 1e6 / args.events
    print(f"{args.events} events, {args.per_read} per read, median of {args.rounds} rounds")
    print(f"  unarmed (scan only):        {p * per:7.2f} us/event")
    print(f"  armed (TokenTap + scan):    {a * per:7.2f} us/event")
    print(f"  ratio armed / unarmed:      {a / p:7.1f}x")


if __name__ == "__main__":
    main()
