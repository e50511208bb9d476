"""The same session to the same instance: a hash ring over the instances in rotation, keyed by a
request header or body field (multi-turn stickiness, so a conversation's KV cache is reused).

The ring hashes are stable (BLAKE2b of the key and of the instance URL), so every worker process and
every pdproxy replica maps a session to the same instance, and an instance leaving rotation moves
only its own sessions. A request with none of the key sources goes to the least loaded instance.

The key is the client's to choose, so the load it can pin is bounded: consistent hashing with bounded
loads (Mirrokni, Thorup, Zadimoghaddam, 2018; HAProxy's `hash-balance-factor`). An instance whose
in-flight count would exceed `hash_load_factor` × the mean (this request included, rounded up) is
passed over for the next instance along the ring (reason `load_bound`). With the factor c, no instance
holds more than about c times its share, and a key moves only while its instance is that far over.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from typing import Any, ClassVar

from pdproxy.config import DEFAULT_HASH_KEY, parse_hash_key
from pdproxy.policies.base import Decision, Instance, Rotation, loads
from pdproxy.policies.request import RequestView

VNODES = 64  # points per instance on the ring: smooths the share of keys each instance gets


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class ConsistentHash:
    name: ClassVar[str] = "consistent_hash"
    reasons: ClassVar[tuple[str, ...]] = ("hash_key", "load_bound", "no_key")

    def __init__(self, hash_key: str = DEFAULT_HASH_KEY, hash_load_factor: float = 1.25) -> None:
        self.sources = parse_hash_key(hash_key)
        self.load_factor = hash_load_factor  # 0: no bound
        self.rotation = Rotation()
        self._ring_for: tuple[int, ...] = ()
        self._points: list[int] = []
        self._owners: list[Any] = []

    def key(self, request: RequestView | None) -> str | None:
        if request is None:
            return None
        for where, name in self.sources:
            value = request.header(name) if where == "header" else request.field(name)
            if value is not None:
                return value
        return None

    def choose(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]:
        key = self.key(request)
        if key is None:
            values = loads(instances)
            return self.rotation.least(instances, values), Decision(self.name, "no_key", compared=instances,
                                                                    values=values)
        self._ring(instances)
        at = bisect.bisect(self._points, _h(key)) % len(self._points)
        owner = self._owners[at]
        if not self.load_factor or len(instances) == 1:
            return owner, Decision(self.name, "hash_key")
        values = loads(instances)
        bound = math.ceil(self.load_factor * (sum(values) + 1) / len(instances))
        if owner.inflight < bound:
            return owner, Decision(self.name, "hash_key", compared=instances, values=values)
        # along the ring to the first instance under the bound: one exists, as the bound is at least the mean
        owners = self._owners
        for step in range(1, len(owners)):
            candidate = owners[(at + step) % len(owners)]
            if candidate.inflight < bound:
                return candidate, Decision(self.name, "load_bound", compared=instances, values=values)
        return owner, Decision(self.name, "hash_key", compared=instances, values=values)  # not reached

    def _ring(self, instances: Sequence[Instance]) -> None:
        ids = tuple(id(i) for i in instances)
        if ids == self._ring_for:
            return
        ring = sorted((_h(f"{inst.url}#{v}"), n) for n, inst in enumerate(instances) for v in range(VNODES))
        self._points = [p for p, _ in ring]
        self._owners = [instances[n] for _, n in ring]
        self._ring_for = ids

    def status(self, instances: Sequence[Instance]) -> dict[str, dict[str, Any]]:
        return {i.address: {"inflight": i.inflight} for i in instances}
