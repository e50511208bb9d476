"""Faults on demand: random ones from flags, one-shot ones queued through `POST /sim/faults`.

Each inference request draws a `RequestFaults` when it arrives: at most one queued fault of
each kind that matches the request (consuming one of its `times`), plus the random faults
the command line asked for. The server applies them at the point where each kind belongs.

Three kinds play an instance that dies or hangs the way a real vLLM decode does (it sends a
stream's status line at once, then waits for its KV): `die_before_first_token` (status line,
then a TCP reset once the first token exists, so a decode has pulled its KV before it dies),
`stall_before_first_token` (status line, then `seconds` of silence before the first token) and
`die_mid_stream` (a reset after `after_chunks` content chunks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

KINDS = ("error", "slow_start", "stall", "disconnect", "kv_load_failure", "malformed_chunk", "no_kv_params",
         "refuse", "die_before_first_token", "stall_before_first_token", "die_mid_stream")


class FaultSpecError(ValueError):
    pass


@dataclass
class Fault:
    kind: str
    times: int = 1
    status: int = 500
    seconds: float = 1.0
    after_chunks: int = 1
    retry_after: float | None = None
    match_path: str | None = None
    match_stream: bool | None = None

    @classmethod
    def parse(cls, spec: Any) -> Fault:
        if not isinstance(spec, dict):
            raise FaultSpecError("each fault must be an object")
        kind = spec.get("kind")
        if kind not in KINDS:
            raise FaultSpecError(f"fault kind must be one of {', '.join(KINDS)}; got {kind!r}")
        unknown = set(spec) - {"kind", "times", "status", "seconds", "after_chunks", "retry_after", "match"}
        if unknown:
            raise FaultSpecError(f"unknown fault fields: {', '.join(sorted(unknown))}")
        match = spec.get("match") or {}
        if not isinstance(match, dict) or set(match) - {"path", "stream"}:
            raise FaultSpecError("match may only contain 'path' and 'stream'")
        fault = cls(kind=kind)
        fault.times = _number(spec, "times", 1, int, minimum=1)
        fault.status = _number(spec, "status", 500, int, minimum=100)
        if fault.status > 599:
            raise FaultSpecError("status must be an HTTP status code")
        fault.seconds = _number(spec, "seconds", 1.0, float, minimum=0)
        fault.after_chunks = _number(spec, "after_chunks", 1, int, minimum=0)
        if spec.get("retry_after") is not None:
            fault.retry_after = _number(spec, "retry_after", 0.0, float, minimum=0)
        if match.get("path") is not None and not isinstance(match["path"], str):
            raise FaultSpecError("match.path must be a string")
        if match.get("stream") is not None and not isinstance(match["stream"], bool):
            raise FaultSpecError("match.stream must be a boolean")
        fault.match_path = match.get("path")
        fault.match_stream = match.get("stream")
        return fault

    def matches(self, path: str, stream: bool) -> bool:
        return (self.match_path is None or self.match_path == path) and (
            self.match_stream is None or self.match_stream == stream)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "times": self.times, "status": self.status, "seconds": self.seconds,
                "after_chunks": self.after_chunks, "retry_after": self.retry_after,
                "match": {"path": self.match_path, "stream": self.match_stream}}


def _number(spec: dict[str, Any], name: str, default: Any, kind: type, minimum: float) -> Any:
    value = spec.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise FaultSpecError(f"{name} must be a{'n integer' if kind is int else ' number'}")
    if value < minimum:
        raise FaultSpecError(f"{name} must be >= {minimum}")
    return kind(value)


@dataclass
class RequestFaults:
    """What goes wrong for one request (nothing, for almost every request)."""

    refuse: bool = False
    error: Fault | None = None
    slow_start: float = 0.0
    stall: Fault | None = None
    disconnect: Fault | None = None
    kv_load_failure: bool = False
    malformed: Fault | None = None
    no_kv_params: bool = False
    die_before_first_token: bool = False
    stall_before_first_token: float = 0.0
    die_mid_stream: Fault | None = None

    @property
    def any(self) -> bool:
        return bool(self.refuse or self.error or self.slow_start or self.stall or self.disconnect
                     or self.kv_load_failure or self.malformed or self.no_kv_params or self.early_headers
                     or self.die_mid_stream)

    @property
    def early_headers(self) -> bool:
        """The stream's status line goes out before its first token, as real vLLM's does."""
        return self.die_before_first_token or bool(self.stall_before_first_token)


NO_FAULTS = RequestFaults()


@dataclass
class FaultRates:
    """Random faults from the command line (probabilities per request)."""

    error_rate: float = 0.0
    error_status: int = 500
    slow_start_seconds: float = 0.0
    slow_start_rate: float = 1.0
    stall_seconds: float = 0.0
    stall_rate: float = 1.0
    stall_after_chunks: int = 1
    disconnect_rate: float = 0.0
    disconnect_after_chunks: int = 1
    kv_load_failure_rate: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.error_rate or (self.slow_start_seconds and self.slow_start_rate)
                    or (self.stall_seconds and self.stall_rate) or self.disconnect_rate or self.kv_load_failure_rate)


@dataclass
class FaultBook:
    rates: FaultRates = field(default_factory=FaultRates)
    seed: int | None = None
    queued: list[Fault] = field(default_factory=list)
    injected: dict[str, int] = field(default_factory=dict)  # kind -> count, for /sim/state

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def add(self, specs: Any) -> list[Fault]:
        if not isinstance(specs, list):
            raise FaultSpecError("body must be {\"faults\": [ ... ]}")
        faults = [Fault.parse(s) for s in specs]  # all or nothing
        self.queued.extend(faults)
        return faults

    def clear(self) -> None:
        self.queued.clear()

    def draw(self, path: str, stream: bool) -> RequestFaults:
        if not self.queued and not self.rates.active:
            return NO_FAULTS
        out = RequestFaults()
        taken: set[str] = set()
        for fault in self.queued:
            if fault.kind in taken or not fault.matches(path, stream):
                continue
            taken.add(fault.kind)
            fault.times -= 1
            self._apply(out, fault)
        self.queued = [f for f in self.queued if f.times > 0]
        self._draw_random(out, taken)
        for kind in taken:
            self.injected[kind] = self.injected.get(kind, 0) + 1
        return out

    def _apply(self, out: RequestFaults, fault: Fault) -> None:
        kind = fault.kind
        if kind == "refuse":
            out.refuse = True
        elif kind == "error":
            out.error = fault
        elif kind == "slow_start":
            out.slow_start = fault.seconds
        elif kind == "stall":
            out.stall = fault
        elif kind == "disconnect":
            out.disconnect = fault
        elif kind == "kv_load_failure":
            out.kv_load_failure = True
        elif kind == "malformed_chunk":
            out.malformed = fault
        elif kind == "no_kv_params":
            out.no_kv_params = True
        elif kind == "die_before_first_token":
            out.die_before_first_token = True
        elif kind == "stall_before_first_token":
            out.stall_before_first_token = fault.seconds
        elif kind == "die_mid_stream":
            out.die_mid_stream = fault

    def _draw_random(self, out: RequestFaults, taken: set[str]) -> None:
        r, rng = self.rates, self.rng
        if r.error_rate and "error" not in taken and rng.random() < r.error_rate:
            out.error = Fault("error", status=r.error_status)
            taken.add("error")
        if r.slow_start_seconds and "slow_start" not in taken and rng.random() < r.slow_start_rate:
            out.slow_start = r.slow_start_seconds
            taken.add("slow_start")
        if r.stall_seconds and "stall" not in taken and rng.random() < r.stall_rate:
            out.stall = Fault("stall", seconds=r.stall_seconds, after_chunks=r.stall_after_chunks)
            taken.add("stall")
        if r.disconnect_rate and "disconnect" not in taken and rng.random() < r.disconnect_rate:
            out.disconnect = Fault("disconnect", after_chunks=r.disconnect_after_chunks)
            taken.add("disconnect")
        if r.kv_load_failure_rate and "kv_load_failure" not in taken and rng.random() < r.kv_load_failure_rate:
            out.kv_load_failure = True
            taken.add("kv_load_failure")
