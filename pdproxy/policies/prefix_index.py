"""Which instances were recently sent which prompt prefixes, in bounded memory.

One ordered map for the pool: prefix hash (`request.PrefixKey.hashes`) -> bit set of the instances that
got a prompt with that prefix. Most recently used entries are at the end; once the map holds
`max_entries`, the least recently used ones are dropped at once, so the index never exceeds its
bound (vllm-router sweeps its trees every --eviction-interval-secs instead; here no sweep is needed).
The instances' own caches evict as well: an entry says "likely cached", never "cached".
"""

from __future__ import annotations

from collections import OrderedDict, deque

from pdproxy.policies.request import PrefixKey


class PrefixIndex:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, int] = OrderedDict()
        self.sizes: dict[int, int] = {}  # instance bit -> entries naming it (its share of the index)

    def __len__(self) -> int:
        return len(self._entries)

    def owners(self, key: PrefixKey) -> list[int | None]:
        """The bit set of instances that got each of `key`'s prefixes (None: no instance)."""
        return list(map(self._entries.get, key.hashes))

    @staticmethod
    def match(key: PrefixKey, owners: list[int | None], among: int) -> dict[int, int]:
        """For each instance bit in the mask `among`: the longest prefix of `key` it got (units); 0s omitted."""
        found: dict[int, int] = {}
        lengths = key.lengths
        for k in range(len(owners) - 1, -1, -1):
            got = owners[k]
            if got and got & among:
                got &= among
                among ^= got
                while got:
                    low = got & -got
                    found[low.bit_length() - 1] = lengths[k]
                    got ^= low
                if not among:
                    break
        return found

    def insert(self, key: PrefixKey, owners: list[int | None], bit: int) -> None:
        """Remember that instance `bit` got `key`'s prompt (all its prefixes; `owners` as `owners(key)` just
        said), make them the most recently used, and evict the least recently used beyond the bound."""
        entries, flag = self._entries, 1 << bit
        new = [(h, (got or 0) | flag) for h, got in zip(key.hashes, owners) if not (got and got & flag)]
        if new:
            entries.update(new)
            self.sizes[bit] = self.sizes.get(bit, 0) + len(new)
        deque(map(entries.move_to_end, key.hashes), maxlen=0)  # refreshed in C, shortest prefix first
        sizes = self.sizes
        while len(entries) > self.max_entries:
            _, got = entries.popitem(last=False)
            if got & (got - 1):
                while got:
                    low = got & -got
                    sizes[low.bit_length() - 1] -= 1
                    got ^= low
            else:  # one owner, the usual case
                sizes[got.bit_length() - 1] -= 1

    def compact(self, keep: dict[int, int]) -> None:
        """Renumber the instance bits: `keep` maps each live bit to its new one; every other bit (instances
        gone from the pool) is cleared, and entries left with no instance are dropped. One pass over the
        index: run it rarely (once many instances have gone), not per removal."""
        entries: OrderedDict[int, int] = OrderedDict()
        sizes: dict[int, int] = {}
        for h, got in self._entries.items():
            new = 0
            while got:
                low = got & -got
                bit = keep.get(low.bit_length() - 1)
                if bit is not None:
                    new |= 1 << bit
                    sizes[bit] = sizes.get(bit, 0) + 1
                got ^= low
            if new:
                entries[h] = new
        self._entries, self.sizes = entries, sizes
