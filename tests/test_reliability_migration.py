"""Request migration on real processes: `pdproxy serve` in front of `pdproxy sim` instances whose decodes
die or stall the way a real vLLM decode does (status line first, then the KV pull, then tokens).

The simulator's greedy output is continuation-exact (pdproxy/sim/generation.py) and it answers reused
hand-off parameters with 200 and wrong text (facts file, fact 2), so "the client got the uninterrupted
run's text" proves both that the request moved and that it never read KV another decode had pulled.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import uuid

import httpx
import pytest

from ledgers import Counters, sse_events, trace_of
from otlp import attrs
from procs import start_proxy, start_sim

pytestmark = pytest.mark.timeout(180)

ENV = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
FAST = ("--retry-backoff", "0.01", "--health-check-interval", "0", "--eject-after-failures", "0")


class Rig:
    """Two prefill and two decode sims behind one proxy."""

    def __init__(self, tmp_path, *proxy_args: str, preset: str = "instant") -> None:
        self.procs = []
        try:
            self.prefills = [self._sim("prefill", preset) for _ in range(2)]
            self.decodes = [self._sim("decode", preset) for _ in range(2)]
            self.file = tmp_path / "spans.jsonl"
            proxy, self.url = start_proxy("--prefill", *self.prefills, "--decode", *self.decodes, "--trace-file",
                                          str(self.file), *FAST, *proxy_args, env=ENV)
            self.procs.append(proxy)
        except BaseException:
            self.stop()  # what started before a failed start
            raise

    def _sim(self, role: str, preset: str) -> str:
        proc, url = start_sim(role, "--preset", preset)
        self.procs.append(proc)
        return url

    def fault(self, url: str, *faults: dict) -> None:
        r = httpx.post(url + "/sim/faults", json={"faults": list(faults)})
        assert r.status_code == 200, r.text

    def state(self, url: str) -> dict:
        return httpx.get(url + "/sim/state").json()

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()

    def prefill_logs(self) -> str:
        return "".join(p.output() for p in self.procs[:2])


def stream(url: str, body: dict, path: str = "/v1/completions", rid: str | None = None) -> tuple[httpx.Response, str]:
    rid = rid or f"m-{uuid.uuid4().hex[:10]}"
    r = httpx.post(url + path, json=body, headers={"X-Request-Id": rid}, timeout=60)
    return r, rid


def chunks(r: httpx.Response) -> list[dict]:
    return [json.loads(e[6:]) for e in sse_events(r.text) if e.startswith("data: {")]


def text_of(r: httpx.Response, chat: bool = False) -> str:
    key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
    return "".join(key(c) for ch in chunks(r) for c in ch["choices"])


def complete(r: httpx.Response) -> bool:
    events = sse_events(r.text)
    return (r.status_code == 200 and events.count("data: [DONE]") == 1 and events[-1] == "data: [DONE]"
            and not any('"error"' in e for e in events))


def test_decode_dying_before_its_first_token_costs_concurrent_clients_nothing(tmp_path):
    """10 of 24 concurrent streams land on a decode that sends its status line, pulls the KV, then
    dies: every client gets its whole stream, with the text an uninterrupted run gives."""
    rig = Rig(tmp_path, "--decode-retries", "1")
    try:
        d1, d2 = rig.decodes
        bodies = [{"model": "sim-model", "prompt": f"words for request number {i}", "max_tokens": 24,
                   "stream": True} for i in range(24)]
        expected = [text_of(stream(d2, b)[0]) for b in bodies]  # an instance alone, no hand-off
        assert len(set(expected)) > 20  # distinct answers: a mix-up would show
        rig.fault(d1, {"kind": "die_before_first_token", "times": 10})
        c = Counters(rig.url)
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            results = list(pool.map(lambda b: stream(rig.url, b), bodies))
        for (r, rid), want in zip(results, expected):
            assert complete(r), r.text
            assert text_of(r) == want  # never the wrong text reused hand-off parameters give
        assert rig.state(d1)["faults_injected"]["die_before_first_token"] == 10
        assert all(rig.state(p)["stale_kv_reads_total"] == 0 for p in rig.prefills)
        assert "Potentially invalid KV blocks" not in rig.prefill_logs()
        assert c.requests(200) == 24
        assert c.delta("pdproxy_migrations_total", stage="before_first_token") == 10
        assert c.delta("pdproxy_abandoned_handoffs_total") == 10
        moved = [attrs(trace_of(rig.file, rid)["root"]) for _, rid in results]
        assert sum(a["pd.migrations"] for a in moved) == 10
        assert all(a["pd.prefill.reruns"] == 1 for a in moved if a["pd.migrations"])
        events = [e for _, rid in results for e in trace_of(rig.file, rid)["pd.decode"].get("events", ())
                  if e["name"] == "pd.decode.attempt_failed"]
        assert len(events) == 10 and {attrs(e)["pd.migration.reason"] for e in events} <= {"stream_broken",
                                                                                          "stream_truncated"}
        assert {attrs(e)["server.port"] for e in events} == {int(d1.rsplit(":", 1)[1])}
        for d in rig.decodes:  # the abandoned attempts were aborted on the instances
            assert rig.state(d)["running"] == 0 and rig.state(d)["kv_blocks_used"] == 0
    finally:
        rig.stop()


def test_a_stall_before_the_first_token_past_the_timeout_moves_the_request(tmp_path):
    rig = Rig(tmp_path, "--first-token-timeout", "1", "--decode-retries", "1")
    try:
        d1, d2 = rig.decodes
        body = {"model": "sim-model", "prompt": "a stalled request", "max_tokens": 8, "stream": True}
        want = text_of(stream(d2, body)[0])
        rig.fault(d1, {"kind": "stall_before_first_token", "seconds": 8})
        c = Counters(rig.url)
        results = []
        for _ in range(2):  # round robin: one of them is first sent to the stalling decode
            started = time.monotonic()
            r, rid = stream(rig.url, body)
            results.append((r, rid, time.monotonic() - started))
        assert rig.state(d1)["faults_injected"]["stall_before_first_token"] == 1
        moved = []
        for r, rid, took in results:
            assert complete(r) and text_of(r) == want and took < 8
            root = attrs(trace_of(rig.file, rid)["root"])
            if root["pd.migrations"]:
                moved.append(root)
                assert took >= 1.0 and root["gen_ai.response.time_to_first_chunk"] >= 1.0  # the time lost counts
        assert len(moved) == 1 and moved[0]["pd.decode.instance"] == d2.removeprefix("http://")
        assert c.delta("pdproxy_migrations_total", stage="before_first_token", reason="first_token_timeout") == 1
        assert rig.state(d1)["running"] == 0  # the stalled attempt was aborted there
    finally:
        rig.stop()


def test_mid_stream_death_is_spliced_into_one_complete_stream(tmp_path):
    """--migrate-mid-stream: both decodes die after 5 chunks once, and each continuation waits 0.4 s
    for its first token; the client sees one stream, the uninterrupted run's text, one [DONE], usage
    that adds up, and the splice gaps as stalls caused by migration."""
    rig = Rig(tmp_path, "--migrate-mid-stream", "--decode-retries", "2", "--stall-threshold", "0.2",
              preset="h200-llama8b-2gpu")
    try:
        d1, d2 = rig.decodes
        completion = {"model": "sim-model", "prompt": "tell me a long story about migration", "max_tokens": 30,
                      "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
        chat = {"model": "sim-model", "messages": [{"role": "user", "content": "tell me about splices"}],
                "max_tokens": 30, "stream": True, "temperature": 0, "return_token_ids": True}
        want = stream(d2, completion)[0]
        want_chat = stream(d2, chat, "/v1/chat/completions")[0]

        for body, path, reference in ((completion, "/v1/completions", want),
                                      (chat, "/v1/chat/completions", want_chat)):
            for d in rig.decodes:
                rig.fault(d, {"kind": "die_mid_stream", "after_chunks": 5},
                          {"kind": "slow_start", "seconds": 0.4, "times": 2})
            c = Counters(rig.url)
            r, rid = stream(rig.url, body, path)
            is_chat = path.endswith("chat/completions")
            assert complete(r), r.text
            assert text_of(r, is_chat) == text_of(reference, is_chat)
            got, ref = chunks(r), chunks(reference)
            assert {ch["id"] for ch in got} == {("chatcmpl-" if is_chat else "cmpl-") + rid}  # one stream, one id
            if is_chat:  # the client asked for the ids: the right ones, the prompt's once
                assert [t for ch in got for ch_ in ch["choices"] for t in ch_.get("token_ids") or ()] == \
                       [t for ch in ref for ch_ in ch["choices"] for t in ch_.get("token_ids") or ()]
                assert sum("prompt_token_ids" in ch for ch in got) == 1
            else:  # it did not: hidden, as vLLM shows them without the flag
                assert all(ch_["token_ids"] is None and ch_["prompt_token_ids"] is None
                           for ch in got for ch_ in ch["choices"])
                assert got[-1]["usage"] == ref[-1]["usage"]  # usage adds up across the splices
            spans = trace_of(rig.file, rid)
            root = attrs(spans["root"])
            assert root["pd.migrations"] == 2
            stalls = [attrs(e) for e in spans["pd.decode"].get("events", ()) if e["name"] == "pd.stall"]
            assert [s.get("pd.stall.cause") for s in stalls] == ["migration", "migration"]
            assert all(s["pd.stall.duration"] >= 0.4 for s in stalls)
            assert c.delta("pdproxy_migrations_total", stage="mid_stream", reason="stream_broken") == 2
            assert c.requests(200) == 1
    finally:
        rig.stop()


def test_mid_stream_migration_refuses_what_it_cannot_continue_exactly(tmp_path):
    rig = Rig(tmp_path, "--migrate-mid-stream", "--decode-retries", "2")
    try:
        body = {"model": "sim-model", "prompt": "sampled words", "max_tokens": 12, "stream": True,
                "temperature": 0.8}
        for d in rig.decodes:
            rig.fault(d, {"kind": "die_mid_stream", "after_chunks": 3})
        r, rid = stream(rig.url, body)
        events = sse_events(r.text)
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "stream_broken"  # an honest error, not a corrupt splice
        assert len(events) == 3 + 2
        root = attrs(trace_of(rig.file, rid)["root"])
        assert root["pd.migration.ineligible"] == "sampling" and root["pd.migrations"] == 0
    finally:
        rig.stop()
