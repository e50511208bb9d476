"""Which prompt prefixes one instance holds in its KV cache, from its own BlockStored / BlockRemoved events.

Blocks are keyed by pdproxy's chained hash of their token ids (`chain_hashes`: block i's key covers its
tokens and block i-1's key), the same function a prompt is hashed with, so every pdproxy process agrees
on the keys without sharing anything. The engine's block hash depends on its seed (PYTHONHASHSEED), so it
is kept only to resolve the engine's removals (and its `parent_block_hash`) to our keys.

Memory is bounded by `max_blocks` engine blocks per instance: past it the oldest stored blocks are
forgotten (the engine's own removals normally keep the index far below: a cache holds what fits in GPU
memory). A block stored with an unknown parent (an event missed before a resync) cannot be chained and
is skipped, counted as an orphan. LoRA adapters and cache salts change the engine's hash, not ours: a
prompt matches blocks of the same tokens whatever adapter stored them (an over-estimate, never a miss).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdproxy.blocks import ROOT, chain_hashes
from pdproxy.kvevents.decode import AllBlocksCleared, BlockRemoved, BlockStored, Event

DEFAULT_MAX_BLOCKS = 1 << 18  # 4M tokens of 16: above a GPU's cache; ~230 bytes each (benchmarks/kv_events.py)


class BlockIndex:
    """One instance's cached blocks."""

    __slots__ = ("max_blocks", "block_size", "_engine", "_keys", "orphans", "evicted", "stored", "removed")

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.block_size: int | None = None  # from the events (the engine's --block-size)
        self._engine: OrderedDict[int, int] = OrderedDict()  # engine hash -> our key, oldest first
        self._keys: dict[int, int] = {}  # our key -> engine blocks naming it (1 unless adapters/salts differ)
        self.orphans = self.evicted = self.stored = self.removed = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            self.store(event)
        elif isinstance(event, BlockRemoved):
            self.remove(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def store(self, event: BlockStored) -> None:
        if self.block_size != event.block_size:
            if self.block_size is not None:
                self.clear()  # another block size: the engine was restarted differently
            self.block_size = event.block_size
        if event.parent_block_hash is None:
            parent = ROOT
        else:
            parent = self._engine.get(event.parent_block_hash)
            if parent is None:
                self.orphans += len(event.block_hashes)
                return
        engine, keys = self._engine, self._keys
        for engine_hash, key in zip(event.block_hashes, chain_hashes(event.token_ids, event.block_size, parent)):
            old = engine.get(engine_hash)
            if old is not None:
                engine.move_to_end(engine_hash)
                continue
            engine[engine_hash] = key
            keys[key] = keys.get(key, 0) + 1
            self.stored += 1
        while len(engine) > self.max_blocks:
            _, key = engine.popitem(last=False)
            self._forget(key)
            self.evicted += 1

    def remove(self, engine_hashes: Sequence[int]) -> None:
        engine = self._engine
        for engine_hash in engine_hashes:
            key = engine.pop(engine_hash, None)
            if key is not None:
                self._forget(key)
                self.removed += 1

    def _forget(self, key: int) -> None:
        left = self._keys[key] - 1
        if left:
            self._keys[key] = left
        else:
            del self._keys[key]

    def clear(self) -> None:
        self._engine.clear()
        self._keys.clear()

    def matched_blocks(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its `chain_hashes`) this instance holds."""
        held, n = self._keys, 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n
