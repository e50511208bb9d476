"""Publish KV-cache events as vLLM 0.23's ZmqEventPublisher does, for the simulator (and tests).

The same wire: a PUB socket sending `[topic, seq (8-byte big-endian, from 0), payload]`, the payload a
msgpack `array_like` tagged batch `[ts, [event, ...], dp_rank]`; a ROUTER socket answering a DEALER's
`[b"", start_seq]` with `[b"", seq, payload]` for every buffered batch from `start_seq`, then
`[b"", -1, b""]`. Endpoints with `*` bind (as vLLM's heuristic). Runs on the caller's asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger("pdproxy.kvevents.publisher")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class _Event(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> BlockStored:
    """A BlockStored as vLLM 0.23 fills it for a GPU block of the full-attention group."""
    return BlockStored(hashes, parent, token_ids, block_size, None, "GPU", None, None, 0, "full_attention", None)


def removed(hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(hashes, "GPU", 0)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, bind: bool | None = None) -> None:
        """`bind` None: vLLM's rule (an endpoint with `*`, `::`, ipc:// or inproc:// binds, any other connects)."""
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.IPV6, 1)
        (self._pub.bind if (_binds(endpoint) if bind is None else bind) else self._pub.connect)(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self.published = 0

    def start(self) -> None:
        """Serve replay requests (call on the running loop)."""
        if self.replay_endpoint and self._replay is None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.IPV6, 1)
            self._replay.bind(self.replay_endpoint)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="kv-events-replay")

    async def stop_replay(self) -> None:
        """Stop answering replay requests (the ROUTER socket goes away; `start` brings it back)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._replay is not None:
            self._replay.close(0)
            self._replay = None

    def publish(self, events: list, ts: float | None = None, send: bool = True) -> int:
        """One batch, numbered; `send=False` keeps it for replay only (a batch a subscriber missed)."""
        return self.publish_payload(self._encoder.encode(_Batch(time.time() if ts is None else ts, events, 0)), send)

    def publish_payload(self, payload: bytes, send: bool = True, seq: int | None = None) -> int:
        """An encoded batch, numbered (or, for a test of a faulty engine, under the given number)."""
        if seq is None:
            seq = self._seq
            self._seq += 1
        self._buffer.append((seq, payload))
        if send:
            with contextlib.suppress(zmq.Again):  # PUB drops at its high-water mark, as vLLM's does
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self.published += 1
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", END_SEQ, b""))

    async def close(self) -> None:
        await self.stop_replay()
        self._pub.close(0)
        self._ctx.term()
