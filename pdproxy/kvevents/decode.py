"""vLLM's KV-cache event batches, from the msgpack payload of one ZMQ message.

vLLM 0.23 encodes a batch as msgspec's `array_like` tagged structs: `[ts, [event, ...], dp_rank]`, each
event a list whose first item is its tag (`["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]`, `["BlockRemoved", block_hashes,
medium, group_idx]`, `["AllBlocksCleared"]`). Later releases encode structs as maps with a `"type"` tag
(vllm-project/vllm#42892). Both decode to the same three small classes here. Only the fields a router
needs are kept. The types are checked as msgspec decodes (in C, so a batch of millions of token ids costs
no Python loop); an event of an unknown type is skipped and counted, a malformed event (a token id that is a
list, a hash that is a string, token ids not filling its blocks) is skipped and counted alone, and only a
payload that is not a batch at all raises `DecodeError`: nothing an engine sends gets past here unchecked.
"""

from __future__ import annotations

from typing import Any

import msgspec

_decoder = msgspec.msgpack.Decoder()


class DecodeError(ValueError):
    """A payload that is not a vLLM KV event batch."""


# The events as pdproxy uses them: msgspec structs (built in C: a frozen dataclass cost ~1 us apiece to make,
# some 100 ms a second at 100 engines' event rate), compared and printed as dataclasses were.
class BlockStored(msgspec.Struct, frozen=True, gc=False):
    block_hashes: list[int]  # the engine's hashes (seed-dependent): used only to resolve removals
    parent_block_hash: int | None  # None: the chain starts at the prompt's first block
    token_ids: list[int]  # block_size tokens per hash
    block_size: int
    medium: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    ts: float  # the engine's wall clock (time.time() on its host) when the batch was made
    events: list[Event]
    data_parallel_rank: int | None = None
    unknown: int = 0  # events of a type this decoder does not know (skipped)
    malformed: int = 0  # events of a known type with fields of the wrong type or shape (skipped)


# The wire's own shapes, validated by msgspec as it decodes (a token id must be an int, a hash an int or bytes):
# vLLM 0.23's positional tagged arrays, later releases' maps tagged by "type". Trailing fields this router does
# not use (lora_id, medium, lora_name, extra_keys, group_idx, ...) are accepted as anything, or ignored.
_Hash = int | bytes


class _StoredArray(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: Any = None
    medium: Any = None


class _RemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: Any = None


class _ClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _StoredMap(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    medium: Any = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: Any = None


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Any = None


# vLLM 0.23's shape exactly (tagged arrays, hashes as ints): nearly every batch an engine sends, decoded whole in
# one call; anything else (a map, a hash as bytes, an unknown or malformed event) is decoded event by event below.
class _StoredFast(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: Any = None
    medium: Any = None


class _RemovedFast(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Any = None


class _FastBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredFast | _RemovedFast | _ClearedArray]
    data_parallel_rank: Any = None


_fast = msgspec.msgpack.Decoder(_FastBatch)
_CLEARED = AllBlocksCleared()
_batch = msgspec.msgpack.Decoder(_Batch | dict[str, msgspec.Raw])
_float = msgspec.msgpack.Decoder(float)
_raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw])
_as_array = msgspec.msgpack.Decoder(_StoredArray | _RemovedArray | _ClearedArray)
_as_map = msgspec.msgpack.Decoder(_StoredMap | _RemovedMap | _ClearedMap)
_any = msgspec.msgpack.Decoder()
_MAP_MARKERS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))  # msgpack fixmap, map16, map32


def _hash(value: _Hash) -> int:
    # ExternalBlockHash: an int in 0.23; bytes in some releases (kept as an int either way)
    return value if type(value) is int else int.from_bytes(value, "big")  # type: ignore[arg-type]


def _hashes(values: list[_Hash]) -> list[int]:
    return [h if type(h) is int else int.from_bytes(h, "big") for h in values]  # type: ignore[misc]


def _event(raw: msgspec.Raw) -> Event | None:
    """One event; None for a type this decoder does not know; `DecodeError` if it is malformed."""
    data = memoryview(raw)
    try:
        wire = (_as_map if data and data[0] in _MAP_MARKERS else _as_array).decode(data)
    except msgspec.ValidationError:
        tag = _tag(data)
        if isinstance(tag, str) and tag not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            return None  # a newer event type: skipped
        raise DecodeError("malformed event") from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"malformed event: {exc}") from None
    medium = getattr(wire, "medium", None)
    medium = medium if isinstance(medium, str) else None
    if isinstance(wire, (_StoredArray, _StoredMap)):
        size, hashes, tokens = wire.block_size, wire.block_hashes, wire.token_ids
        if size < 1 or not hashes:  # (a store of no blocks changing the block size would empty the index)
            raise DecodeError(f"{len(hashes)} blocks of size {size}")
        if len(tokens) != size * len(hashes):
            raise DecodeError(f"{len(tokens)} token ids for {len(hashes)} blocks of {size}")
        parent = wire.parent_block_hash
        return BlockStored(_hashes(hashes), None if parent is None else _hash(parent), tokens, size, medium)
    if isinstance(wire, (_RemovedArray, _RemovedMap)):
        return BlockRemoved(_hashes(wire.block_hashes), medium)
    return AllBlocksCleared()


def _tag(data: memoryview) -> Any:
    try:
        raw = _any.decode(data)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and raw:
        return raw[0]
    return raw.get("type") if isinstance(raw, dict) else None


def decode_batch(payload: bytes) -> EventBatch:
    """One batch from a PUB or replay message's payload frame; `DecodeError` if it is not one. A malformed
    event inside a well-formed batch is skipped and counted (`malformed`), not the whole batch."""
    try:
        fast = _fast.decode(payload)
    except msgspec.DecodeError:  # (ValidationError included) not vLLM 0.23's plain shape: event by event
        return _decode_each(payload)
    out: list[Event] = []
    malformed = 0
    for wire in fast.events:
        if type(wire) is _StoredFast:
            size, hashes, tokens = wire.block_size, wire.block_hashes, wire.token_ids
            if size < 1 or not hashes or len(tokens) != size * len(hashes):
                malformed += 1  # (as _event says why)
                continue
            medium = wire.medium
            out.append(BlockStored(hashes, wire.parent_block_hash, tokens, size, medium if type(medium) is str else None))
        elif type(wire) is _RemovedFast:
            medium = wire.medium
            out.append(BlockRemoved(wire.block_hashes, medium if type(medium) is str else None))
        else:
            out.append(_CLEARED)
    rank = fast.data_parallel_rank
    return EventBatch(fast.ts, out, rank if type(rank) is int else None, 0, malformed)


def _decode_each(payload: bytes) -> EventBatch:
    try:
        raw = _batch.decode(payload)
        if isinstance(raw, dict):
            if "ts" not in raw or "events" not in raw:
                raise DecodeError("batch map without 'ts' and 'events'")
            raw = _Batch(_float.decode(raw["ts"]), _raw_list.decode(raw["events"]),
                         _any.decode(raw["data_parallel_rank"]) if "data_parallel_rank" in raw else None)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise DecodeError(f"not a batch: {exc}") from None
    out: list[Event] = []
    unknown = malformed = 0
    for item in raw.events:
        try:
            event = _event(item)
        except DecodeError:
            malformed += 1
            continue
        if event is None:
            unknown += 1
        else:
            out.append(event)
    rank = raw.data_parallel_rank
    return EventBatch(raw.ts, out, rank if type(rank) is int else None, unknown, malformed)


def parse_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence frame (signed: replay ends with -1)."""
    if len(frame) != 8:
        raise DecodeError(f"sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)
