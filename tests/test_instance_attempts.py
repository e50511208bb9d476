"""Per-instance attempt counters in /metrics, on real processes: an instance that fails while migration
or retries save every request it had still shows, by its own address, in the proxy's counters.

`pdproxy serve` in front of two prefill and two decode `pdproxy sim`s (round robin). The first decode
dies after its status line for 4 requests (the KV pulled: their hand-offs are abandoned), then is
stopped (later attempts fail to connect: nothing to abandon); or the first prefill is stopped. Every
client gets its whole stream. Label values stay within the configured instances.
"""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import pytest

from ledgers import counter
from pdproxy.bench import instances, traces, waterfall
from test_reliability_migration import Rig, complete, stream
from waits import wait_until

pytestmark = pytest.mark.timeout(180)

FAMILIES = ("pdproxy_instance_attempts_total", "pdproxy_instance_attempt_failures_total",
            "pdproxy_instance_moved_away_total", "pdproxy_instance_abandoned_handoffs_total")


def series(text: str) -> list[dict[str, str]]:
    """The label sets of every sample of the per-instance attempt families."""
    out = []
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in FAMILIES:
            out.append(dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0])))
    return out


def traces_of(path, request_ids: list[str]) -> traces.TraceIndex:
    """The trace file once every request's trace is in it (spans are written in batches)."""
    def complete() -> traces.TraceIndex | None:
        idx = traces.read_traces([str(path)])
        return idx if all(rid in idx.by_request for rid in request_ids) else None
    return wait_until(complete, "every request's trace in the trace file")


def test_a_failing_decode_shows_in_the_per_instance_attempt_counters(tmp_path):
    rig = Rig(tmp_path, "--decode-retries", "1")
    try:
        d1, d2 = rig.decodes
        dead, alive = d1.removeprefix("http://"), d2.removeprefix("http://")
        before = httpx.get(rig.url + "/metrics").text
        # both decodes have their series before any request: a dashboard shows an idle or dead one at 0
        assert counter(before, "pdproxy_instance_attempts_total", role="decode", server_address=dead) == 0
        assert counter(before, "pdproxy_instance_attempts_total", role="decode", server_address=alive) == 0
        rig.fault(d1, {"kind": "die_before_first_token", "times": 4})
        body = {"model": "sim-model", "prompt": "words for a request", "max_tokens": 16, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            first = list(pool.map(lambda _: stream(rig.url, body), range(12)))
        assert all(complete(r) for r, _ in first)
        assert rig.state(d1)["faults_injected"]["die_before_first_token"] == 4
        rig.procs[2].stop()  # the first decode (Rig starts prefills, then decodes) is gone
        later = [stream(rig.url, body) for _ in range(6)]
        assert all(complete(r) for r, _ in later)  # round robin sends some to the dead one: all moved

        text = httpx.get(rig.url + "/metrics").text
        failed = {reason: counter(text, "pdproxy_instance_attempt_failures_total", server_address=dead, reason=reason)
                  for reason in ("stream_broken", "stream_truncated", "connect_error")}
        broke = failed["stream_broken"] + failed["stream_truncated"]
        assert broke == 4 and failed["connect_error"] >= 1, failed
        total_failed = counter(text, "pdproxy_instance_attempt_failures_total", server_address=dead)
        assert total_failed == broke + failed["connect_error"]
        # each failed attempt moved its request before its first token; only the ones that had the KV
        # pulled gave up their hand-off
        assert counter(text, "pdproxy_instance_moved_away_total", server_address=dead,
                       stage="before_first_token") == total_failed
        assert counter(text, "pdproxy_instance_abandoned_handoffs_total", server_address=dead) == 4
        sent = counter(text, "pdproxy_instance_attempts_total", role="decode", server_address=dead)
        assert sent >= total_failed + 1  # and it served some before it failed
        assert counter(text, "pdproxy_instance_attempt_failures_total", server_address=alive) == 0
        # every attempt is counted: 18 requests that all ended on a decode, plus one per failure
        both = sent + counter(text, "pdproxy_instance_attempts_total", role="decode", server_address=alive)
        assert both == 18 + total_failed
        # label values bounded by the configuration: the configured decodes, the fixed reasons and stages
        labels = series(text)
        assert {s["server_address"] for s in labels} == {u.removeprefix("http://") for u in rig.prefills + rig.decodes}
        assert {s["role"] for s in labels} == {"prefill", "decode"}
        assert {s["server_address"] for s in labels if s["role"] == "decode"} == {dead, alive}
        assert {s["reason"] for s in labels if "reason" in s} <= {"stream_broken", "stream_truncated",
                                                                   "connect_error"}
        assert {s["stage"] for s in labels if "stage" in s} == {"before_first_token", "mid_stream"}  # 0 from start
        assert counter(text, "pdproxy_instance_moved_away_total", stage="mid_stream") == 0
    finally:
        rig.stop()


def test_a_dead_prefill_shows_in_the_counters_the_traces_and_the_report(tmp_path):
    """Retries save every request a stopped prefill gets (connect errors, moved to the other prefill): the
    dead prefill ends no request, and is seen by its failed attempts in /metrics and in `pdproxy report`."""
    rig = Rig(tmp_path, "--prefill-retries", "1")
    try:
        dead = rig.prefills[0].removeprefix("http://")
        rig.procs[0].stop()
        body = {"model": "sim-model", "prompt": "words for a request", "max_tokens": 8, "stream": True}
        results = [stream(rig.url, body) for _ in range(8)]
        assert all(complete(r) for r, _ in results)
        text = httpx.get(rig.url + "/metrics").text
        failed = counter(text, "pdproxy_instance_attempt_failures_total", role="prefill", server_address=dead,
                         reason="connect_error")
        assert failed >= 3  # round robin: about half the requests were first sent there
        assert counter(text, "pdproxy_instance_attempts_total", role="prefill", server_address=dead) == failed
        assert counter(text, "pdproxy_instance_moved_away_total", role="prefill", server_address=dead,
                       stage="before_first_token") == failed
        assert counter(text, "pdproxy_instance_attempts_total", role="prefill") == 8 + failed
        assert {s["server_address"] for s in series(text) if s["role"] == "prefill"} == {
            u.removeprefix("http://") for u in rig.prefills}
        # the report's per-instance rows, from the proxy's trace file
        idx = traces_of(rig.file, [rid for _, rid in results])
        joined, _ = traces.join([{"request_id": rid} for _, rid in results], idx)
        rows = {(i["role"], i["address"]): i for i in instances.breakdown(
            [{"request_id": rid, "ok": True} for _, rid in results], joined, unit="chunk", stall_threshold=0.1)}
        assert rows[("prefill", dead)]["attempt_failures"] == {"connect_error": failed}
        assert rows[("prefill", dead)]["requests"] == 0 and rows[("prefill", dead)]["moved_away"] == failed
        assert sum(i["attempts"] for (role, _), i in rows.items() if role == "prefill") == 8 + failed
        # each moved request's waterfall draws its failed prefill attempt, and says where and why
        moved = [i for i in joined.values() if any(e.name == "pd.prefill.attempt_failed"
                                                   for e in i.stage_events.get("prefill") or [])]
        assert len(moved) == failed
        lines = waterfall.render(moved[0], width=100)
        assert any(x.startswith("  ✗ prefill #1") and "✗" in x[22:] for x in lines), lines
        assert any(x.startswith(f"attempt failed: prefill #1 on {dead} at +") and x.endswith("connect_error")
                   for x in lines), lines
    finally:
        rig.stop()
