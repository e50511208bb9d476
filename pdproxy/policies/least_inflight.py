"""The instance with the fewest requests this proxy has in flight on it; ties in turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pdproxy.policies.base import Decision, Instance, Rotation, loads
from pdproxy.policies.request import RequestView


class LeastInflight:
    name: ClassVar[str] = "least_inflight"
    reasons: ClassVar[tuple[str, ...]] = ("least_loaded",)

    def __init__(self) -> None:
        self.rotation = Rotation()

    def choose(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]:
        values = loads(instances)
        return self.rotation.least(instances, values), Decision(self.name, "least_loaded", compared=instances,
                                                                values=values)

    def status(self, instances: Sequence[Instance]) -> dict[str, dict[str, Any]]:
        return {i.address: {"inflight": i.inflight, "score": float(i.inflight)} for i in instances}
