"""A fleet of simulated vLLM 0.23 engines' KV-event publishers in one process, cheap enough to run 100 beside the
proxy under test on a 2-core machine.

Each engine has vLLM's two sockets (pdproxy/kvevents/publisher.py's wire): a PUB socket sending `[topic, seq,
payload]` and a ROUTER socket answering replays from a bounded buffer. What it sends imitates one real engine
under decode load (shared/research/real-kv-routing-2026-12-04: 862-1,357 events/s in 33-42 batches/s, mostly
BlockStored of one 16-token block, BlockRemoved once the cache is full): `--rate` events/s in `--batches` batches/s,
each event one block; 256 running sequences each extend their chain by one block (parent = their last block) and
end after 16 blocks; once `--capacity` blocks are held, 36 % of the events are BlockRemoved of finished sequences'
blocks, oldest first (the measured 872:485 mix). Every payload is encoded before `go`, so that sending costs this
process one `send_multipart` per batch; engines' phases are spread over the batch interval.

Run as a script (a separate process), driven by lines on stdin:

    python benchmarks/harness/kv_engines.py --count 25 --rate 1100 --batches 37 --seconds 20
    -> {"engines": [{"pub": "tcp://127.0.0.1:P", "replay": "tcp://127.0.0.1:R"}, ...]}   (one JSON line)
    go     -> publishing starts; at the end {"sent_events": N, "sent_batches": B, "late_batches": L, "cpu": S}
    stop   (or end of input) -> the sockets close and the process exits

Between the end of publishing and `stop` the replay sockets keep answering. `--rate 0`: engines that publish
nothing (for churn: endpoints that exist, answer replays, and are subscribed and dropped).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import random
import resource
import sys
import time
from collections import deque

import msgspec
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from pdproxy.kvevents.publisher import _Batch, removed, stored  # noqa: E402  (the simulator's wire types)

BLOCK = 16
SEQUENCES = 256  # running sequences per engine (max-num-seqs of the measured run)
SEQUENCE_BLOCKS = 16  # blocks a sequence stores before it finishes (256 output tokens)
VOCABULARY = 128_000
REMOVED_SHARE = 485 / 1357  # BlockRemoved share of the events once the cache is full (the measured run)
TICK_MS = 5  # sending wakes at most every 5 ms (a batch up to 5 ms late: engines are not clockwork either)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Engine:
    """One engine's stream: its payloads, made ahead, and its sockets."""

    def __init__(self, ctx: zmq.Context, n: int, seed: int, topic: bytes, buffer: int) -> None:
        self.n = n
        self.topic = topic
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.seq = 0
        self.payloads: list[tuple[bytes, int]] = []  # (payload, events)
        self.rng = random.Random(seed)
        self.hash_base = self.rng.getrandbits(62)
        self.counter = itertools.count()

    def endpoints(self) -> dict[str, str]:
        return {"pub": self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                "replay": self.router.getsockopt_string(zmq.LAST_ENDPOINT)}

    def prepare(self, batches: int, rate: float, per_second: float, capacity: int) -> None:
        """Every batch this engine will send, encoded."""
        encoder = msgspec.msgpack.Encoder()
        rng = self.rng
        chains: list[tuple[int | None, list[int]]] = [(None, []) for _ in range(SEQUENCES)]
        finished: deque[int] = deque()
        held = 0
        per_batch = rate / per_second
        owed = 0.0
        ts = time.time()
        for _ in range(batches):
            owed += per_batch
            count = int(owed)
            owed -= count
            events: list = []
            for _ in range(count):
                if held >= capacity and finished and rng.random() < REMOVED_SHARE:
                    events.append(removed([finished.popleft()]))
                    held -= 1
                    continue
                k = rng.randrange(SEQUENCES)
                parent, blocks = chains[k]
                h = (self.hash_base + next(self.counter)) & ((1 << 63) - 1)
                start = rng.randrange(VOCABULARY - BLOCK)  # (token ids as a 128k vocabulary's: 1-3 msgpack bytes)
                events.append(stored([h], parent, list(range(start, start + BLOCK)), BLOCK))
                held += 1
                blocks.append(h)
                if len(blocks) >= SEQUENCE_BLOCKS:
                    finished.extend(blocks)
                    chains[k] = (None, [])
                else:
                    chains[k] = (h, blocks)
            ts += 1 / per_second
            self.payloads.append((encoder.encode(_Batch(ts, events, 0)), len(events)))

    def send(self, payload: bytes) -> bool:
        seq = self.seq
        self.seq += 1
        frame = seq.to_bytes(8, "big")
        self.buffer.append((seq, payload))
        try:
            self.pub.send_multipart((self.topic, frame, payload), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def answer(self) -> None:
        """Every waiting replay request, answered from the buffer."""
        while True:
            try:
                frames = self.router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    self.router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self.router.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=25)
    parser.add_argument("--rate", type=float, default=1100.0, help="events/s per engine")
    parser.add_argument("--batches", type=float, default=37.0, help="batches/s per engine")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--capacity", type=int, default=2048, help="blocks an engine holds before it removes")
    parser.add_argument("--buffer", type=int, default=200, help="batches kept for replay (vLLM: 10,000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--topic", default="kv@bench")
    args = parser.parse_args()
    ctx = zmq.Context()
    engines = [Engine(ctx, n, args.seed * 1000 + n, args.topic.encode(), args.buffer) for n in range(args.count)]
    batches = int(args.seconds * args.batches) if args.rate > 0 else 0
    for engine in engines:
        engine.prepare(batches, args.rate, args.batches, args.capacity)
    print(json.dumps({"engines": [e.endpoints() for e in engines]}), flush=True)
    poller = zmq.Poller()
    for engine in engines:
        poller.register(engine.router, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    by_socket = {e.router: e for e in engines}
    interval = 1 / args.batches
    started: float | None = None
    due: list[tuple[float, int]] = []  # a heap of (when, engine)
    position = [0] * len(engines)
    sent_events = sent_batches = late = dropped = 0
    cpu0 = 0.0
    reported = False
    while True:
        timeout = 200.0
        if started is not None and not reported:
            now = time.monotonic()
            while due and due[0][0] <= now:
                at, k = heapq.heappop(due)
                engine = engines[k]
                payload, n = engine.payloads[position[k]]
                if not engine.send(payload):
                    dropped += 1
                if now - at > interval:
                    late += 1
                position[k] += 1
                sent_events += n
                sent_batches += 1
                if position[k] < len(engine.payloads):
                    heapq.heappush(due, (at + interval, k))
            if due:
                timeout = max(TICK_MS, math.ceil((due[0][0] - time.monotonic()) * 1000))  # (poll takes whole ms)
            else:
                reported = True
                print(json.dumps({"sent_events": sent_events, "sent_batches": sent_batches, "late_batches": late,
                                  "dropped_batches": dropped, "cpu": cpu() - cpu0,
                                  "seconds": time.monotonic() - started}), flush=True)
        for sock, _ in poller.poll(timeout):
            if sock == sys.stdin.fileno():
                text = os.read(sys.stdin.fileno(), 4096).decode()  # (not readline: its buffer hides lines from poll)
                if not text or "stop" in text:
                    for engine in engines:
                        engine.close()
                    ctx.term()
                    return
                if "go" in text and started is None:
                    started = time.monotonic()
                    cpu0 = cpu()
                    spread = random.Random(args.seed)
                    due = sorted((started + spread.random() * interval, k) for k in range(len(engines))
                                 if engines[k].payloads)
            else:
                by_socket[sock].answer()


if __name__ == "__main__":
    main()
