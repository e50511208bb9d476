"""vLLM's automatic prefix caching, as far as TTFT and the counters go.

A prompt's full KV blocks are named by a chained hash (block i's hash covers its tokens and block
i-1's hash, as vLLM's `hash_block_tokens`), so a block can only be reused by a prompt that shares
everything before it. Computed blocks stay cached after their request ends, in the blocks nobody
uses: the cache holds at most the pool's free blocks and evicts the least recently used first. A
request's blocks are touched tail first, so its first blocks are the last to go (vLLM frees a
request's blocks in reverse order for the same reason). A new request is charged prefill time only
for the tokens after its longest cached prefix, and at least its last token is always computed.

Hashing runs over whatever token ids the request has (`GenerationRequest.prompt_ids`). The cache
is per instance; nothing here is shared between instances.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

UNBOUNDED_BLOCKS = 1 << 20  # cache bound when the pool itself is unbounded (the instant preset)


def block_hashes(units: Sequence[Any], block_size: int) -> list[int]:
    """The chained hash of every full block of `units` (token ids, or the simulator's word tokens)."""
    out: list[int] = []
    h = 0
    for start in range(0, len(units) - block_size + 1, block_size):
        h = hash((h, tuple(units[start:start + block_size])))
        out.append(h)
    return out


class PrefixCache:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.events: Any = None  # pdproxy/sim/kv_events.py: told what is stored and evicted (vLLM's KV events)

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached (not touched: the request may not start now)."""
        if not self.enabled:
            return 0
        blocks, n = self._blocks, 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[int]) -> None:
        """Add or refresh these blocks, tail first, so the leading ones are the most recent."""
        if not self.enabled:
            return
        blocks = self._blocks
        new = [h for h in hashes if h not in blocks] if self.events is not None else None
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        if new:
            self.events.stored(new)

    def trim(self, capacity: int) -> None:
        """Keep at most `capacity` blocks (the pool's free ones), dropping the least recently used."""
        blocks = self._blocks
        gone = []
        while len(blocks) > capacity:
            gone.append(blocks.popitem(last=False)[0])
        if gone and self.events is not None:
            self.events.removed(gone)
