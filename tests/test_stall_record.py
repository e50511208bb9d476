"""The live stall record (pdproxy/telemetry/stalls.py): the rule, its bounds, and the lazy end of an activity."""

from __future__ import annotations

import tracemalloc

from pdproxy.bench import attribution
from pdproxy.telemetry import stalls as live

MS = 1_000_000


class Scan:
    """A culprit's stream as the record sees it: its first token, once it came."""

    def __init__(self) -> None:
        self.chunk_times: list[int] = []

    @property
    def first_token_ns(self) -> int | None:
        return self.chunk_times[0] if self.chunk_times else None


def test_the_bench_uses_the_live_rule():
    assert attribution.pick is live.pick and attribution.window is live.window
    assert attribution.TOLERANCE == live.TOLERANCE and live.TOLERANCE_NS == 10 * MS


def test_a_kv_arrival_inside_the_gap_is_the_cause_and_its_own_is_not():
    records = live.StallRecords()
    own = Scan()
    records.begin("kv_arrival", "d:1", "victim", 0, bytes([1] * 16), bytes([11] * 8), own)
    culprit = Scan()
    record, act = records.begin("kv_arrival", "d:1", "culprit", 100 * MS, bytes([2] * 16), bytes([22] * 8), culprit)
    own.chunk_times.append(50 * MS)
    # the victim stalls from 120 ms for 60 ms while the culprit's KV is still arriving (no first token yet)
    [s] = records.attribute("d:1", "victim", [(120 * MS, 0.060, 1)])
    assert s.cause == "kv_arrival" and [a.request_id for a in s.culprits] == ["culprit"]
    assert live.span_links([s], 16) == [(bytes([2] * 16), bytes([22] * 8), {})]
    culprit.chunk_times.append(185 * MS)  # its first token: the arrival is over
    # a later gap of the victim, well after the arrival ended: nothing to blame
    [later] = records.attribute("d:1", "victim", [(300 * MS, 0.060, 1)])
    assert later.cause == "none" and later.culprits == []
    # a gap that ended within the tolerance before the arrival began still counts (the offline rule)
    [edge] = records.attribute("d:1", "victim", [(30 * MS, 0.065, 1)])
    assert edge.cause == "kv_arrival"
    record.end(act, 900 * MS, 4096)
    assert act.end == 185 * MS and act.tokens == 4096 and act.stream is None


def test_priority_and_marks():
    records = live.StallRecords()
    a, b = Scan(), Scan()
    records.begin("prefill", "s:1", "small", 0, None, None, a)
    records.begin("prefill", "s:1", "big", 0, None, None, b)
    a.chunk_times.append(200 * MS)
    b.chunk_times.append(200 * MS)
    rec = records.instances["s:1"]
    for activity in list(rec.open.values()):
        rec.end(activity, 0, 4000 if activity.request_id == "big" else 10)
    [s, marked] = records.attribute("s:1", "v", [(50 * MS, 0.1, 1), (400 * MS, 0.1, 1)],
                                    marks=[(450 * MS, "migration")])
    assert s.cause == "prefill" and [c.request_id for c in s.culprits] == ["big", "small"]  # largest prompt first
    assert marked.cause == "migration"
    assert live.span_links([s], 16) == []  # unsampled culprits: nothing to link to
    assert records.attribute(None, "v", [(50 * MS, 0.1, 1)])[0].cause == "none"


