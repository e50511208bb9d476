"""A scripted KV-event publisher process (vLLM 0.23's wire, pdproxy.kvevents.publisher) driven by JSON lines on stdin,
and `PublisherProcess`, which starts one for a test and drives it.

    {"store": [token ids], "send": true}   BlockStored for the full blocks of the tokens (root chain)
    {"remove": [token ids]}                BlockRemoved for them
    {"clear": true}                        AllBlocksCleared
    {"every": S, "seconds": T}             in the background, a new 4-block prompt stored every S s for T s
    {"flood": N, "blocks": B}              N batches at once, each storing B blocks of new tokens
    {"big": N, "bytes": M}                 N batches of some M bytes each (one BlockStored of M / 5 token ids)
    {"malformed": [token ids]}             one batch: a BlockStored whose token ids are lists, then a good one
    {"seq": N, "store": [...], "send": b}  a batch under sequence N (a faulty engine), the count left as it was
    {"replay": false}                      the replay (ROUTER) socket goes away; {"replay": true} brings it back
    {"old_answers": N}                     the next replay answers N batches of sequence 0 before its own
Each line is answered on stdout with the last batch's sequence number (or 0). The engine's block hashes are
derived from a per-process seed (as vLLM's depend on PYTHONHASHSEED), so they differ between runs."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq

from pdproxy.kvevents import chain_hashes
from pdproxy.kvevents.publisher import END_SEQ, AllBlocksCleared, Publisher, removed, stored

BLOCK = 16


class PublisherProcess:
    """tests/kv_publisher.py in a process group of its own (stop() kills the group), on `host` (an IPv6
    literal in brackets works too)."""

    def __init__(self, pub: int, replay: int | None, host: str = "127.0.0.1", topic: str = "kv@test") -> None:
        from procs import spawn

        args = [sys.executable, __file__, "--endpoint", f"tcp://{host}:{pub}", "--topic", topic]
        if replay is not None:
            args += ["--replay", f"tcp://{host}:{replay}"]
        self.popen = spawn(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        assert self.popen.stdout.readline().strip() == "ready"

    def send(self, **command) -> int:
        self.popen.stdin.write(json.dumps(command) + "\n")
        self.popen.stdin.flush()
        return int(self.popen.stdout.readline().split()[1])

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


class ScriptedPublisher(Publisher):
    old_answers = 0

    def start(self) -> None:
        super().start()
        if self._replay is not None:
            self._replay.setsockopt(zmq.SNDHWM, 0)  # every old answer queued, none dropped

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            client, _, start = frames
            if self.old_answers:  # sent at once, from a blocking loop (as vLLM's replay thread sends)
                sync = zmq.Socket.shadow(self._replay.underlying)
                for _ in range(self.old_answers):
                    sync.send_multipart((client, b"", (0).to_bytes(8, "big"), b""))
                self.old_answers = 0
            for seq, payload in list(self._buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", END_SEQ, b""))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--replay", default=None)
    parser.add_argument("--topic", default="kv@test")
    args = parser.parse_args()
    seed = random.getrandbits(32)
    fresh = itertools.count(1 << 20)  # token ids no scripted prompt uses (and that msgpack encodes in 5 bytes)
    pub = ScriptedPublisher(args.endpoint, args.replay, args.topic, bind=True)
    pub.start()
    encoder = msgspec.msgpack.Encoder()
    background: set[asyncio.Task] = set()

    def engine(tokens: list[int]) -> list[int]:
        return [hash((h, seed)) & ((1 << 63) - 1) for h in chain_hashes(tokens, BLOCK)]

    def store(tokens: list[int]) -> list:
        tokens = tokens[: len(tokens) // BLOCK * BLOCK]
        return [stored(engine(tokens), None, tokens, BLOCK)]

    async def every(interval: float, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pub.publish(store([next(fresh) for _ in range(4 * BLOCK)]))
            await asyncio.sleep(interval)

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    while line := await reader.readline():
        command = json.loads(line)
        send = command.get("send", True)
        seq = 0
        if "every" in command:
            task = loop.create_task(every(command["every"], command["seconds"]))
            background.add(task)
            task.add_done_callback(background.discard)
        elif "flood" in command:
            for _ in range(command["flood"]):
                seq = pub.publish(store([next(fresh) for _ in range(command["blocks"] * BLOCK)]), send=send)
        elif "big" in command:
            for _ in range(command["big"]):
                seq = pub.publish(store([next(fresh) for _ in range(command["bytes"] // 5 // BLOCK * BLOCK)]))
        elif "malformed" in command:
            tokens = command["malformed"]
            bad = ["BlockStored", [1], None, [[t] for t in tokens[:BLOCK]], BLOCK, None, "GPU", None]
            good = ["BlockStored", engine(tokens), None, tokens, BLOCK, None, "GPU", None]
            seq = pub.publish_payload(encoder.encode([time.time(), [bad, good], 0]), send)
        elif "seq" in command:
            seq = pub.publish_payload(encoder.encode([time.time(), [store(command["store"])[0]], 0]), send,
                                      command["seq"])
        elif "replay" in command:
            if command["replay"]:
                pub.start()
            else:
                await pub.stop_replay()
        elif "old_answers" in command:
            pub.old_answers = command["old_answers"]
        elif "store" in command:
            seq = pub.publish(store(command["store"]), send=send)
        elif "remove" in command:
            seq = pub.publish([removed(engine(command["remove"]))], send=send)
        else:
            seq = pub.publish([AllBlocksCleared()], send=send)
        print("seq", seq, flush=True)
    await pub.close()


if __name__ == "__main__":
    asyncio.run(main())
