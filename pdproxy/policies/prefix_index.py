"""Which instances were recently sent which prompt prefixes, in bounded memory.

One ordered map for the pool: prefix hash (`request.PrefixKey.points`) -> bit set of the instances that
got a prompt with that prefix. Most recently used entries are at the end; once the map holds
`max_entries`, the least recently used ones are dropped at once, so the index never exceeds its
bound (vllm-router sweeps its trees every --eviction-interval-secs instead; here no sweep is needed).
The instances' own caches evict as well: an entry says "likely cached", never "cached".
"""

from __future__ import annotations

from collections import OrderedDict

from pdproxy.policies.request import PrefixKey


class PrefixIndex:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, int] = OrderedDict()
        self.sizes: dict[int, int] = {}  # instance bit -> entries naming it (its share of the index)

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, key: PrefixKey, among: int) -> dict[int, int]:
        """For each instance bit in the mask `among`: the longest prefix of `key` it got (units); 0s omitted."""
        found: dict[int, int] = {}
        entries = self._entries
        for length, h in reversed(key.points):
            owners = entries.get(h, 0) & among
            if owners:
                for bit in _bits(owners):
                    found[bit] = length
                among &= ~owners
                if not among:
                    break
        return found

    def insert(self, key: PrefixKey, bit: int) -> None:
        """Remember that instance `bit` got `key`'s prompt (all its prefixes), evicting the oldest if full."""
        entries, sizes, flag = self._entries, self.sizes, 1 << bit
        for _, h in key.points:
            owners = entries.get(h)
            if owners is None:
                entries[h] = flag
                sizes[bit] = sizes.get(bit, 0) + 1
                continue
            if not owners & flag:
                entries[h] = owners | flag
                sizes[bit] = sizes.get(bit, 0) + 1
            entries.move_to_end(h)
        while len(entries) > self.max_entries:
            _, owners = entries.popitem(last=False)
            for b in _bits(owners):
                sizes[b] -= 1


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
