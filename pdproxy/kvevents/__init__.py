"""vLLM's KV-cache events: what every instance holds, and when a request's KV arrives on a decode, from the engine.

Each vLLM instance started with `--kv-events-config` publishes batches of `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` on a ZMQ PUB socket (and keeps them for replay on a ROUTER socket). Every pdproxy process
that subscribes to every instance builds the same per-instance prefix index without sharing anything, so
replicas and workers agree on where a prompt's KV sits (llm-d's precise prefix-cache scorer and Dynamo's KV
router work the same way).

Public face: `Following` (from the server's lifecycle: the process's `KVEvents`, made on first use, counted in
/metrics, handed to the policies that route by it and to live stall attribution; pdproxy/membership adds and
removes each instance's subscription as the instance joins and leaves), `KVEvents.get(address)` (an instance's subscription: its `index`, `flowing` and
`not_flowing_reason`), `decode_batch` (one message's payload), `BlockIndex` (one instance's cached blocks,
keyed by pdproxy's hash of their tokens, `pdproxy.blocks.chain_hashes`, re-exported here). Inside: decode,
index, subscriber (+ metrics), publisher (the simulator's), arrivals (live stall attribution). What
routes by the index (precise_prefix, selective disaggregation) is pdproxy/policies and pdproxy/routing: this
package imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pdproxy.blocks import chain_hashes
from pdproxy.kvevents.decode import (AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, Event, EventBatch,
                                     decode_batch, parse_seq)
from pdproxy.kvevents.index import BlockIndex

if TYPE_CHECKING:
    from pdproxy.kvevents.subscriber import KVEvents

__all__ = ["AllBlocksCleared", "BlockIndex", "BlockRemoved", "BlockStored", "DecodeError", "Event", "EventBatch",
           "Following", "KVEvents", "chain_hashes", "decode_batch", "parse_seq"]


def __getattr__(name: str):
    if name == "KVEvents":  # zmq is imported only where events are on
        from pdproxy.kvevents.subscriber import KVEvents

        return KVEvents
    raise AttributeError(name)


class Following:
    """This process's `KVEvents`, made on first use (`following()`): when an instance with an event endpoint
    joins the pools (pdproxy/membership), or at start when events are configured. Made, it is counted in
    the registry, handed to the pools' policies that route by it, and files the decodes' KV arrivals into
    `stalls` (telemetry.StallRecords; None: live attribution off). `current`: None until then."""

    def __init__(self, settings: Any, registry: Any, pools: Iterable[Any] = (), stalls: Any = None,
                 is_decode: Callable[[str], bool] = lambda address: False) -> None:
        self.settings, self.registry, self.pools, self.stalls, self.is_decode = (settings, registry, list(pools),
                                                                                stalls, is_decode)
        self.current: KVEvents | None = None

    def __call__(self) -> KVEvents:
        if self.current is None:
            from pdproxy.kvevents.metrics import KVEventsCollector
            from pdproxy.kvevents.subscriber import KVEvents

            events = self.current = KVEvents(max_blocks=self.settings.kv_events_max_blocks)
            self.registry.register(KVEventsCollector(events))
            for pool in self.pools:
                if hasattr(pool.policy, "use_events"):
                    pool.policy.use_events(events)
            if self.stalls is not None:
                from pdproxy.kvevents.arrivals import arrival_listener

                kind = "kv_arrival" if self.settings.mode == "pd" else "prefill"
                events.add_listener(arrival_listener(self.stalls, self.is_decode, kind))
            events.start()
        return self.current

    async def stop(self) -> None:
        if self.current is not None:
            await self.current.stop()
