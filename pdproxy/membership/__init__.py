"""Which instances are in the pools while the proxy runs: sources → one reconciler → pools and KV events.

Sources each give a desired set of `Member`s: the flags (never removed by anything else), the admin HTTP
API (vllm-router's routes), a watched file, DNS, Kubernetes. The reconciler unions them and brings the
live pools, health checks, KV-event subscriptions and per-instance metric series in step: an instance that
goes is drained (no new requests, those in flight finish within a grace period), then closed everywhere at
once.

Public face: `start` (from the server's lifecycle: the process's `Membership`, its sources not yet
running), `Membership` (`start`, `stop`, `status`, `describe(instance)`), `AdminAPI` and `admin_routes`
(the admin HTTP API), `Collector` (its /metrics), and the model every source speaks: `Member`, `member`,
`Source`. Inside: model, reconciler, cluster (what a change does to the pools and the rest), given (the
flags and the admin API's sets), files, dns, kubernetes (the discovery sources), service, admin, metrics.
"""

from __future__ import annotations

from typing import Any

from pdproxy.config import DISCOVERY_SETTINGS
from pdproxy.membership.admin import AdminAPI, admin_routes
from pdproxy.membership.cluster import Cluster
from pdproxy.membership.metrics import Collector
from pdproxy.membership.model import DECODE, PREFILL, ROLES, SOURCES, Member, MemberError, Publish, Source, member
from pdproxy.membership.service import Membership

__all__ = ["DECODE", "PREFILL", "ROLES", "SOURCES", "AdminAPI", "Collector", "Member", "MemberError", "Membership",
           "Publish", "Source", "admin_routes", "member", "start"]


def start(settings: Any, pools: list[Any], events: Any, metrics: Any, checker: Any) -> Membership:
    """The process's membership over `pools` (pdproxy.pool.Pool), following KV events through `events`
    (kvevents.Following), counting in `metrics` (telemetry.Metrics), first-checking joiners with `checker`
    (pool.HealthChecker, None: checks off). Events are made at once when configured, so the policies that
    route by them have them from the first request (with events configured, or discovery, whose instances may
name their endpoints); else when the first instance naming an endpoint joins (the admin API)."""
    cluster = Cluster({p.role: p for p in pools}, metrics=metrics, checker=checker, events=events,
                      endpoints=template(settings), topic=settings.kv_events_topic or "",
                      retention=settings.instance_series_retention)
    members = Membership(settings, cluster)
    configured = settings.kv_events_endpoint or settings.kv_events_ports or settings.kv_events_instances
    if configured or any(getattr(settings, name, None) for name in DISCOVERY_SETTINGS):
        events()  # discovered instances may name their endpoints (annotations, SRV records, file entries)
    return members


def template(settings: Any):
    """A member's KV-event endpoints: its own, else the --kv-events-endpoint template on its host and port."""
    def endpoints(m: Member) -> tuple[str | None, str | None]:
        if m.kv_events_endpoint or not settings.kv_events_endpoint or "{index}" in settings.kv_events_endpoint:
            return m.kv_events_endpoint, m.kv_events_replay_endpoint  # {index}: a place among the flags' only
        host, _, port = m.address.rpartition(":")
        host = f"[{host}]" if ":" in host else host
        fill = {"host": host, "port": port, "index": 0}
        replay = settings.kv_events_replay_endpoint
        return settings.kv_events_endpoint.format(**fill), replay.format(**fill) if replay else None
    return endpoints
