"""The chained block hash of a prompt's token ids: one function the event index and the routing rules share.

Block i's key covers its tokens and block i-1's key, so a prompt's first k keys name its first k blocks
whatever follows; every pdproxy process computes the same keys without sharing anything. It lives below
both `kvevents` (which keys the engines' stored blocks with it) and `policies`/`routing` (which key a
prompt with it), so neither package imports the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

ROOT: Final = 0  # the key a chain starts from (as pdproxy/sim/prefix_cache.py)
# Keys are kept to 60 bits: CPython stores an int under 2**60 in 32 bytes and a full 64-bit one in 48, and an
# index holds millions of them (100 engines' caches); 60 bits still make a collision among them negligible.
KEY_MASK: Final = (1 << 60) - 1


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT, limit: int | None = None) -> list[int]:
    """The chained key of every full block of `token_ids` (at most `limit` blocks), chained from `parent`."""
    count = len(token_ids) // block_size
    if limit is not None:
        count = min(count, limit)
    out: list[int] = []
    h = parent
    for start in range(0, count * block_size, block_size):
        h = hash((h, tuple(token_ids[start:start + block_size]))) & KEY_MASK
        out.append(h)
    return out
