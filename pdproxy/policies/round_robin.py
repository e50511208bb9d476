"""Each instance in rotation in turn (vLLM's toy proxy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pdproxy.policies.base import Decision, Instance, Rotation
from pdproxy.policies.request import RequestView


class RoundRobin:
    name: ClassVar[str] = "round_robin"
    reasons: ClassVar[tuple[str, ...]] = ("rotation",)

    def __init__(self) -> None:
        self.rotation = Rotation()

    def choose(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]:
        r = self.rotation
        chosen = instances[r.next % len(instances)]
        r.next += 1
        return chosen, Decision(self.name, "rotation")

    def status(self, instances: Sequence[Instance]) -> dict[str, dict[str, Any]]:
        return {i.address: {"inflight": i.inflight} for i in instances}
