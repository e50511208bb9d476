"""Waiting in tests: for a state, never for luck; and one factor for every wall-clock bound left.

A test waits until something holds (instances up, a port answers, a file holds N records) and fails
with what it was waiting for. The bound on that wait only keeps a broken run from hanging, so on a
slow or loaded machine it may be stretched: every bound is multiplied by PDPROXY_TEST_TIMEOUT_SCALE
(default 1), e.g. `PDPROXY_TEST_TIMEOUT_SCALE=3 python3 -m pytest -q`.

Load loops run phase by phase (`Load`): each phase lasts its own time, may cap its own count (a cap
that cannot eat into another phase), and must get a minimum number of requests, or the test says
which phase starved.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _scale() -> float:
    raw = os.environ.get("PDPROXY_TEST_TIMEOUT_SCALE", "").strip()
    try:
        value = float(raw) if raw else 1.0
    except ValueError:
        raise RuntimeError(f"PDPROXY_TEST_TIMEOUT_SCALE must be a number, not {raw!r}") from None
    if value <= 0:
        raise RuntimeError(f"PDPROXY_TEST_TIMEOUT_SCALE must be above 0, not {raw!r}")
    return value


SCALE = _scale()


def scaled(seconds: float) -> float:
    """A wall-clock bound, stretched by PDPROXY_TEST_TIMEOUT_SCALE."""
    return seconds * SCALE


def wait_until(predicate: Callable[[], T], what: str, timeout: float = 10.0, interval: float = 0.05) -> T:
    """Poll `predicate` until it returns something truthy, and return that; fail naming `what` after
    `timeout` seconds (scaled). An exception from `predicate` counts as "not yet" and is shown on failure,
    except an AssertionError: the predicate saw that the state can no longer come (a process exited)."""
    deadline = time.monotonic() + scaled(timeout)
    last: object = None
    while True:
        try:
            value = predicate()
        except AssertionError:
            raise
        except Exception as e:  # e.g. connection refused while a process starts
            value, last = None, e  # type: ignore[assignment]
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {scaled(timeout):.1f} s waiting for {what} (last: {last!r})")
        time.sleep(interval)


class Load:
    """Requests from a background thread, counted per phase; the test moves it from phase to phase.

    `send(phase)` makes one request and returns what to keep of it (whether it succeeded, its latency,
    ...); an exception is kept as the result and listed in `errors`. A phase's count cap (`cap`) only idles the sender until the next phase, so a
    fast machine cannot use up a later phase's requests; `end_phase` waits (scaled) for the phase's
    minimum and fails naming the phase that starved.
    """

    def __init__(self, send: Callable[[str], object], phases: list[str], cap: int | None = None) -> None:
        self.send = send
        self.phases = phases
        self.cap = cap
        self.phase = phases[0]
        self.results: dict[str, list[object]] = {p: [] for p in phases}
        self.errors: list[Exception] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="load")

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            phase = self.phase
            if self.cap is not None and len(self.results[phase]) >= self.cap:
                time.sleep(0.01)  # this phase has enough: wait for the next one
                continue
            try:
                result = self.send(phase)
            except Exception as e:  # kept and shown by the test, never swallowed
                self.errors.append(e)
                result = e
            self.results[phase].append(result)

    def run_phase(self, phase: str, seconds: float, minimum: int) -> list[object]:
        """Enter `phase`, load it for `seconds` (not scaled: it is the phase's length, not a bound), then
        for as long as it takes (scaled bound) to get `minimum` requests; its results."""
        self.enter(phase)
        time.sleep(seconds)
        return self.end_phase(phase, minimum, seconds)

    def enter(self, phase: str) -> None:
        assert phase in self.results, phase
        self.phase = phase

    def end_phase(self, phase: str, minimum: int, seconds: float = 0.0) -> list[object]:
        """Wait (scaled) until `phase` has `minimum` requests, or fail naming it."""
        got = self.results[phase]
        deadline = time.monotonic() + scaled(max(30.0, seconds))
        while len(got) < minimum and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        assert len(got) >= minimum, (f"phase {phase!r} starved: {len(got)} requests, at least {minimum} needed"
                                     f" (errors: {self.errors[:3]!r})")
        return got

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(scaled(30))
        assert not self._thread.is_alive(), "the load thread did not stop (a request hangs)"

    @property
    def made(self) -> int:
        return sum(len(v) for v in self.results.values())
