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
from typing import Any

from pdproxy.policies.base import Decision, Rotation, loads
from pdproxy.policies.prefix_index import PrefixIndex
from pdproxy.policies.request import RequestView

DEFAULTS = {"cache_threshold": 0.3, "balance_abs_threshold": 64, "balance_rel_threshold": 1.5,
            "max_tree_size": 1 << 18}


class CacheAware:
    name = "cache_aware"
    reasons = ("prefix_match", "cache_miss", "imbalanced", "no_prompt")

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 18) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = PrefixIndex(max_tree_size)
        self.rotation = Rotation()
        self._bits: dict[Any, int] = {}  # instance -> its bit in the index

    def _bit(self, instance) -> int:
        bit = self._bits.get(instance)
        if bit is None:
            bit = self._bits[instance] = len(self._bits)
        return bit

    def choose(self, instances: Sequence, request: RequestView | None):
        key = request.prefix if request is not None else None
        load = loads(instances)
        low, high = min(load), max(load)
        if key is None or (high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low):
            chosen = self.rotation.least(instances, load)
            decision = Decision(self.name, "no_prompt" if key is None else "imbalanced", compared=instances,
                                values=load)
        else:
            bits = [self._bit(i) for i in instances]
            matched = self.index.match(key, sum(1 << b for b in bits))
            lengths = [matched.get(b, 0) for b in bits]
            best = max(lengths)
            if best > self.cache_threshold * key.length:  # the longest match, least loaded among equals
                chosen = self.rotation.least(instances, [(-n, x) for n, x in zip(lengths, load)])
                reason = "prefix_match"
            else:  # the least indexed (most room, as far as this proxy knows), least loaded among equals
                sizes = self.index.sizes
                chosen = self.rotation.least(instances, [(sizes.get(b, 0), x) for b, x in zip(bits, load)])
                reason, best = "cache_miss", 0
            decision = Decision(self.name, reason, best, key.unit, instances, lengths)
        if key is not None:
            self.index.insert(key, self._bit(chosen))  # even when balancing: that instance now has the prompt
        return chosen, decision

    def status(self, instances: Sequence) -> dict[str, dict[str, Any]]:
        sizes = self.index.sizes
        return {i.address: {"inflight": i.inflight, "indexed_prefixes": sizes.get(self._bits.get(i, -1), 0)}
                for i in instances}
