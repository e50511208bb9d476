"""Routing policies: one module each, behind one small interface (`base.Policy`), as vllm-router's src/policies/.

A policy gets the instances in rotation and a `RequestView` and returns one instance and a `Decision`
(why: a bounded reason, the deciding scores, the matched prefix). The pool (pdproxy/pool.py) decides
which instances are in rotation; the policy only chooses among them. Each pdproxy worker process has its
own policy state (prefix index, engine readings): they share nothing.
"""

from __future__ import annotations

from typing import Any

from pdproxy.policies.base import REASON_RETRY, Decision, Policy
from pdproxy.policies.cache_aware import CacheAware
from pdproxy.policies.consistent_hash import ConsistentHash
from pdproxy.policies.least_inflight import LeastInflight
from pdproxy.policies.load_aware import LoadAware
from pdproxy.policies.power_of_two import PowerOfTwo
from pdproxy.policies.precise_prefix import PrecisePrefix
from pdproxy.policies.random_choice import Random
from pdproxy.policies.request import RequestView
from pdproxy.policies.round_robin import RoundRobin

POLICIES: dict[str, type] = {cls.name: cls for cls in (RoundRobin, Random, LeastInflight, PowerOfTwo, ConsistentHash,
                                                        CacheAware, LoadAware, PrecisePrefix)}
# the settings each policy takes (flag names with `_`); any other is not a parameter of that policy
PARAMETERS: dict[str, tuple[str, ...]] = {
    "round_robin": (), "random": (), "least_inflight": (), "power_of_two": (), "consistent_hash": ("hash_key", "hash_load_factor"),
    "cache_aware": ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "max_tree_size"),
    "load_aware": ("load_metrics_interval",),
    "precise_prefix": ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "max_tree_size",
                       "load_metrics_interval"),
}
ALL_PARAMETERS = tuple(sorted({p for names in PARAMETERS.values() for p in names}))


def params_of(settings: Any) -> dict[str, Any]:
    """Every policy parameter from pdproxy's `Settings` (they are flags of their own: --cache-threshold, ...)."""
    return {name: getattr(settings, name) for name in ALL_PARAMETERS}


def create(name: str, params: dict[str, Any] | None = None) -> Policy:
    """A new policy; `params` may hold any policy's settings, each takes its own. ValueError if unknown."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    params = params or {}
    unknown = sorted(set(params) - set(ALL_PARAMETERS))
    if unknown:
        raise ValueError(f"unknown routing parameter(s) {', '.join(unknown)}")
    return cls(**{k: v for k, v in params.items() if k in PARAMETERS[name]})


__all__ = ["POLICIES", "PARAMETERS", "REASON_RETRY", "Decision", "Policy", "RequestView", "create", "params_of"]
