"""Two instances drawn at random, the less loaded one: near least-loaded balance without every proxy
replica herding onto the same instance (Mitzenmacher's "power of two choices")."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, ClassVar

from pdproxy.policies.base import Decision, Instance
from pdproxy.policies.request import RequestView


class PowerOfTwo:
    name: ClassVar[str] = "power_of_two"
    reasons: ClassVar[tuple[str, ...]] = ("less_loaded", "only_one")

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]:
        if len(instances) == 1:
            return instances[0], Decision(self.name, "only_one")
        a, b = self.rng.sample(instances, 2)
        chosen = b if b.inflight < a.inflight else a
        return chosen, Decision(self.name, "less_loaded", compared=(a, b), values=(a.inflight, b.inflight))

    def status(self, instances: Sequence[Instance]) -> dict[str, dict[str, Any]]:
        return {i.address: {"inflight": i.inflight, "score": float(i.inflight)} for i in instances}
