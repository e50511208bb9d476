"""A scripted KV-event publisher process (vLLM 0.23's wire, pdproxy.kvevents.publisher) driven by JSON lines on stdin.

    {"store": [token ids], "send": true}   BlockStored for the full blocks of the tokens (root chain)
    {"remove": [token ids]}                BlockRemoved for them
    {"clear": true}                        AllBlocksCleared
Each line is answered on stdout with the batch's sequence number. The engine's block hashes are derived
from a per-process seed (as vLLM's depend on PYTHONHASHSEED), so they differ between runs."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys

from pdproxy.kvevents import chain_hashes
from pdproxy.kvevents.publisher import AllBlocksCleared, Publisher, removed, stored

BLOCK = 16


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--replay", default=None)
    parser.add_argument("--topic", default="kv@test")
    args = parser.parse_args()
    seed = random.getrandbits(32)
    pub = Publisher(args.endpoint, args.replay, args.topic, bind=True)
    pub.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    while line := await reader.readline():
        command = json.loads(line)
        engine = lambda tokens: [hash((h, seed)) & ((1 << 63) - 1) for h in chain_hashes(tokens, BLOCK)]
        if "store" in command:
            tokens = command["store"][: len(command["store"]) // BLOCK * BLOCK]
            events = [stored(engine(tokens), None, tokens, BLOCK)]
        elif "remove" in command:
            events = [removed(engine(command["remove"]))]
        else:
            events = [AllBlocksCleared()]
        print("seq", pub.publish(events, send=command.get("send", True)), flush=True)
    await pub.close()


if __name__ == "__main__":
    asyncio.run(main())
