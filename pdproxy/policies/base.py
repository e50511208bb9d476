"""The one interface every routing policy implements, and what a decision says about itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

from pdproxy.policies.request import RequestView


class Instance(Protocol):
    """What a policy reads of an instance (pdproxy.pool.Instance; policies never change it)."""

    url: str
    inflight: int  # requests this proxy process has in flight on it

    @property
    def address(self) -> str: ...

REASON_RETRY = "retry"  # a retry after a failed attempt: no request view, chosen by load


class Decision:
    """Why an instance was chosen: recorded on the leg span and counted in /metrics.

    The deciding scores are kept as the instances compared and their values at decision time; the
    address -> score map is only built when a span records it (`scores()`), not for every request.
    A plain class, not a dataclass: compiled, a dataclass's `__init__` runs interpreted, and every
    request makes one or two."""

    __slots__ = ("policy", "reason", "matched", "unit", "compared", "values", "fallback", "fallback_at")

    def __init__(self, policy: str, reason: str, matched: int | None = None, unit: str | None = None,
                 compared: Sequence[Instance] = (),
                 values: Sequence[float] | Callable[[], Sequence[float]] = ()) -> None:
        self.policy = policy
        self.reason = reason  # one of the policy's fixed reasons (a bounded metric label)
        self.matched = matched  # prefix units (tokens or chars) the chosen instance already had
        self.unit = unit  # "tokens" or "chars" for `matched`
        self.compared = compared
        self.values = values  # or how to compute them, if that costs
        self.fallback: str | None = None  # why an event-based decision fell back to the approximate index
        self.fallback_at: Sequence[str] = ()  # the addresses it is counted at (whose state, or the chosen one)

    def scores(self) -> dict[str, float]:
        values = self.values() if callable(self.values) else self.values
        return {i.address: float(v) for i, v in zip(self.compared, values)}


class Policy(Protocol):
    """Chooses one of `instances` (all in rotation, never empty) for a request.

    `choose` runs on the event loop for every request: it must not block, wait or raise."""

    # class attributes: `policies.POLICIES` reads `name` of the class (ClassVar: mypyc keeps them there)
    name: ClassVar[str]
    reasons: ClassVar[tuple[str, ...]]

    def choose(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]: ...

    def status(self, instances: Sequence[Instance]) -> dict[str, dict[str, Any]]:
        """Each instance's current scores, for /status."""
        ...


class Rotation:
    """A counter that breaks ties in turn, so equal instances share the load."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def least(self, instances: Sequence[Instance], values: Sequence[Any]) -> Instance:
        """The instance with the lowest value; among equal ones, each in turn."""
        low = min(values)
        ties = [k for k, v in enumerate(values) if v == low]
        turn = self.next
        self.next = turn + 1
        return instances[ties[turn % len(ties)]]


def loads(instances: Sequence[Instance]) -> list[int]:
    return [i.inflight for i in instances]
