"""One row per prefill and per decode instance of a run, from the traces: where the slow or failing one is.

Each measured request with a trace counts on the instances its root span names (`pd.prefill.instance`,
`pd.decode.instance`). A failure counts on the instance of the stage that failed (`pd.failed_stage`:
prefill on the prefill instance, kv_transfer and decode on the decode instance), with the bench's
reason (or the proxy's `error.type` for runs built from traces). Latencies are over the instance's
successful requests: client TTFT, the `pd.kv_transfer` span (the KV wait, an upper bound), the
per-request max gap, and how many requests had a gap over the stall threshold.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pdproxy.bench import stats
from pdproxy.bench.traces import TraceInfo

ROLES = ("prefill", "decode")


def breakdown(requests: list[dict[str, Any]], joined: dict[str, TraceInfo], *, unit: str,
              stall_threshold: float) -> list[dict[str, Any]]:
    """Rows sorted by role then address; empty when no measured request has a trace naming an instance."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in requests:
        info = joined.get(str(r.get("request_id")))
        if r.get("warmup") or info is None:
            continue
        failed_stage = info.attrs.get("pd.failed_stage")
        for role in ROLES:
            address = info.attrs.get(f"pd.{role}.instance")
            if not address:
                continue
            row = rows.setdefault((role, str(address)), {"role": role, "address": str(address), "requests": 0,
                                                         "failures": Counter(), "_ttft": [], "_kv": [], "_max": []})
            row["requests"] += 1
            if not r.get("ok"):
                if _failed_on(role, failed_stage, info):
                    row["failures"][str(r.get("error") or info.attrs.get("error.type") or "failed")] += 1
                continue
            row["_ttft"].append(r.get("ttft"))
            row["_kv"].append(info.stages.get("kv_transfer"))
            tail = stats.request_tail(r, unit)
            if tail:
                row["_max"].append(tail[1])
    out = []
    for key in sorted(rows):
        row = rows[key]
        maxes = row.pop("_max")
        out.append({**row, "failures": dict(row["failures"].most_common()),
                    "failed": sum(row["failures"].values()),
                    "ttft": stats.describe(row.pop("_ttft")), "kv_wait": stats.describe(row.pop("_kv")),
                    "max_itl": stats.describe(maxes), "stalls": sum(1 for m in maxes if m > stall_threshold)})
    return out


def _failed_on(role: str, failed_stage: Any, info: TraceInfo) -> bool:
    if not info.attrs.get("pd.prefill.instance"):
        return role == "decode"  # no P/D: the one instance did the prefill too
    if failed_stage == "prefill":
        return role == "prefill"
    if failed_stage in ("kv_transfer", "decode"):
        return role == "decode"
    # no stage recorded: the decode if the request had one, else its prefill
    return role == ("decode" if info.attrs.get("pd.decode.instance") else "prefill")
