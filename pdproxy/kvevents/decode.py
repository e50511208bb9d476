"""vLLM's KV-cache event batches, from the msgpack payload of one ZMQ message.

vLLM 0.23 encodes a batch as msgspec's `array_like` tagged structs: `[ts, [event, ...], dp_rank]`, each
event a list whose first item is its tag (`["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]`, `["BlockRemoved", block_hashes,
medium, group_idx]`, `["AllBlocksCleared"]`). Later releases encode structs as maps with a `"type"` tag
(vllm-project/vllm#42892). Both decode to the same three small classes here. Only the fields a router
needs are kept; unknown event types are skipped (counted), a malformed payload raises `DecodeError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_decoder = msgspec.msgpack.Decoder()


class DecodeError(ValueError):
    """A payload that is not a vLLM KV event batch."""


@dataclass(slots=True, frozen=True)
class BlockStored:
    block_hashes: list[int]  # the engine's hashes (seed-dependent): used only to resolve removals
    parent_block_hash: int | None  # None: the chain starts at the prompt's first block
    token_ids: list[int]  # block_size tokens per hash
    block_size: int
    medium: str | None = None


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True, frozen=True)
class EventBatch:
    ts: float  # the engine's wall clock (time.time() on its host) when the batch was made
    events: list[Event]
    data_parallel_rank: int | None = None
    unknown: int = 0  # events of a type this decoder does not know (skipped)


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _hash(value: Any) -> int:
    # ExternalBlockHash: an int in 0.23; bytes in some releases (kept as an int either way)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(value, "big")
    raise DecodeError(f"block hash of type {type(value).__name__}")


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list):
        raise DecodeError(f"{what} is not a list")
    return value


def _fields(raw: Any, names: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """(tag, {field: value}) from a positional or a map-encoded event."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0], dict(zip(names, raw[1:]))
    if isinstance(raw, dict) and isinstance(raw.get("type"), str):
        return raw["type"], raw
    raise DecodeError("event is neither a tagged array nor a map with a 'type'")


def _event(raw: Any) -> Event | None:
    tag = raw[0] if isinstance(raw, list) and raw else raw.get("type") if isinstance(raw, dict) else None
    if tag == "BlockStored":
        _, f = _fields(raw, _STORED_FIELDS)
        hashes = [_hash(h) for h in _ints(f.get("block_hashes"), "block_hashes")]
        parent = f.get("parent_block_hash")
        tokens = _ints(f.get("token_ids"), "token_ids")
        size = f.get("block_size")
        if not isinstance(size, int) or size < 1:
            raise DecodeError(f"block_size {size!r}")
        if len(tokens) != size * len(hashes):
            raise DecodeError(f"{len(tokens)} token ids for {len(hashes)} blocks of {size}")
        return BlockStored(hashes, None if parent is None else _hash(parent), tokens, size, f.get("medium"))
    if tag == "BlockRemoved":
        _, f = _fields(raw, _REMOVED_FIELDS)
        return BlockRemoved([_hash(h) for h in _ints(f.get("block_hashes"), "block_hashes")], f.get("medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if isinstance(tag, str):
        return None  # a newer event type: skipped
    raise DecodeError("event without a tag")


def decode_batch(payload: bytes) -> EventBatch:
    """One batch from a PUB or replay message's payload frame; `DecodeError` if it is not one."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not msgpack: {exc}") from None
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise DecodeError("batch is neither an array nor a map")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise DecodeError("batch without a timestamp and a list of events")
    out: list[Event] = []
    unknown = 0
    try:
        for item in events:
            event = _event(item)
            if event is None:
                unknown += 1
            else:
                out.append(event)
    except (TypeError, AttributeError, OverflowError) as exc:
        raise DecodeError(f"malformed event: {exc}") from None
    return EventBatch(float(ts), out, rank if isinstance(rank, int) else None, unknown)


def parse_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence frame (signed: replay ends with -1)."""
    if len(frame) != 8:
        raise DecodeError(f"sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)
