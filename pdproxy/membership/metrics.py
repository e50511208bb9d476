"""Membership in /metrics, read at scrape time: changes by source and kind, instances by role and state,
and each source's state (1 while it hears from what it watches)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdproxy.membership.service import Membership


class Collector:
    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    def describe(self) -> list:
        return []

    def collect(self):
        m = self.membership
        changes = CounterMetricFamily("pdproxy_membership_changes", "Membership changes by the source that caused "
                                      "them and kind (added, draining, removed, restored, replaced, updated, "
                                      "ready, not_ready)", labels=["source", "kind"])
        for (source, kind), count in sorted(m.changes.items()):
            changes.add_metric([source, kind], count)
        yield changes
        instances = GaugeMetricFamily("pdproxy_membership_instances", "Instances in the pools by role and "
                                      "membership state (active, draining)", labels=["role", "state"])
        for role, states in m.reconciler.counts().items():
            for state, count in states.items():
                instances.add_metric([role, state], count)
        yield instances
        up = GaugeMetricFamily("pdproxy_membership_source_up", "1 while a membership source hears from what it "
                               "watches (0: it serves its last known set)", labels=["source"])
        for source in m.sources:
            up.add_metric([source.name], 1.0 if source.status().get("state") == "ok" else 0.0)
        yield up
