"""The subscriptions' counters in /metrics, read at scrape time (the stream never touches prometheus_client).

Labels: `server_address` (the pools' instances, and those removed until the membership's retention ends:
bounded)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pdproxy.kvevents.subscriber import LAG_BUCKETS, KVEvents

_COUNTERS = (
    ("pdproxy_kv_event_batches", "KV-event batches applied to an instance's index (live and replayed)", "batches"),
    ("pdproxy_kv_event_events", "KV-cache events applied (BlockStored, BlockRemoved, AllBlocksCleared)", "events"),
    ("pdproxy_kv_event_gaps", "Gaps in an instance's event sequence (repaired by replay when it still has them)",
     "gaps"),
    ("pdproxy_kv_event_gaps_unrepaired", "Batches lost for good (the engine's replay buffer no longer had them)",
     "gaps_unrepaired"),
    ("pdproxy_kv_event_replays", "Replay requests to an instance (catch-up, gap repair, idle probe)", "replays"),
    ("pdproxy_kv_event_replay_failures", "Replay requests that got no complete answer in time", "replay_failures"),
    ("pdproxy_kv_event_decode_errors", "Messages or batches that could not be decoded", "decode_errors"),
    ("pdproxy_kv_event_resyncs", "Index rebuilds from replay (start, reconnection, engine restart)", "resyncs"),
    ("pdproxy_kv_event_malformed_events", "Events of a known type with fields of the wrong type or shape "
     "(skipped)", "malformed_events"),
    ("pdproxy_kv_event_sequence_jumps", "Sequence numbers not believed: too far from the expected one (live: the "
     "index is rebuilt) or out of order in a replay (skipped)", "sequence_jumps"),
    ("pdproxy_kv_event_rebuild_failures", "Index rebuilds whose replay did not answer in full (retried with "
     "back-off; not flowing meanwhile)", "rebuild_failures"),
    ("pdproxy_kv_event_oversized_messages", "Connections ZMQ dropped for a message over the size bound (or "
     "another protocol error)", "oversized_messages"),
    ("pdproxy_kv_event_disconnects", "Disconnections of an instance's event stream", "disconnects"),
)


class KVEventsCollector:
    def __init__(self, events: KVEvents) -> None:
        self.events = events

    def describe(self) -> list:
        return []

    def collect(self):
        subs = self.events.subscriptions
        counted = {**self.events.retired, **subs}
        for name, doc, key in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["server_address"])
            for address, sub in counted.items():
                family.add_metric([address], sub.counts[key])
            yield family
        flowing = GaugeMetricFamily("pdproxy_kv_events_flowing", "1 while an instance's event index is in sync "
                                    "and used for routing", labels=["server_address"])
        blocks = GaugeMetricFamily("pdproxy_kv_event_index_blocks", "Blocks in an instance's event index",
                                   labels=["server_address"])
        lag = HistogramMetricFamily("pdproxy_kv_event_lag_seconds", "Live batch received minus the batch's engine "
                                    "timestamp (one host's clock only: across hosts it includes clock offset)",
                                    labels=["server_address"])
        for address, sub in subs.items():
            flowing.add_metric([address], 1.0 if sub.flowing else 0.0)
            blocks.add_metric([address], len(sub.index))
            cumulative, buckets = 0, []
            for bound, count in zip((*LAG_BUCKETS, float("inf")), sub.lag_buckets):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            lag.add_metric([address], buckets, sub.lag_sum)
        yield flowing
        yield blocks
        yield lag
