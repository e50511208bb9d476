"""Instances that died during the recorded run, as the proxy's traces show them.

A killed instance breaks the connections of the requests it had: pdproxy records each failed attempt as an
event on the leg's span (`pd.decode.attempt_failed`, `pd.prefill.attempt_failed`) with the instance's address and
why it failed, and retries elsewhere. An instance died when a connection to it failed (reset, refused: not an
answer it gave) and no request succeeded on it from then on; it died at the first such failure. Run B
(tests/fixtures/xpyd) is one: vllm-decode-1 (127.0.0.1:8201) killed 17.1 s after the first request, ten requests
moved off it before their first token, none sent to it after.

Which model instance it is: instances are numbered in each pool in the order the recording first used them (a
round-robin proxy uses its instances in the order it was given them; for the other policies the order is as good
as any, the instances being alike). The death's time is on the workload's clock: the bench record's request
offsets are matched with the traces' root spans by request id.
"""

from __future__ import annotations

import statistics
from typing import Any

from pdproxy.bench import traces
from pdproxy.bench.engine_spans import SpanEvent
from pdproxy.telemetry import names
from pdproxy.whatif.model import Death
from pdproxy.whatif.workload import Workload

# failed attempts that say the instance's process went away, not that it answered with an error
CONNECTION_LOST = frozenset({"stream_broken", "upstream_disconnect", "connect_error", "connect_timeout",
                             "stream_truncated"})
_EVENTS = {names.ATTEMPT_EVENT: names.MIGRATION_REASON, names.PREFILL_ATTEMPT_EVENT: "error.type"}


def _address(attrs: dict[str, Any]) -> str | None:
    host, port = attrs.get("server.address"), attrs.get("server.port")
    return f"{host}:{port}" if host is not None and port is not None else None


def _failures(info: traces.TraceInfo) -> list[tuple[str, str, SpanEvent]]:
    """(role, address, event) of each of the request's attempts that lost its connection."""
    out = []
    for events in info.stage_events.values():
        for e in events:
            reason_key = _EVENTS.get(e.name)
            address = _address(e.attrs)
            if reason_key is None or address is None or e.attrs.get(reason_key) not in CONNECTION_LOST:
                continue
            out.append((str(e.attrs.get("vllm.request_phase") or ("prefill" if "prefill" in e.name else "decode")),
                        address, e))
    return out


def read(idx: traces.TraceIndex, wl: Workload, mode: str) -> tuple[list[Death], list[str]]:
    """The deaths in the traces of `wl`'s run, on its clock, and a note for each (what the output says).

    `mode`: the recorded set-up's (pd or single); a single instance's leg is its decode leg, its pool the
    model's singles."""
    infos = sorted((i for i in idx.by_request.values() if i.deployment == "primary"), key=lambda i: i.start)
    arrivals = {r.request_id: r.arrival for r in wl.requests}
    shifts = [i.start - arrivals[i.request_id] for i in infos if i.request_id in arrivals]
    if not infos or not shifts:
        return [], []
    zero = statistics.median(shifts)  # unix time of the workload's clock 0
    first_use: dict[tuple[str, str], float] = {}  # (role, address) -> the first request that used it
    served: dict[tuple[str, str], float] = {}  # -> when the last leg that succeeded there started
    lost: dict[tuple[str, str], list[float]] = {}  # -> when attempts there lost their connection
    for info in infos:
        for role in ("prefill", "decode"):
            address = info.attrs.get(f"pd.{role}.instance")
            times = info.stage_times.get(role)
            if address is not None and times is not None:
                key = (role, str(address))
                first_use.setdefault(key, info.start)
                served[key] = max(served.get(key, 0.0), times[0])
        for role, address, event in _failures(info):
            first_use.setdefault((role, address), info.start)
            lost.setdefault((role, address), []).append(event.time)
    deaths, notes = [], []
    for (role, address), failed in sorted(lost.items()):
        last_ok = served.get((role, address), 0.0)
        after = sorted(t for t in failed if t >= last_ok)
        if not after:
            continue  # it served requests after its failures: a blip, not a death
        pool = sorted((t, a) for (r, a), t in first_use.items() if r == role)
        index = [a for _, a in pool].index(address)
        model_role = role if mode == "pd" else "single"
        at = after[0] - zero
        deaths.append(Death(model_role, index, at))
        notes.append(f"the recorded run lost {role} instance {address} at {at:.1f} s (the proxy's traces: {len(after)} "
                     f"attempt(s) there lost their connection and none succeeded there after): the self-replay "
                     f"replays it as {model_role} #{index} dying then, and the proxy's retries as pdproxy makes them")
    return deaths, notes
