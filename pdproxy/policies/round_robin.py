"""Each instance in rotation in turn (vLLM's toy proxy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdproxy.policies.base import Decision, Rotation
from pdproxy.policies.request import RequestView


class RoundRobin:
    name = "round_robin"
    reasons = ("rotation",)

    def __init__(self) -> None:
        self.rotation = Rotation()

    def choose(self, instances: Sequence, request: RequestView | None):
        r = self.rotation
        chosen = instances[r.next % len(instances)]
        r.next += 1
        return chosen, Decision(self.name, "rotation")

    def status(self, instances: Sequence) -> dict[str, dict[str, Any]]:
        return {i.address: {"inflight": i.inflight} for i in instances}
