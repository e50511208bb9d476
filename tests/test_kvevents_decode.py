"""The recorded real vLLM 0.23 KV-event stream decodes with the code the proxy runs, and builds the prefix index.

Fixture: tests/fixtures/kv_events_vllm023/ (provenance in its README)."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from pdproxy.kvevents import (AllBlocksCleared, BlockIndex, BlockRemoved, BlockStored, DecodeError, chain_hashes,
                              decode_batch, parse_seq)

RECORDING = Path(__file__).parent / "fixtures" / "kv_events_vllm023" / "kv-events-raw.jsonl"


def messages():
    for line in RECORDING.read_text().splitlines():
        record = json.loads(line)
        topic, seq, payload = (base64.b64decode(f) for f in record["frames"])
        yield record["src"], topic, parse_seq(seq), payload


def test_recorded_stream_decodes_with_the_counts_observed():
    events: Counter = Counter()
    seqs: dict[str, list[int]] = {}
    for src, topic, seq, payload in messages():
        assert topic == f"kv@{src}@smoke".encode()
        batch = decode_batch(payload)
        assert batch.unknown == 0 and batch.data_parallel_rank == 0
        assert 1.7e9 < batch.ts < 1.9e9
        seqs.setdefault(src, []).append(seq)
        for event in batch.events:
            events[src, type(event).__name__] += 1
            if isinstance(event, BlockStored):
                assert event.block_size == 16 and len(event.token_ids) == 16 * len(event.block_hashes)
    # the research note's table (vllm023-kv-events.md)
    assert events == {("p0", "BlockStored"): 45, ("p0", "BlockRemoved"): 69, ("d0", "BlockStored"): 47,
                      ("d1", "BlockStored"): 44}
    assert {src: s for src, s in seqs.items()} == {"p0": list(range(6)), "d0": list(range(29)),
                                                    "d1": list(range(32))}


def build(transform=lambda h: h) -> dict[str, BlockIndex]:
    indexes: dict[str, BlockIndex] = {}
    for src, _, _, payload in messages():
        index = indexes.setdefault(src, BlockIndex())
        for event in decode_batch(payload).events:
            if isinstance(event, BlockStored):
                event = BlockStored([transform(h) for h in event.block_hashes],
                                    None if event.parent_block_hash is None else transform(event.parent_block_hash),
                                    event.token_ids, event.block_size)
            elif isinstance(event, BlockRemoved):
                event = BlockRemoved([transform(h) for h in event.block_hashes])
            index.apply(event)
    return indexes


def test_index_follows_stores_and_evictions_and_is_keyed_by_tokens_not_engine_hashes():
    indexes = build()
    p0, d0, d1 = indexes["p0"], indexes["d0"], indexes["d1"]
    assert (p0.stored, p0.removed, len(p0), p0.orphans) == (545, 69, 545 - 69, 0)
    assert (len(d0), d0.orphans, len(d1), d1.orphans) == (377, 0, 404, 0)
    # an engine with another seed names every block differently: our keys are the same
    other = build(lambda h: hash((h, "another seed")) & ((1 << 64) - 1))
    for name, index in indexes.items():
        assert set(index._keys) == set(other[name]._keys)
    # a prompt made of d0's first stored chain matches all its blocks there, and none of an unrelated prompt
    first = next(e for _, _, _, p in messages() for e in decode_batch(p).events if isinstance(e, BlockStored))
    keys = chain_hashes(first.token_ids + [7] * 20, 16)
    assert d0.matched_blocks(keys) == len(first.block_hashes) == 60
    assert d0.matched_blocks(chain_hashes([first.token_ids[0] + 1] + first.token_ids[1:], 16)) == 0


class StoredMap(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class RemovedMap(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class ClearedMap(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class BatchMap(msgspec.Struct):
    ts: float
    events: list[StoredMap | RemovedMap | ClearedMap]
    data_parallel_rank: int | None = None


def test_map_encoding_of_later_releases_decodes_to_the_same_events():
    encoder = msgspec.msgpack.Encoder()
    for _, _, _, payload in messages():
        positional = decode_batch(payload)
        as_maps = BatchMap(positional.ts, [
            StoredMap(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, None, e.medium)
            if isinstance(e, BlockStored) else RemovedMap(e.block_hashes, e.medium) if isinstance(e, BlockRemoved)
            else ClearedMap() for e in positional.events], 0)
        raw = encoder.encode(as_maps)
        assert msgspec.msgpack.decode(raw)["events"][0]["type"] in ("BlockStored", "BlockRemoved")
        assert decode_batch(raw) == positional
    cleared = decode_batch(encoder.encode(BatchMap(1.0, [ClearedMap()])))
    assert cleared.events == [AllBlocksCleared()]


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", msgspec.msgpack.encode([1.0]), msgspec.msgpack.encode("x"), msgspec.msgpack.encode([True, []]),
    msgspec.msgpack.encode([1.0, "events"]), msgspec.msgpack.encode({"ts": "now", "events": []}),
    msgspec.msgpack.encode({"events": []}),
])
def test_payloads_that_are_not_batches_raise_decode_error(payload):
    with pytest.raises(DecodeError):
        decode_batch(payload)


GOOD = ["BlockStored", [7], None, list(range(16)), 16, None, "GPU", None]


@pytest.mark.parametrize("event", [
    ["BlockStored", [1, 2], None, [1] * 16, 16, None, "GPU", None],  # token ids do not fill the blocks
    ["BlockStored", ["x"], None, [1] * 16, 16],  # a hash that is a string
    ["BlockStored", [1], None, [1] * 16, 0],  # block size 0
    ["BlockStored", [], None, [], 1 << 40],  # no blocks (its block size would have emptied the index)
    ["BlockStored", [1], None, [[1, 2]] * 16, 16],  # token ids that are lists (crashed the subscriber: issue 39)
    ["BlockStored", [1], None, [True] * 16, 16],  # booleans are not token ids
    ["BlockStored", [1], [1], [1] * 16, 16],  # a parent that is a list
    ["BlockRemoved", [{"h": 1}]], ["BlockRemoved"], [1, 2], [], "BlockStored", {"type": 3},
    {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": ["a"] * 16,
     "block_size": 16},
])
def test_a_malformed_event_is_skipped_and_counted_alone(event):
    batch = decode_batch(msgspec.msgpack.encode([1.0, [event, GOOD, ["AllBlocksCleared"]], 0]))
    assert batch.malformed == 1 and batch.unknown == 0
    assert batch.events == [BlockStored([7], None, list(range(16)), 16, "GPU"), AllBlocksCleared()]


def test_unknown_event_types_are_skipped_and_counted():
    batch = decode_batch(msgspec.msgpack.encode([2.0, [["SomethingNew", 1], ["AllBlocksCleared"]], None]))
    assert batch.events == [AllBlocksCleared()] and batch.unknown == 1


def test_index_bound_forgets_the_oldest_blocks():
    index = BlockIndex(max_blocks=10)
    tokens = list(range(16 * 25))
    index.apply(BlockStored(list(range(100, 125)), None, tokens, 16))
    assert len(index) == 10 and index.evicted == 15
    index.apply(BlockRemoved([124, 999]))
    assert len(index) == 9 and index.removed == 1
    index.apply(BlockStored([200], 5, [1] * 16, 16))  # its parent was forgotten: an orphan
    assert index.orphans == 1 and len(index) == 9
    index.apply(AllBlocksCleared())
    assert len(index) == 0 and index.matched_blocks(chain_hashes(tokens, 16)) == 0


def test_block_hashes_sent_as_bytes_are_kept_as_ints():
    digest = bytes(range(32))  # vLLM's sha256 block hash, when not converted to an int
    batch = decode_batch(msgspec.msgpack.encode(
        [1.0, [["BlockStored", [digest], digest, [5] * 16, 16, None, "GPU", None], ["BlockRemoved", [digest, 9]]], 0]))
    assert batch.malformed == 0
    assert batch.events == [BlockStored([int.from_bytes(digest, "big")], int.from_bytes(digest, "big"), [5] * 16, 16,
                                        "GPU"), BlockRemoved([int.from_bytes(digest, "big"), 9])]
