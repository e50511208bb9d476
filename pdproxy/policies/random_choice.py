"""A uniformly random instance in rotation (vllm-router's and SGLang's `random`): no state shared between
requests, so any number of proxy replicas and workers spread load alike without talking."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, ClassVar

from pdproxy.policies.base import Decision, Instance
from pdproxy.policies.request import RequestView


class Random:
    name: ClassVar[str] = "random"
    reasons: ClassVar[tuple[str, ...]] = ("random",)

    def __init__(self) -> None:
        self.draw = random.Random()

    def choose(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]:
        return instances[self.draw.randrange(len(instances))], Decision(self.name, "random")

    def status(self, instances: Sequence[Instance]) -> dict[str, dict[str, Any]]:
        return {i.address: {"inflight": i.inflight} for i in instances}
