"""Two instances drawn at random, the less loaded one: near least-loaded balance without every proxy
replica herding onto the same instance (Mitzenmacher's "power of two choices")."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from pdproxy.policies.base import Decision


class PowerOfTwo:
    name = "power_of_two"
    reasons = ("less_loaded", "only_one")

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, instances: Sequence, request):
        if len(instances) == 1:
            return instances[0], Decision(self.name, "only_one")
        a, b = self.rng.sample(instances, 2)
        chosen = b if b.inflight < a.inflight else a
        return chosen, Decision(self.name, "less_loaded", compared=(a, b), values=(a.inflight, b.inflight))

    def status(self, instances: Sequence) -> dict[str, dict[str, Any]]:
        return {i.address: {"inflight": i.inflight, "score": float(i.inflight)} for i in instances}
