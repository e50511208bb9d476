"""The one interface every routing policy implements, and what a decision says about itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdproxy.policies.request import RequestView


class Instance(Protocol):
    """What a policy reads of an instance (pdproxy.pool.Instance; policies never change it)."""

    url: str
    address: str
    inflight: int  # requests this proxy process has in flight on it

REASON_RETRY = "retry"  # a retry after a failed attempt: no request view, chosen by load


@dataclass(slots=True)
class Decision:
    """Why an instance was chosen: recorded on the leg span and counted in /metrics."""

    policy: str
    reason: str  # one of the policy's fixed reasons (a bounded metric label)
    scores: dict[str, float] = field(default_factory=dict)  # instance address -> the score that decided
    matched: int | None = None  # prefix units (tokens or chars) the chosen instance already had
    unit: str | None = None  # "tokens" or "chars" for `matched`


class Policy(Protocol):
    """Chooses one of `instances` (all in rotation, never empty) for a request.

    `choose` runs on the event loop for every request: it must not block, wait or raise."""

    name: str
    reasons: tuple[str, ...]

    def choose(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]: ...

    def status(self, instances: Sequence[Instance]) -> dict[str, dict[str, Any]]:
        """Each instance's current scores, for /status."""
        ...


class Rotation:
    """A counter that breaks ties round-robin, so equal instances share the load."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def least(self, instances: Sequence[Instance], key: Callable[[Instance], float]) -> Instance:
        start = self.next % len(instances)
        self.next += 1
        best, best_key = None, 0.0
        n = len(instances)
        for k in range(n):
            inst = instances[(start + k) % n]
            value = key(inst)
            if best is None or value < best_key:
                best, best_key = inst, value
        return best  # type: ignore[return-value]


def inflight_scores(instances: Sequence[Instance]) -> dict[str, float]:
    return {i.address: float(i.inflight) for i in instances}
