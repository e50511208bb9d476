"""A decode's KV arrivals, from its BlockStored events, for live stall attribution in every pdproxy process.

A decode publishes BlockStored when a request's KV arrives from the prefill (the blocks are committed to its
cache: on the recorded real stream the first token pdproxy saw came 8-14 ms, p90-p10, after the batch's `ts`) and
also while it generates, one block each time a request's output fills one. The rule telling them apart: a
store of two or more blocks, or one starting a chain (no parent), is an arrival; a single block chained to a
cached one is generation. On the recorded vLLM 0.23 stream (tests/fixtures/kv_events_vllm023, 91 decode
stores) it finds 44 of the 45 arrivals and takes no generation store for one (the miss: a prompt whose part
beyond what the decode had cached was one block). Measured by tests/test_kvevents_arrivals.py.

An arrival is filed as a `kv_arrival` activity on the decode at the batch's time; the engine's wall clock is
turned into this process's monotonic clock at receipt, which holds when the proxy and the engine share a host
or synchronised clocks (the lag is in pdproxy_kv_event_lag_seconds). An arrival while this process's own record
has a KV arrival going on at that decode is left to that one (it names the request and links its trace); two
arriving at once, one of them another process's, are then named once: the cause is the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from pdproxy.kvevents.decode import BlockStored, EventBatch

REQUEST_ID = "kv-event"  # the culprit's name in an attribution: the events do not say which request it was
OWN_LOOKUP = 8  # activities of this process's own record looked at per arrival


def kv_arrivals(batch: EventBatch) -> list[BlockStored]:
    return [e for e in batch.events if isinstance(e, BlockStored)
            and (e.parent_block_hash is None or len(e.block_hashes) >= 2)]


def arrival_listener(stalls: Any, decodes: Iterable[str] | Callable[[str], bool], kind: str = "kv_arrival"):
    """A subscriber listener filing every live KV arrival on a decode into `stalls` (telemetry.StallRecords);
    `decodes`: the decodes' addresses, or a test of an address (decodes come and go); `kind` "prefill" for
    instances serving whole requests (single mode: their prompt stores are prefills)."""
    is_decode = decodes if callable(decodes) else frozenset(decodes).__contains__

    def listener(address: str, batch: EventBatch, live: bool) -> None:
        if not live or not is_decode(address):
            return
        arrivals = kv_arrivals(batch)
        if not arrivals:
            return
        at = time.monotonic_ns() - max(0, time.time_ns() - int(batch.ts * 1e9))
        record = stalls.instances.get(address)
        if record is not None and any(a.kind == kind and a.request_id != REQUEST_ID
                                      for a in record.around(at, at, OWN_LOOKUP)):
            return  # this process routed a request arriving now: its own activity names it (and links its trace)
        stalls.observed(kind, address, REQUEST_ID, at, sum(len(e.token_ids) for e in arrivals))

    return listener
