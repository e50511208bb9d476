"""The KV-arrival rule, measured on the recorded real vLLM 0.23 stream (truth: the decode's stored blocks are
blocks the prefill computed; a decode's own generation blocks the prefill never saw)."""

from __future__ import annotations

from pdproxy.kvevents import BlockIndex, BlockStored, EventBatch
from pdproxy.kvevents.arrivals import kv_arrivals
from test_kvevents_decode import messages


def test_the_rule_finds_the_recorded_arrivals_and_no_generation_store():
    indexes: dict[str, BlockIndex] = {}
    prefill_keys: set[int] = set()
    found = {"arrival": 0, "missed": 0, "generation": 0, "false": 0}
    for src, _, _, payload in messages():
        from pdproxy.kvevents import decode_batch

        batch = decode_batch(payload)
        index = indexes.setdefault(src, BlockIndex())
        for event in batch.events:
            index.apply(event)
            if not isinstance(event, BlockStored):
                continue
            keys = [index.key_of(h) for h in event.block_hashes]
            if src == "p0":
                prefill_keys.update(keys)
                continue
            truth = all(k in prefill_keys for k in keys)
            rule = bool(kv_arrivals(EventBatch(batch.ts, [event])))
            found[("arrival" if rule else "missed") if truth else ("false" if rule else "generation")] += 1
    assert found == {"arrival": 44, "missed": 1, "generation": 46, "false": 0}


def test_recorded_arrivals_come_just_before_the_first_token_pdproxy_saw():
    """On the recording (one host, one clock): each request's first token (pdproxy's root span: start + TTFT, per
    decode) has a KV arrival on its decode 8-14 ms before it (p90 / p10), so an arrival filed at its batch time
    falls inside the stall it caused."""
    import base64
    import json
    from pathlib import Path

    from real_traces import otlp_spans

    from pdproxy.kvevents import decode_batch

    fixture = Path(__file__).parent / "fixtures" / "kv_events_vllm023"
    first_tokens: dict[str, list[float]] = {}
    for _, _, span in otlp_spans(fixture / "pdproxy-traces.jsonl"):
        attrs = {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}
        if not span.get("parentSpanId") and "gen_ai.response.time_to_first_chunk" in attrs:
            first_tokens.setdefault(attrs["pd.decode.instance"], []).append(
                int(span["startTimeUnixNano"]) / 1e9 + float(attrs["gen_ai.response.time_to_first_chunk"]))
    arrivals: dict[str, list[float]] = {}
    for line in (fixture / "kv-events-raw.jsonl").read_text().splitlines():
        record = json.loads(line)
        batch = decode_batch(base64.b64decode(record["frames"][2]))
        arrivals.setdefault(record["src"], []).extend(batch.ts for _ in kv_arrivals(batch))
    decodes = {"127.0.0.1:8200": "d0", "127.0.0.1:8201": "d1"}  # the recording's ports, in start order
    offsets = sorted(min((a - t for a in arrivals[decodes[address]]), key=abs) * 1000
                     for address, times in first_tokens.items() for t in times)
    assert len(offsets) >= 30
    p10, p50, p90 = (offsets[int(len(offsets) * q)] for q in (0.1, 0.5, 0.9))
    assert -20 < p10 <= p50 <= p90 < 0, (p10, p50, p90)


def test_an_arrival_this_process_routed_is_named_once_and_another_process_s_is_filed():
    import time

    from pdproxy.kvevents.arrivals import REQUEST_ID, arrival_listener
    from pdproxy.telemetry.stalls import StallRecords

    class Scan:
        first_token_ns = None  # its first token has not come yet

    records = StallRecords()
    listener = arrival_listener(records, ["d:1"])
    arrival = EventBatch(time.time(), [BlockStored([1, 2], None, list(range(32)), 16)])
    records.begin("kv_arrival", "d:1", "own-request", time.monotonic_ns() - 50_000_000, None, None, Scan())
    listener("d:1", arrival, True)
    now = time.monotonic_ns()
    found = records.instances["d:1"].around(now - 10**9, now, 0)
    assert [a.request_id for a in found] == ["own-request"]  # not twice
    listener("d:2", arrival, True)  # not a decode: nothing
    listener("d:1", EventBatch(time.time(), [BlockStored([3], 1, list(range(16)), 16)]), True)  # generation
    assert set(records.instances) == {"d:1"}
    other = StallRecords()
    arrival_listener(other, ["d:1"])("d:1", arrival, True)  # nothing of its own going on there: filed
    now = time.monotonic_ns()
    (filed,) = other.instances["d:1"].around(now - 10**9, now, 0)
    assert (filed.kind, filed.request_id, filed.tokens) == ("kv_arrival", REQUEST_ID, 32)
    assert abs(filed.start - now) < 50_000_000
