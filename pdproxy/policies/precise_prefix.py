"""Send a prompt to the instance that holds the longest prefix of it in its KV cache, as the engine itself says.

The engines' KV-cache events (pdproxy/kvevents) give each instance's cached blocks; every pdproxy process that
subscribes builds the same index, so replicas and workers agree without sharing anything (llm-d's precise
prefix-cache scorer and Dynamo's KV router work this way). A prompt's token ids (a token-id prompt as it is; a
text prompt through `--tokenizer-file`, the served model's tokenizer.json; else text and chat through an
instance's `/tokenize`, all found by pdproxy/routing before the policy chooses) are cut into blocks of the
engines' block size and hashed as the index is (`pdproxy.blocks.chain_hashes`); then:

* load is imbalanced (as cache_aware: `max - min > balance_abs_threshold` and `max > balance_rel_threshold ×
  min`, load being in-flight requests plus the engine's own queue where /metrics is read, as load_aware): the
  least loaded instance (`imbalanced`);
* otherwise the instance holding the most leading blocks, least loaded among equals (`prefix_match`), or, when
  none holds any, the least loaded (`cache_miss`).

When a candidate's events are not flowing (not configured, not connected, resynchronising), no engine has stored
a block yet, or the prompt has no token ids here (chat with a local tokenizer.json, which has no chat template;
/tokenize failed or is backed off), the request is routed by cache_aware's approximate index instead
(`approximate`), which also learns every precise choice so that it is ready when needed. Each such decision
says why (`Decision.fallback`: `pd.route.fallback_reason` on the span, `pdproxy_route_fallbacks_total` counted
at the instances whose state caused it, or at the chosen one when the request did).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import aiohttp

from pdproxy.policies.base import Decision, Instance, Rotation
from pdproxy.policies.cache_aware import CacheAware
from pdproxy.policies.load_aware import LoadAware
from pdproxy.policies.request import RequestView


class PrecisePrefix:
    name: ClassVar[str] = "precise_prefix"
    reasons: ClassVar[tuple[str, ...]] = ("prefix_match", "cache_miss", "imbalanced", "approximate")

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 18,
                 load_metrics_interval: float = 2.0) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.approximate = CacheAware(cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_size)
        self.engine_load = LoadAware(load_metrics_interval)
        self.events: Any = None  # pdproxy.kvevents.KVEvents, given by kvevents.start
        self.rotation = Rotation()
        self.fallbacks: dict[str, int] = {}  # address -> decisions that fell back, counted where the reason lies

    def use_events(self, events: Any) -> None:
        self.events = events

    def start(self, instances: Callable[[], Sequence[Instance]], session: aiohttp.ClientSession,
              headers: dict[str, str]) -> None:
        self.engine_load.start(instances, session, headers)

    def forget(self, instance: Instance) -> None:
        self.approximate.forget(instance)
        self.engine_load.forget(instance)
        self.fallbacks.pop(instance.address, None)

    async def stop(self) -> None:
        await self.engine_load.stop()

    def _loads(self, instances: Sequence[Instance]) -> list[float]:
        readings = self.engine_load.readings
        out: list[float] = []
        for i in instances:
            reading = readings.get(i.url)
            out.append(i.inflight + (reading.score if reading is not None else 0.0))
        return out

    def choose(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]:
        if request is None:  # a retry, chosen by load: nothing to match, no fallback
            chosen, inner = self.approximate.choose(instances, None)
            return chosen, Decision(self.name, "approximate", inner.matched, inner.unit, inner.compared, inner.values)
        reason, blamed, subs = self._events(instances)
        tokens = None
        block_size = 0
        if reason is None:
            tokens = request.token_ids
            # the engines' block size, from their events (none stored anything yet: nothing to match either)
            sizes = {s.index.block_size for s in subs if s.index.block_size}
            if tokens is None:
                reason = request.no_ids  # the request's: counted at the instance chosen
            elif len(sizes) != 1:
                reason, blamed = "block_size_mismatch" if sizes else "no_block_stored", instances
            else:
                block_size = sizes.pop()
        if reason is not None or tokens is None:
            return self._approximate(instances, request, reason or "no_token_ids", blamed)
        load = self._loads(instances)
        low, high = min(load), max(load)
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            chosen = self.rotation.least(instances, load)
            decision = Decision(self.name, "imbalanced", compared=instances, values=load)
        else:
            keys = request.block_keys(block_size)
            matched = [s.index.matched_blocks(keys) for s in subs]
            best = max(matched)
            if best:
                holders = [k for k, m in enumerate(matched) if m == best]
                chosen = self.rotation.least([instances[k] for k in holders], [load[k] for k in holders])
                reason = "prefix_match"
            else:
                chosen, reason = self.rotation.least(instances, load), "cache_miss"
            decision = Decision(self.name, reason, best * block_size, "tokens", instances,
                                [m * block_size for m in matched])
        self.approximate.learn(chosen, request.prefix)  # the approximate index learns it too
        return chosen, decision

    def _events(self, instances: Sequence[Instance]) -> tuple[str | None, Sequence[Instance], list[Any]]:
        """Every candidate's event subscription when all are flowing; else why not, and whose state it is."""
        events = self.events
        if events is None:
            return "events_off", instances, []
        subs: list[Any] = []
        off: list[Instance] = []
        stalled: list[Instance] = []
        for i in instances:  # one pass: a pool may hold 100 instances
            sub = events.get(i.address)
            if sub is None:
                off.append(i)
            elif not sub.flowing:
                stalled.append(i)
            subs.append(sub)
        if off:
            return "events_off", off, []
        if stalled:
            return "events_not_flowing", stalled, []
        return None, (), subs

    def _approximate(self, instances: Sequence[Instance], request: RequestView, reason: str,
                     blamed: Sequence[Instance]) -> tuple[Instance, Decision]:
        chosen, inner = self.approximate.choose(instances, request)
        decision = Decision(self.name, "approximate", inner.matched, inner.unit, inner.compared, inner.values)
        decision.fallback = reason
        decision.fallback_at = [i.address for i in blamed] or [chosen.address]
        for address in decision.fallback_at:
            self.fallbacks[address] = self.fallbacks.get(address, 0) + 1
        return chosen, decision

    def status(self, instances: Sequence[Instance]) -> dict[str, dict[str, Any]]:
        out = {}
        for i in instances:
            sub = self.events.get(i.address) if self.events is not None else None
            out[i.address] = {"inflight": i.inflight, "events": "flowing" if sub is not None and sub.flowing
                              else "off" if sub is None else "not flowing",
                              "event_index_blocks": len(sub.index) if sub is not None else 0,
                              "approximate_fallbacks": self.fallbacks.get(i.address, 0)}
        return out
