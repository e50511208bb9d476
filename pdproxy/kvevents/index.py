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

from collections import deque
from collections.abc import Sequence
from typing import Any

from pdproxy.blocks import KEY_MASK, ROOT, chain_hashes
from pdproxy.kvevents.decode import AllBlocksCleared, BlockRemoved, BlockStored, Event

DEFAULT_MAX_BLOCKS = 1 << 18  # 4M tokens of 16: above a GPU's cache; ~140 bytes each (benchmarks/membership_scale.py)


class BlockIndex:
    """One instance's cached blocks.

    Laid out for 100 engines' caches in one process (benchmarks/membership_scale.py): a plain dict from the
    engine's hash to our key (in storing order), a set of our keys, and every hash held to 60 bits (an int
    under 2**60 takes 32 bytes, a 64-bit one 48). Keys that several engine blocks name (LoRA adapters, cache
    salts: rare) count their extra names in `_extra`. Past `max_blocks`, the oldest stored blocks go first,
    from `_order`, kept only once the bound is reached (an engine's own removals normally keep the index
    below it, where keeping an order would cost memory for nothing)."""

    __slots__ = ("max_blocks", "block_size", "_engine", "_keys", "_extra", "_order", "orphans", "evicted", "stored",
                 "removed")

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.block_size: int | None = None  # from the events (the engine's --block-size)
        self._engine: dict[int, int] = {}  # engine hash (60 bits) -> our key, oldest first
        self._keys: set[int] = set()  # our keys held
        self._extra: dict[int, int] = {}  # our key -> engine blocks naming it beyond the first
        self._order: deque[int] | None = None  # engine hashes, oldest first, once the bound was reached
        self.orphans = self.evicted = self.stored = self.removed = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def key_of(self, engine_hash: int) -> int | None:
        """Our key for a block the engine names `engine_hash` (None: not held)."""
        return self._engine.get(engine_hash & KEY_MASK)

    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            self.store(event)
        elif isinstance(event, BlockRemoved):
            self.remove(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def apply_all(self, events: list[Event]) -> int:
        """Apply a batch's events in one call; the work done, in the subscriber's units (a token id, a hash, an
        event). The common events (a store of one block of the known size, a removal) are applied inline."""
        units = stored = removed = 0
        engine, keys, extra = self._engine, self._keys, self._extra
        size = self.block_size
        # (hashes and keys held as `Any`: compiled, an int is then one object shared by the dict and the set, as in
        # Python, instead of a new one boxed for each container: 32 bytes a block, and the allocations)
        for event in events:
            if type(event) is BlockStored:
                hashes, tokens = event.block_hashes, event.token_ids
                units += len(tokens) + len(hashes)
                if len(hashes) != 1 or event.block_size != size or len(tokens) != size or self._order is not None:
                    self.store(event)  # several blocks, a new block size, or past the bound
                    size = self.block_size
                    continue
                parent_hash: Any = event.parent_block_hash
                parent: Any = ROOT
                if parent_hash is not None:
                    parent = engine.get(parent_hash & KEY_MASK)
                    if parent is None:
                        self.orphans += 1
                        continue
                first: Any = hashes[0]
                engine_hash: Any = first & KEY_MASK
                if engine_hash in engine:
                    engine[engine_hash] = engine.pop(engine_hash)  # stored again: now the newest
                    continue
                key: Any = hash((parent, tuple(tokens))) & KEY_MASK  # (chain_hashes' key of one block)
                engine[engine_hash] = key
                if key in keys:
                    extra[key] = extra.get(key, 0) + 1
                else:
                    keys.add(key)
                stored += 1
                if len(engine) > self.max_blocks:
                    self._evict()
            elif type(event) is BlockRemoved:
                removing: Any = event.block_hashes
                units += len(removing) + 1
                for named in removing:
                    held: Any = engine.pop(named & KEY_MASK, None)
                    if held is not None:
                        removed += 1
                        if held in extra:
                            self._forget(held)
                        else:
                            keys.discard(held)
            else:
                self.apply(event)
                units += 1
        self.stored += stored
        self.removed += removed
        return units

    def store(self, event: BlockStored) -> None:
        size = event.block_size
        if self.block_size != size:
            if self.block_size is not None:
                self.clear()  # another block size: the engine was restarted differently
            self.block_size = size
        hashes = event.block_hashes
        engine = self._engine
        parent: Any = ROOT
        parent_hash: Any = event.parent_block_hash
        if parent_hash is not None:
            parent = engine.get(parent_hash & KEY_MASK)
            if parent is None:
                self.orphans += len(hashes)
                return
        tokens = event.token_ids
        if len(hashes) == 1 and len(tokens) == size:  # the common event: one block (chain_hashes' first key)
            self._put(hashes[0] & KEY_MASK, hash((parent, tuple(tokens))) & KEY_MASK)
        else:
            for engine_hash, key in zip(hashes, chain_hashes(tokens, size, parent)):
                self._put(engine_hash & KEY_MASK, key)
        if len(engine) > self.max_blocks:
            self._evict()

    def _put(self, engine_hash: Any, key: Any) -> None:
        engine = self._engine
        if engine_hash in engine:  # stored again: now the newest
            engine[engine_hash] = engine.pop(engine_hash)
        else:
            engine[engine_hash] = key
            if key in self._keys:
                self._extra[key] = self._extra.get(key, 0) + 1
            else:
                self._keys.add(key)
            self.stored += 1
        if self._order is not None:
            self._order.append(engine_hash)

    def _evict(self) -> None:
        engine = self._engine
        order = self._order
        if order is None:
            order = self._order = deque(engine)
        while len(engine) > self.max_blocks and order:
            engine_hash: Any = order.popleft()
            key: Any = engine.pop(engine_hash, None)  # (one removed since, or stored again later, is passed over)
            if key is not None:
                self._forget(key)
                self.evicted += 1
        if len(order) > 2 * len(engine) + 1024:
            self._order = deque(engine)  # the removed ones' entries dropped

    def remove(self, engine_hashes: Sequence[int]) -> None:
        engine = self._engine
        named: Any
        for named in engine_hashes:
            key: Any = engine.pop(named & KEY_MASK, None)
            if key is not None:
                self._forget(key)
                self.removed += 1

    def _forget(self, key: Any) -> None:
        extra = self._extra.get(key)
        if extra is None:
            self._keys.discard(key)
        elif extra > 1:
            self._extra[key] = extra - 1
        else:
            del self._extra[key]

    def clear(self) -> None:
        self._engine.clear()
        self._keys.clear()
        self._extra.clear()
        self._order = None

    def matched_blocks(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its `chain_hashes`) this instance holds.

        An engine's prefix cache holds whole prefixes: a block is stored only after its parent (else it is an
        orphan here) and evicted only before it (vLLM frees a request's blocks tail first, and a block's use
        refreshes its parent too, so its LRU order never evicts a parent before a child). The blocks held of a
        prompt are then always its first m: m is found by bisection, a few lookups per instance where a scan
        would take one per block (a 2,000-token system prompt every instance holds: 125 lookups each, at a cache
        miss apiece in a large index). Only this index's own bound (`max_blocks`, oldest stored first) can leave
        a gap: once it has forgotten blocks, the prompt is scanned block by block."""
        held = self._keys
        n = len(keys)
        probe: Any = keys[0] if n else None  # (Any: compiled, not boxed anew for each lookup)
        if not n or probe not in held:
            return 0
        if self.evicted:
            m = 0
            for probe in keys:
                if probe not in held:
                    break
                m += 1
            return m
        probe = keys[n - 1]
        if probe in held:
            return n
        low, high = 1, n - 1  # keys[low - 1] held, keys[high] not
        while low < high:
            middle = (low + high) // 2
            probe = keys[middle]
            if probe in held:
                low = middle + 1
            else:
                high = middle
        return low
