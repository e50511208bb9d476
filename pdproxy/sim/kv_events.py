"""The simulator's KV-cache events, as vLLM 0.23 publishes them (`--kv-events-config`, pdproxy.kvevents.publisher).

The prefix cache (pdproxy/sim/prefix_cache.py) says which blocks it stores and evicts; this turns them into
`BlockStored` (one per run of consecutive new blocks of a prompt, chained to the block before, with their token
ids) and `BlockRemoved`, and publishes everything of one event-loop turn as one batch (vLLM: one per engine
step). A decode caches a prompt's blocks when its KV arrives from the prefill, so its `BlockStored` marks a KV
arrival, as on vLLM. Block hashes are the simulator's own chained hashes (pdproxy/sim/prefix_cache.py).

Unlike vLLM, a tcp endpoint always binds (vLLM connects to one without `*`), so tests can stay on loopback.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pdproxy.kvevents.publisher import Publisher, removed, stored

KNOWN_BLOCKS = 1 << 20  # blocks whose tokens are remembered for their BlockStored (oldest forgotten first)


def parse_config(text: str) -> dict[str, Any] | None:
    """vLLM's --kv-events-config JSON -> the publisher's settings, or None when events are off."""
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    if not config.get("enable_kv_cache_events") or config.get("publisher", "null") == "null":
        return None
    if config.get("publisher") != "zmq":
        raise ValueError(f"--kv-events-config publisher {config.get('publisher')!r}: the simulator has 'zmq'")
    return {"endpoint": str(config.get("endpoint", "tcp://*:5557")),
            "replay_endpoint": config.get("replay_endpoint"), "topic": str(config.get("topic", "")),
            "buffer_steps": int(config.get("buffer_steps", 10_000)), "hwm": int(config.get("hwm", 100_000))}


class SimKVEvents:
    def __init__(self, config: dict[str, Any], block_size: int) -> None:
        self.block_size = block_size
        self.publisher = Publisher(config["endpoint"], config["replay_endpoint"], config["topic"],
                                   config["buffer_steps"], config["hwm"], bind=True)
        self._known: OrderedDict[int, tuple[int | None, list[int]]] = OrderedDict()  # hash -> (parent, tokens)
        self._pending: list = []
        self._flush_scheduled = False

    def start(self) -> None:
        self.publisher.start()

    def register(self, hashes: Sequence[int], prompt_ids: Sequence[int]) -> None:
        """A prompt's block hashes and tokens, so that storing its blocks can say what they hold."""
        size, known = self.block_size, self._known
        parent = None
        for k, h in enumerate(hashes):
            if h not in known:
                known[h] = (parent, list(prompt_ids[k * size:(k + 1) * size]))
            parent = h
        while len(known) > KNOWN_BLOCKS:
            known.popitem(last=False)

    def stored(self, hashes: Sequence[int]) -> None:
        """New blocks (in chain order) entered the prefix cache."""
        run: list[int] = []
        parent = None
        for h in hashes:
            entry = self._known.get(h)
            if entry is None:
                continue
            if run and entry[0] != run[-1]:
                self._stored_run(parent, run)
                run = []
            if not run:
                parent = entry[0]
            run.append(h)
        if run:
            self._stored_run(parent, run)

    def _stored_run(self, parent: int | None, run: list[int]) -> None:
        tokens = [t for h in run for t in self._known[h][1]]
        self._add(stored(list(run), parent, tokens, self.block_size))

    def removed(self, hashes: Sequence[int]) -> None:
        if hashes:
            self._add(removed(list(hashes)))

    def _add(self, event) -> None:
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        events, self._pending = self._pending, []
        if events:
            self.publisher.publish(events)

    async def close(self) -> None:
        await self.publisher.close()
