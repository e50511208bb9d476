"""The instance with the fewest requests this proxy has in flight on it; ties in turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdproxy.policies.base import Decision, Rotation, loads
from pdproxy.policies.request import RequestView


class LeastInflight:
    name = "least_inflight"
    reasons = ("least_loaded",)

    def __init__(self) -> None:
        self.rotation = Rotation()

    def choose(self, instances: Sequence, request: RequestView | None):
        values = loads(instances)
        return self.rotation.least(instances, values), Decision(self.name, "least_loaded", compared=instances,
                                                                values=values)

    def status(self, instances: Sequence) -> dict[str, dict[str, Any]]:
        return {i.address: {"inflight": i.inflight, "score": float(i.inflight)} for i in instances}
