"""Which instances are in the pools while the proxy runs: sources → one reconciler → pools and KV events.

Sources each give a desired set of `Member`s: the flags (never removed by anything else), the admin HTTP
API (vllm-router's routes), a watched file, DNS, Kubernetes. The reconciler unions them and brings the
live pools, health checks, KV-event subscriptions and per-instance metric series in step: an instance that
goes is drained (no new requests, those in flight finish within a grace period), then closed everywhere at
once.
"""

from pdproxy.membership.model import DECODE, PREFILL, ROLES, SOURCES, Member, MemberError, Publish, Source, member

__all__ = ["DECODE", "PREFILL", "ROLES", "SOURCES", "Member", "MemberError", "Publish", "Source", "member"]
