"""One row per prefill and per decode instance of a run, from the traces: where the slow or failing one is.

Each measured request with a trace counts on the instances its root span names (`pd.prefill.instance`,
`pd.decode.instance`). A failure counts on the instance of the stage that failed (`pd.failed_stage`:
prefill on the prefill instance, kv_transfer and decode on the decode instance), with the bench's
reason (or the proxy's `error.type` for runs built from traces). Latencies are over the instance's
successful requests: client TTFT, the `pd.kv_transfer` span (the KV wait, an upper bound), the
per-request max gap, and how many requests had a gap over the stall threshold.

Requests count where they ended; attempts count where they were sent. A decode that dies while
migration saves its requests finishes none of them, so it shows only through its attempts: every
`pd.decode.attempt_failed` event on `pd.decode` is a failed attempt on the instance it names
(`server.address`:`server.port`), by reason (`pd.migration.reason`), moved away when another attempt
followed it, with its KV hand-off abandoned when `pd.handoff.abandoned` says so. The request's last
decode attempt (`pd.decode.attempts`) counts on `pd.decode.instance` unless an event says it failed.
Prefill attempts likewise: each `pd.prefill.attempt_failed` event (on `pd.prefill`, or on `pd.decode`
for a re-prefill of a migration) is a failed attempt on its instance, by `error.type`; the prefill
that answered counts on `pd.prefill.instance`, each re-prefill that answered (`pd.prefill.rerun`) on
its own. Attempts
count over every traced request of the run, warm-up included (a decode killed while a warm-up request
waits on it has failed all the same); requests and latencies over the measured ones.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pdproxy.bench import stats
from pdproxy.bench.traces import TraceInfo
from pdproxy.telemetry import names as n

ROLES = ("prefill", "decode")
SINGLE = "single"  # an instance of a single-mode run: it computes prompts and tokens alike


def _role(info: TraceInfo, role: str) -> str:
    """The row's role: a single-mode request's one instance is `single`, not its decode."""
    return SINGLE if str(info.attrs.get("pd.mode")) == SINGLE else role


def breakdown(requests: list[dict[str, Any]], joined: dict[str, TraceInfo], *, unit: str,
              stall_threshold: float) -> list[dict[str, Any]]:
    """Rows sorted by role (prefill, decode, single) then address; empty when no measured request has a trace
    naming an instance."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(role: str, address: str) -> dict[str, Any]:
        return rows.setdefault((role, address), {
            "role": role, "address": address, "requests": 0, "failures": Counter(), "attempts": 0,
            "attempt_failures": Counter(), "moved_away": 0, "abandoned_handoffs": 0,
            "_ttft": [], "_kv": [], "_max": []})

    for r in requests:
        info = joined.get(str(r.get("request_id")))
        if info is None:
            continue
        for role, address in attempts(info):  # warm-up included: an instance's failures are not the warm-up's
            row(_role(info, role), address)["attempts"] += 1
        for role, address, reason, moved, abandoned in failed_attempts(info):
            x = row(_role(info, role), address)
            x["attempt_failures"][reason] += 1
            x["moved_away"] += moved
            x["abandoned_handoffs"] += abandoned
        if r.get("warmup"):
            continue
        failed_stage = info.attrs.get("pd.failed_stage")
        for role in ROLES:
            address = info.attrs.get(f"pd.{role}.instance")
            if not address:
                continue
            x = row(_role(info, role), str(address))
            x["requests"] += 1
            if not r.get("ok"):
                if _failed_on(role, failed_stage, info):
                    x["failures"][str(r.get("error") or info.attrs.get("error.type") or "failed")] += 1
                continue
            x["_ttft"].append(r.get("ttft"))
            x["_kv"].append(info.stages.get("kv_transfer"))
            tail = stats.request_tail(r, unit)
            if tail:
                x["_max"].append(tail[1])
    out = []
    order = (*ROLES, SINGLE)
    for key in sorted(rows, key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k)):
        x = rows[key]
        ttft, kv, maxes = x.pop("_ttft"), x.pop("_kv"), x.pop("_max")
        out.append({**x, "failures": dict(x["failures"].most_common()), "failed": sum(x["failures"].values()),
                    "attempt_failures": dict(x["attempt_failures"].most_common()),
                    "attempts_failed": sum(x["attempt_failures"].values()),
                    "ttft": stats.describe(ttft), "kv_wait": stats.describe(kv),
                    "max_itl": stats.describe(maxes), "stalls": sum(1 for m in maxes if m > stall_threshold)})
    return out


