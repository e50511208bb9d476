"""vLLM's KV-cache events: what every instance holds, and when a request's KV arrives on a decode, from the engine.

Each vLLM instance started with `--kv-events-config` publishes batches of `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` on a ZMQ PUB socket (and keeps them for replay on a ROUTER socket). Every pdproxy process
that subscribes to every instance builds the same per-instance prefix index without sharing anything, so
replicas and workers agree on where a prompt's KV sits (llm-d's precise prefix-cache scorer and Dynamo's KV
router work the same way).

Public face: `start` (from the server's lifecycle: subscribe to every configured instance, count it in
/metrics, hand it to the policies that route by it and to live stall attribution; `KVEvents.stop` at
shutdown), `KVEvents.get(address)` (an instance's subscription: its `index`, `flowing` and
`not_flowing_reason`), `decode_batch` (one message's payload), `BlockIndex` (one instance's cached blocks,
keyed by pdproxy's hash of their tokens, `pdproxy.blocks.chain_hashes`, re-exported here). Inside: decode,
index, subscriber (+ sources, metrics), publisher (the simulator's), arrivals (live stall attribution). What
routes by the index (precise_prefix, selective disaggregation) is pdproxy/policies and pdproxy/routing: this
package imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdproxy.blocks import chain_hashes
from pdproxy.kvevents.decode import (AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, Event, EventBatch,
                                     decode_batch, parse_seq)
from pdproxy.kvevents.index import BlockIndex

if TYPE_CHECKING:
    from pdproxy.kvevents.subscriber import KVEvents

__all__ = ["AllBlocksCleared", "BlockIndex", "BlockRemoved", "BlockStored", "DecodeError", "Event", "EventBatch",
           "KVEvents", "chain_hashes", "decode_batch", "parse_seq", "start"]


def __getattr__(name: str):
    if name == "KVEvents":  # zmq is imported only where events are on
        from pdproxy.kvevents.subscriber import KVEvents

        return KVEvents
    raise AttributeError(name)


def start(settings, registry, pools=(), stalls=None, decodes=()) -> KVEvents | None:
    """Subscribe to every instance that has an endpoint (None when events are off), count it in `registry`,
    hand it to the pools' policies that route by it, and file the `decodes`' KV arrivals into `stalls`
    (telemetry.StallRecords, None: live attribution off). Call on the running loop."""
    from pdproxy.kvevents.metrics import KVEventsCollector
    from pdproxy.kvevents.sources import sources_of
    from pdproxy.kvevents.subscriber import KVEvents

    sources = sources_of(settings)
    if not sources:
        return None
    events = KVEvents(sources, settings.kv_events_max_blocks)
    registry.register(KVEventsCollector(events))
    for pool in pools:
        if hasattr(pool.policy, "use_events"):
            pool.policy.use_events(events)
    if stalls is not None:
        from pdproxy.kvevents.arrivals import arrival_listener

        events.add_listener(arrival_listener(stalls, decodes, "kv_arrival" if settings.mode == "pd" else "prefill"))
    events.start()
    return events