def test_memory_is_bounded_with_5000_concurrent_streams():
    records = live.StallRecords(window=1.0, limit=512)
    tracemalloc.start()
    scans = []
    try:
        for round_ in range(4):
            base = round_ * 2_000 * MS
            opened = []
            for i in range(5000):  # 5000 streams in flight on one decode at once
                scan = Scan()
                scans.append(scan)
                opened.append(records.begin("kv_arrival", "d:1", f"r{round_}-{i}", base + i * 1000, None, None, scan))
            rec = records.instances["d:1"]
            assert len(rec.open) <= 512
            for i, (record, act) in enumerate(opened):
                record.end(act, base + i * 1000 + 5 * MS, 100)
            assert len(rec.closed) <= 512 and len(rec.starts) == len(rec.closed)
            assert list(rec.starts) == sorted(rec.starts)
            if round_ == 1:
                first, _ = tracemalloc.get_traced_memory()
            scans.clear()
        second, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert second < first * 1.2 + 64 * 1024  # the third and fourth rounds did not grow it
    # the window: a round ~2 s later left nothing of the first rounds
    assert min(rec.starts) >= 3 * 2_000 * MS - 1_000 * MS


def test_closed_activities_stay_sorted_when_they_close_out_of_order():
    rec = live.InstanceRecord(window_ns=10_000 * MS, limit=8)
    acts = [live.Activity("kv_arrival", f"r{i}", i * MS, None, None, None) for i in range(6)]
    for a in acts:
        rec.begin(a)
    for i in (3, 0, 5, 1, 4, 2):
        rec.end(acts[i], (10 + i) * MS, 1)
    assert list(rec.starts) == [i * MS for i in range(6)]
    assert sorted(a.request_id for a in rec.around(11 * MS, 12 * MS)) == ["r1", "r2", "r3", "r4", "r5"]


class CountingDict(dict):
    """The record's open activities, counting how many of them a query looks at."""

    looked = 0

    def items(self):
        for item in super().items():
            CountingDict.looked += 1
            yield item


def test_the_work_per_stall_is_bounded_however_many_requests_coincide():
    # 5,000 requests hand off to one decode within 4 s (the hold benchmark); 500 still wait for their
    # first token. A victim whose every gap is a stall must not look at all of them per gap: before the
    # bound, 20 stalls x 5,000 coinciding activities each held the event loop for tens of seconds
    records = live.StallRecords()
    record = None
    for i in range(5000):
        scan = Scan()
        record, act = records.begin("kv_arrival", "d:1", f"r{i}", i * 4 * MS // 5, None, None, scan)
        if i < 4500:
            scan.chunk_times.append(i * 4 * MS // 5 + 30 * MS)
            record.end(act, scan.first_token_ns, 100 + i)  # as RequestTrace.first_token() files it
    record.open = CountingDict(record.open)
    stalls = [(1000 * MS + k * 100 * MS, 0.15, 1) for k in range(20)]  # within the record (its last 4,096)
    found = records.attribute("d:1", "victim", stalls)
    assert [s.cause for s in found] == ["kv_arrival"] * 20
    assert all(0 < len(s.culprits) <= live.SCAN_LIMIT for s in found)
    assert CountingDict.looked <= 20 * live.SCAN_STEPS < 20 * 500  # each query stops at the bound
    # the culprits named first are the largest prompts among those looked at
    assert all(s.culprits[0].tokens == max(a.tokens for a in s.culprits) for s in found)


def test_an_activity_is_filed_at_the_first_token_not_at_the_end_of_its_request(tmp_path):
    from pdproxy.telemetry.metrics import Metrics
    from pdproxy.telemetry.recorder import Recorder

    recorder = Recorder(Metrics(), None, stall_threshold=0.1, stalls=live.StallRecords())
    trace = recorder.begin(route="completions", operation="text_completion", chat=False, headers={},
                           request_id="r", pd_mode=True)
    trace.admitted("127.0.0.1:1", "127.0.0.1:2")
    trace.prefill_done("127.0.0.1:1", 200, 1, "received")
    trace.decode_sent("127.0.0.1:2")
    record = recorder.stalls.instances["127.0.0.1:2"]
    assert len(record.open) == 1 and not record.closed
    trace.scan.chunk_times.append(trace.t.decode_sent + 5 * MS)
    trace.first_token()
    assert not record.open and [a.request_id for a in record.closed] == ["r"]
    trace.finish()
    assert record.closed[0].tokens == 0 and not record.open
