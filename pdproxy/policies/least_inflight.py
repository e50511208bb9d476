"""The instance with the fewest requests this proxy has in flight on it; ties in turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdproxy.policies.base import Decision, Rotation, inflight_scores
from pdproxy.policies.request import RequestView


class LeastInflight:
    name = "least_inflight"
    reasons = ("least_loaded",)

    def __init__(self) -> None:
        self.rotation = Rotation()

    def choose(self, instances: Sequence, request: RequestView | None):
        chosen = self.rotation.least(instances, lambda i: i.inflight)
        return chosen, Decision(self.name, "least_loaded", inflight_scores(instances))

    def status(self, instances: Sequence) -> dict[str, dict[str, Any]]:
        return {i.address: {"inflight": i.inflight, "score": float(i.inflight)} for i in instances}