def flags(rows: list[dict[str, Any]]) -> list[str]:
    """One line per instance with failed attempts: a dead instance whose requests were all saved
    elsewhere has no failed request, and must still be seen."""
    out = []
    for x in rows:
        if not x.get("attempts_failed"):
            continue
        reasons = ", ".join(f"{k}: {v}" for k, v in x["attempt_failures"].items())
        out.append(f"{x['role']} {x['address']}: {x['attempts_failed']} of {x['attempts']} attempts failed "
                   f"({reasons}); {x['moved_away']} moved to another instance, {x['abandoned_handoffs']} KV "
                   f"hand-offs abandoned; {x['requests']} requests finished there")
    return out


def _address(attrs: dict[str, Any]) -> str | None:
    host, port = attrs.get("server.address"), attrs.get("server.port")
    return f"{host}:{port}" if host and port is not None else None


def _events(info: TraceInfo, name: str, stages: tuple[str, ...] = ("decode",)) -> list[dict[str, Any]]:
    return [e.attrs for stage in stages for e in info.stage_events.get(stage) or [] if e.name == name]


def failed_attempts(info: TraceInfo) -> list[tuple[str, str, str, bool, bool]]:
    """(role, address, reason, moved away, hand-off abandoned) of each failed attempt. A decode attempt
    moved away when a later one followed (its number is below pd.decode.attempts); a prefill attempt
    unless it is the request's last and the request failed."""
    total = _int(info.stage_attrs.get("decode", {}).get(n.DECODE_ATTEMPTS))
    out = []
    for a in _events(info, n.ATTEMPT_EVENT):
        address = _address(a)
        if address is None:
            continue
        number = _int(a.get(n.ATTEMPT_NUMBER))
        moved = total is not None and number is not None and number < total
        out.append(("decode", address, str(a.get(n.MIGRATION_REASON) or "unknown"), moved, a.get(n.ABANDONED) is True))
    prefills = [a for a in _events(info, n.PREFILL_ATTEMPT_EVENT, ("prefill", "decode")) if _address(a)]
    failed = info.status == "ERROR" or bool(info.attrs.get("pd.failed_stage"))
    for i, a in enumerate(prefills):
        last = i == len(prefills) - 1 and failed and not _events(info, n.PREFILL_RERUN_EVENT)
        out.append(("prefill", str(_address(a)), str(a.get("error.type") or "unknown"), not last, False))
    return out


def attempts(info: TraceInfo) -> list[tuple[str, str]]:
    """(role, address) of every attempt the trace shows: the failed ones, the last decode attempt when it
    did not fail, the prefill that answered, and each re-prefill that answered."""
    out = [(x[0], x[1]) for x in failed_attempts(info)]
    total = _int(info.stage_attrs.get("decode", {}).get(n.DECODE_ATTEMPTS))
    numbers = {_int(a.get(n.ATTEMPT_NUMBER)) for a in _events(info, n.ATTEMPT_EVENT)}
    decode = info.attrs.get("pd.decode.instance")
    if decode and (total is None or total not in numbers):
        out.append(("decode", str(decode)))
    prefill = info.attrs.get("pd.prefill.instance")
    if prefill and info.attrs.get("pd.failed_stage") != "prefill":
        out.append(("prefill", str(prefill)))
    out += [("prefill", a) for a in map(_address, _events(info, n.PREFILL_RERUN_EVENT)) if a]
    return out


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def _failed_on(role: str, failed_stage: Any, info: TraceInfo) -> bool:
    if not info.attrs.get("pd.prefill.instance"):
        return role == "decode"  # no P/D: the one instance did the prefill too
    if failed_stage == "prefill":
        return role == "prefill"
    if failed_stage in ("kv_transfer", "decode"):
        return role == "decode"
    # no stage recorded: the decode if the request had one, else its prefill
    return role == ("decode" if info.attrs.get("pd.decode.instance") else "prefill")
