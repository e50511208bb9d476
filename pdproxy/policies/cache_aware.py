"""Send a prompt where its prefix most likely sits in the KV cache, unless that would overload one instance.

The approach and the parameter names of SGLang's and vllm-router's cache-aware policies:

* the load is imbalanced when `max - min > balance_abs_threshold` and `max > balance_rel_threshold × min`
  (in-flight requests of this proxy); then the least loaded instance gets the request;
* otherwise the instance with the longest matching prefix gets it, if that match is more than
  `cache_threshold` of the prompt; below that, the instance holding the least of the index (the most
  room in its cache, as far as this proxy knows), least loaded among equals;
* either way the chosen instance is remembered for the prompt's prefixes, in an index bounded by
  `max_tree_size` entries (pdproxy/policies/prefix_index.py; vllm-router counts tree nodes there).

A body without a usable prompt goes to the least loaded instance. Each pdproxy worker process keeps its
own index (they share nothing), so with --workers N a prefix can be learnt up to N times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pdproxy.policies.base import Decision, Instance, Rotation, loads
from pdproxy.policies.prefix_index import PrefixIndex
from pdproxy.policies.request import PrefixKey, RequestView

LOAD_SCALE = 1 << 32  # above any in-flight count
RETIRED_BITS = 64  # bits of departed instances tolerated before the index is renumbered

class CacheAware:
    name: ClassVar[str] = "cache_aware"
    reasons: ClassVar[tuple[str, ...]] = ("prefix_match", "cache_miss", "imbalanced", "no_prompt")

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 18) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = PrefixIndex(max_tree_size)
        self.rotation = Rotation()
        self._bits: dict[Any, int] = {}  # instance -> its bit in the index
        self._next_bit = 0
        self._retired = 0  # bits of instances gone from the pool, still set in some entries
        self._masks: dict[tuple[int, ...], int] = {}

    def _bit(self, instance: Instance) -> int:
        bit = self._bits.get(instance)
        if bit is None:
            bit = self._bits[instance] = self._next_bit
            self._next_bit += 1
        return bit

    def forget(self, instance: Instance) -> None:
        """`instance` left the pool: its bit is never matched again (no mask names it), and once as many bits
        are retired as are live (at least RETIRED_BITS), the index is renumbered, so churn does not widen it."""
        bit = self._bits.pop(instance, None)
        if bit is None:
            return
        self.index.sizes.pop(bit, None)
        self._masks.clear()
        self._retired += 1
        if self._retired >= max(RETIRED_BITS, len(self._bits)):
            keep = {old: new for new, old in enumerate(sorted(self._bits.values()))}
            self.index.compact(keep)
            self._bits = {i: keep[b] for i, b in self._bits.items()}
            self._next_bit, self._retired = len(keep), 0

    def _bits_of(self, instances: Sequence[Instance]) -> tuple[list[int], int]:
        """The instances' bits in the index and their mask (the mask cached per set of instances)."""
        try:
            bits = list(map(self._bits.__getitem__, instances))
        except KeyError:
            bits = [self._bit(i) for i in instances]
        key = tuple(bits)
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = sum(1 << b for b in bits)
            if len(self._masks) > 1024:  # sets of instances in rotation: few, but bounded all the same
                self._masks.clear()
        return bits, mask

    def choose(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]:
        key = request.prefix if request is not None else None
        load = loads(instances)
        low, high = min(load), max(load)
        owners = None
        if key is None or (high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low):
            chosen = self.rotation.least(instances, load)
            decision = Decision(self.name, "no_prompt" if key is None else "imbalanced", compared=instances,
                                values=load)
        else:
            bits, mask = self._bits_of(instances)
            owners = self.index.owners(key)
            matched = self.index.match(key, owners, mask)
            best = max(matched.values(), default=0)
            if best > self.cache_threshold * key.length:  # the longest match, the least loaded of those
                holders = [instances[bits.index(b)] for b, n in matched.items() if n == best]
                chosen = holders[0] if len(holders) == 1 else self.rotation.least(holders, loads(holders))
                reason = "prefix_match"
            else:  # the least indexed (the most room in its cache, as far as this proxy knows), then load
                sizes = self.index.sizes
                chosen = self.rotation.least(instances, [sizes.get(b, 0) * LOAD_SCALE + x for b, x in zip(bits, load)])
                reason, best = "cache_miss", 0
            decision = Decision(self.name, reason, best, key.unit, instances,
                                lambda: [matched.get(b, 0) for b in bits])  # matched lengths, built for a span
        if key is not None:  # even when balancing: that instance now has the prompt
            self.index.insert(key, owners if owners is not None else self.index.owners(key), self._bit(chosen))
        return chosen, decision

    def learn(self, instance: Instance, key: PrefixKey | None) -> None:
        """`instance` got a prompt of this key, chosen by another rule (precise_prefix): it holds it now."""
        if key is not None:
            self.index.insert(key, self.index.owners(key), self._bit(instance))

    def status(self, instances: Sequence[Instance]) -> dict[str, dict[str, Any]]:
        sizes = self.index.sizes
        return {i.address: {"inflight": i.inflight, "indexed_prefixes": sizes.get(self._bits.get(i, -1), 0)}
                for i in instances}
