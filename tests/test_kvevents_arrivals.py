"""The KV-arrival rule, measured on the recorded real vLLM 0.23 stream (truth: the decode's stored blocks are
blocks the prefill computed; a decode's own generation blocks the prefill never saw)."""

from __future__ import annotations

from pdproxy.kvevents import BlockIndex, BlockStored, EventBatch
from pdproxy.kvevents.arrivals import kv_arrivals
from test_kvevents_decode import messages


def test_the_rule_finds_the_recorded_arrivals_and_no_generation_store():
    indexes: dict[str, BlockIndex] = {}
    prefill_keys: set[int] = set()
    found = {"arrival": 0, "missed": 0, "generation": 0, "false": 0}
    for src, _, _, payload in messages():
        from pdproxy.kvevents import decode_batch

        batch = decode_batch(payload)
        index = indexes.setdefault(src, BlockIndex())
        for event in batch.events:
            index.apply(event)
            if not isinstance(event, BlockStored):
                continue
            keys = [index._engine[h] for h in event.block_hashes]
            if src == "p0":
                prefill_keys.update(keys)
                continue
            truth = all(k in prefill_keys for k in keys)
            rule = bool(kv_arrivals(EventBatch(batch.ts, [event])))
            found[("arrival" if rule else "missed") if truth else ("false" if rule else "generation")] += 1
    assert found == {"arrival": 44, "missed": 1, "generation": 46, "false": 0}
