"""Migration against hostile and odd decode instances, on real processes: `pdproxy serve` in front of
scripted instances (tests/scripted_backend.py) that send exact bytes: token ids that do not add up,
streams that never reach a token, busy continuations, reasoning deltas, batched choices, streams that
break after `[DONE]`.

Whatever an instance does, the client gets what the standards say: a JSON error before the status
line, only SSE events after it (one error event, one `[DONE]`), nothing unbounded, every failure traced
and counted; and a stream is continued elsewhere only when the continuation is exact.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

from ledgers import Counters, ScriptedGroup, proc_rss, sse_events, trace_of
from otlp import attrs
from procs import start_proxy
from waits import scaled

pytestmark = pytest.mark.timeout(120)

ENV = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
FAST = ("--retry-backoff", "0.01", "--health-check-interval", "0", "--eject-after-failures", "0")
PROMPT_IDS = [101, 102, 103]
GREEDY = {"model": "m", "prompt": "count with me", "max_tokens": 12, "stream": True, "temperature": 0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "think, then count"}], "max_tokens": 12,
        "stream": True, "temperature": 0}


def event(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


def text_event(text: str, ids: list[int], first: bool = False, finish: str | None = None, index: int = 0) -> str:
    """A completions chunk as vLLM 0.23 streams it with return_token_ids (facts file, fact 4)."""
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": ids,
              "prompt_token_ids": PROMPT_IDS if first else None}
    return event({"id": "cmpl-up", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]})


def chat_event(delta: dict, ids: list[int] | None = None, first: bool = False, finish: str | None = None) -> str:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    obj = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    if first:
        obj["prompt_token_ids"] = PROMPT_IDS
    return event(obj)


DONE = "data: [DONE]\n\n"
WORDS = [text_event(w, [200 + i], first=i == 0) for i, w in enumerate(["one", " two", " three"])]
REST = [text_event(w, [300 + i]) for i, w in enumerate([" four", " five"])] + [text_event("", [], finish="length"), DONE]


def broken_after(chunks: list[str]) -> dict:
    """A step that sends `chunks`, then resets the connection."""
    return {"chunks": chunks + ["data: never sent\n\n"], "abort_after": len(chunks), "chunk_delay": 0.01}


def rig(started, tmp_path, *proxy_args: str, prefill: bool = False, decodes: int = 2):
    """Scripted decode instances (one script, one journal) behind a proxy that writes spans to a file."""
    d = ScriptedGroup("decode", decodes)
    started.append(d)
    legs = ()
    if prefill:
        p = ScriptedGroup("prefill", 1)
        started.append(p)
        legs = ("--prefill", p.url)
    trace_file = tmp_path / "spans.jsonl"
    proxy, url = start_proxy(*legs, "--decode", *d.urls, "--trace-file", str(trace_file), *FAST, *proxy_args, env=ENV)
    started.append(proxy)
    return d, url, trace_file, proxy


def post(url: str, body: dict, path: str = "/v1/completions", timeout: float = 30) -> tuple[httpx.Response, str]:
    rid = f"h-{uuid.uuid4().hex[:10]}"
    return httpx.post(url + path, json=body, headers={"X-Request-Id": rid}, timeout=scaled(timeout)), rid


def data_events(r: httpx.Response) -> list[dict]:
    return [json.loads(e[6:]) for e in sse_events(r.text) if e.startswith("data: {")]


def assert_sse_error_end(r: httpx.Response, code: str) -> dict:
    """A 200 whose body is only SSE events, ending in exactly one error event and one [DONE]."""
    assert r.status_code == 200
    assert "HTTP/1.1" not in r.text  # no second response inside the first
    events = sse_events(r.text)
    assert all(e.startswith("data: ") for e in events), events
    assert events.count("data: [DONE]") == 1 and events[-1] == "data: [DONE]"
    errors = [json.loads(e[6:])["error"] for e in events if '"error"' in e]
    assert len(errors) == 1 and errors[0]["code"] == code and events[-2].startswith('data: {"error"')
    return errors[0]


# -- 1: a busy or refusing continuation after the client's 200 --------------------------------------------


@pytest.mark.parametrize("answer, code", [
    ({"status": 429, "headers": {"Retry-After": "30"}, "body": {"error": {"message": "busy", "code": 429}}},
     "upstream_429"),
    ({"status": 503, "headers": {"Retry-After": "30"}, "body": {"error": {"message": "overloaded"}}}, "upstream_503"),
    ({"status": 400, "body": {"error": {"message": "prompt too long for the context"}}}, "upstream_4xx"),
])
def test_a_continuation_that_is_turned_away_ends_the_stream_with_one_error_event(started, tmp_path, answer, code):
    """The decode breaks after three tokens; the continuation's decode answers 429/503/400 (default
    --decode-retries 1: the migration spent it). The client's 200 gets one error event and one [DONE],
    never an HTTP status line inside its body; the failure is traced at the decode stage and counted."""
    d, url, trace_file, _ = rig(started, tmp_path, "--migrate-mid-stream")
    d.script(broken_after(WORDS), answer)
    c = Counters(url)
    r, rid = post(url, GREEDY)
    error = assert_sse_error_end(r, code)
    assert error["message"].startswith("decode instance answered") and error["type"]
    assert "".join(ch["choices"][0]["text"] for ch in data_events(r) if "choices" in ch) == "one two three"
    first, continuation = d.journal()
    assert continuation["body"]["prompt"] == PROMPT_IDS + [200, 201, 202]
    root = attrs(trace_of(trace_file, rid)["root"])
    assert root["error.type"] == code and root["pd.failed_stage"] == "decode"
    assert c.errors("decode", code) == 1 and c.requests(200, "decode") == 1


def test_a_continuation_whose_prefill_is_turned_away_ends_the_stream_with_one_error_event(started, tmp_path):
    """P/D: the continuation's prefill (the prompt plus the tokens delivered) answers 429 on the only
    prefill instance: the same single error event, never the prefill's status line in the body."""
    d, url, trace_file, _ = rig(started, tmp_path, "--migrate-mid-stream", "--prefill-retries", "0", prefill=True)
    prefill = started[1]
    prefill.script({}, {"status": 429, "body": {"error": {"message": "busy"}}})
    d.script(broken_after(WORDS), {"chunks": REST})
    r, rid = post(url, GREEDY)
    assert_sse_error_end(r, "upstream_429")
    assert len(d.journal()) == 1 and len(prefill.journal()) == 2
    assert attrs(trace_of(trace_file, rid)["root"])["error.type"] == "upstream_429"


# -- 7: hand-offs no decode will pull ------------------------------------------------------------------


@pytest.mark.parametrize("answers, retries, abandoned", [
    ([{"status": 429, "body": {"error": {"message": "busy"}}}], "0", 1),
    ([{"status": 400, "body": {"error": {"message": "bad request"}}}], "0", 1),
    ([{"status": 500, "body": {"error": {"message": "engine broke"}}}], "0", 1),
    ([{"status": 429, "body": {"error": {"message": "busy"}}}, {}], "1", 0),  # the retry pulls the same blocks
])
def test_every_hand_off_no_decode_pulls_is_counted_abandoned(started, tmp_path, answers, retries, abandoned):
    """A prefill's blocks that no decode pulls stay held until vLLM's abort timeout (facts file, fact 3),
    whether the decode answered 500, 429 or 400: each such hand-off is counted once (a 400 not on the
    decode's account)."""
    d, url, trace_file, _ = rig(started, tmp_path, "--decode-retries", retries, prefill=True)
    d.script(*answers)
    c = Counters(url)
    r, rid = post(url, {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True})
    assert r.status_code == (200 if abandoned == 0 else answers[0]["status"] if answers[0]["status"] < 500 else 502)
    assert c.delta("pdproxy_abandoned_handoffs_total") == abandoned
    per_decode = sum(c.delta("pdproxy_instance_abandoned_handoffs_total", role="decode", server_address=u.split("//")[1])
                     for u in d.urls)
    # and put down to the decode that gave it up, unless it refused the request as invalid (the client's doing)
    assert per_decode == (0 if answers[0]["status"] == 400 else abandoned)
    assert attrs(trace_of(trace_file, rid)["root"]).get("pd.handoffs.abandoned", 0) == abandoned


# -- 2: a decode that streams but never a token -------------------------------------------------------


class PeakRss:
    """The largest resident size of a process while the block runs (sampled every 20 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.start = pid, 0, proc_rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, proc_rss(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


ROLE_ONLY = chat_event({"role": "assistant", "content": ""})
COMMENT = ": " + "x" * (1 << 16) + "\n\n"  # an SSE comment of 64 KiB


@pytest.mark.parametrize("chunk, repeat, path", [
    (ROLE_ONLY, 1_000_000, "/v1/chat/completions"),  # ~100 MB of role-only deltas, endless to the old proxy
    (COMMENT, 3200, "/v1/completions"),  # 200 MiB of comments
])
def test_a_decode_that_streams_no_token_is_cut_off_within_bounds(started, tmp_path, chunk, repeat, path):
    """Before the first token the proxy holds what it reads (the client's status line waits for a token):
    past MAX_HEAD_EVENTS events or MAX_HEAD_BYTES bytes without one, the attempt fails, is retried on the
    other decode, and the client gets a JSON 502 at once; the proxy's memory stays bounded."""
    d, url, trace_file, proxy = rig(started, tmp_path, "--decode-retries", "1")
    d.script(*[{"chunks": [chunk], "repeat": repeat, "chunk_delay": 0}] * 2)
    c = Counters(url)
    body = CHAT if path.endswith("chat/completions") else GREEDY
    started_at = time.monotonic()
    with PeakRss(proxy.popen.pid) as rss:
        r, rid = post(url, body, path, timeout=20)
    assert time.monotonic() - started_at < scaled(10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "no_first_token", r.text
    assert len(d.journal()) == 2  # retried on the other instance first
    assert rss.growth < 80 * 1024 * 1024, rss.growth
    assert c.delta("pdproxy_request_errors_total", error_type="no_first_token") == 1
    assert attrs(trace_of(trace_file, rid)["root"])["error.type"] == "no_first_token"


# -- 6: what migration must not continue, or must continue right ---------------------------------------


def ineligible(trace_file, rid: str) -> str | None:
    return attrs(trace_of(trace_file, rid)["root"]).get("pd.migration.ineligible")


@pytest.mark.parametrize("body, reason", [
    ({**GREEDY, "prompt": ["count with me", "and with me"]}, "batched"),
    ({**GREEDY, "logprobs": 0}, "logprobs"),  # vLLM returns the sampled token's logprob for 0
    ({**GREEDY, "prompt_logprobs": 0}, "logprobs"),
    ({**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]}]}, "multimodal"),
])
def test_requests_it_cannot_continue_exactly_are_not_armed(started, tmp_path, body, reason):
    """Refused up front: the decode is not asked for token ids, and the broken stream ends with the
    error event, never with a continuation that mixes choices or drops logprobs or images."""
    d, url, trace_file, _ = rig(started, tmp_path, "--migrate-mid-stream")
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    chunks = ([chat_event({"role": "assistant", "content": ""}, first=True)]
              + [chat_event({"content": w}, [200 + i]) for i, w in enumerate(["one", " two"])]) if "messages" in body \
        else [text_event("a", [7], first=True, index=0), text_event("b", [8], index=1), text_event(" two", [9])]
    d.script(broken_after(chunks), {"chunks": REST})
    r, rid = post(url, body, path)
    assert_sse_error_end(r, "stream_broken")
    (only,) = d.journal()
    assert "return_token_ids" not in only["body"]
    assert ineligible(trace_file, rid) == reason


def test_reasoning_deltas_are_not_continued_as_content(started, tmp_path):
    """A chat stream whose tokens so far were reasoning: a completions continuation has no reasoning
    parser and would send them again as content. Not continued; the client saw the reasoning once."""
    d, url, trace_file, _ = rig(started, tmp_path, "--migrate-mid-stream")
    chunks = [chat_event({"role": "assistant", "content": ""}, first=True),
              chat_event({"reasoning_content": "Let me"}, [200]), chat_event({"reasoning_content": " think"}, [201])]
    d.script(broken_after(chunks), {"chunks": [text_event("Let me think", [300]), text_event("", [], finish="stop"),
                                               DONE]})
    r, rid = post(url, CHAT, "/v1/chat/completions")
    assert_sse_error_end(r, "stream_broken")
    assert "Let me think" not in r.text and r.text.count("Let me") == 1
    assert len(d.journal()) == 1
    assert ineligible(trace_file, rid) == "reasoning"


def test_max_completion_tokens_null_leaves_max_tokens_the_limit(started, tmp_path):
    """vLLM reads `max_completion_tokens or max_tokens`: with the first null, the continuation gets
    max_tokens minus what was delivered, not the rest of the context."""
    d, url, trace_file, _ = rig(started, tmp_path, "--migrate-mid-stream")
    chunks = [chat_event({"role": "assistant", "content": ""}, first=True),
              chat_event({"content": "one"}, [200]), chat_event({"content": " two"}, [201])]
    d.script(broken_after(chunks), {"chunks": REST})
    body = {**CHAT, "max_tokens": 6, "max_completion_tokens": None}
    r, rid = post(url, body, "/v1/chat/completions")
    assert r.status_code == 200 and sse_events(r.text)[-1] == "data: [DONE]" and '"error"' not in r.text
    assert "".join(c["delta"].get("content") or "" for ch in data_events(r) for c in ch["choices"]) == \
        "one two four five"
    first, continuation = d.journal()
    assert continuation["body"]["max_tokens"] == 4 and continuation["body"]["prompt"] == PROMPT_IDS + [200, 201]


JUNK = text_event(" after the end", [999])


@pytest.mark.parametrize("ending, armed", [
    ([text_event("", [], finish="length"), DONE], True),  # finished, [DONE], then the connection breaks
    ([DONE], True),  # [DONE] without a finish reason
    ([DONE, JUNK], True),  # and an event after it
    ([DONE + JUNK], True),  # in the same write
    ([DONE + JUNK], False),  # a stream not armed for migration (sampled)
])
def test_a_stream_that_breaks_after_done_was_delivered_whole(started, tmp_path, ending, armed):
    """The stream ends at [DONE]: nothing after it reaches the client, a connection that breaks after
    it is no failure, and nothing is continued (old: a continuation after [DONE], two [DONE]s)."""
    d, url, trace_file, _ = rig(started, tmp_path, "--migrate-mid-stream")
    d.script(broken_after(WORDS + ending), {"chunks": REST})
    c = Counters(url)
    r, rid = post(url, GREEDY if armed else {**GREEDY, "temperature": 1})
    events = sse_events(r.text)
    assert r.status_code == 200 and events.count("data: [DONE]") == 1 and events[-1] == "data: [DONE]", r.text
    assert '"error"' not in r.text and "after the end" not in r.text and "four" not in r.text
    assert len(d.journal()) == 1
    assert c.requests(200) == 1 and attrs(trace_of(trace_file, rid)["root"]).get("pd.migrations", 0) == 0


@pytest.mark.parametrize("chunks, prompt", [
    # 10 one-character events carrying 20,000 ids each (old: a 200,003-id continuation prompt)
    ([text_event("x", list(range(20_000)), first=i == 0) for i in range(10)], None),
    # more ids than max_tokens allows
    ([text_event("x", list(range(8)), first=True), text_event("y", list(range(8)))], None),
    # usage that does not add up with the ids
    ([text_event("x", [200], first=True), event({"id": "cmpl-up", "choices": [
        {"index": 0, "text": "y", "token_ids": [201], "finish_reason": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})], None),
    # a prompt that is not the one the client sent as ids
    ([text_event("x", [200], first=True), text_event("y", [201])], [5, 6, 7]),
])
def test_token_ids_that_do_not_add_up_are_not_continued(started, tmp_path, chunks, prompt):
    """The ids come from the instance: checked against what was delivered before a continuation is
    built from them (bounded per event and by the request, equal to usage and to the client's prompt)."""
    d, url, trace_file, _ = rig(started, tmp_path, "--migrate-mid-stream")
    d.script(broken_after(chunks), {"chunks": REST})
    r, rid = post(url, {**GREEDY, "prompt": prompt} if prompt else GREEDY)
    assert_sse_error_end(r, "stream_broken")
    assert len(d.journal()) == 1
    assert ineligible(trace_file, rid) == "token_ids"


def test_an_event_that_never_ends_mid_stream_is_cut_off(started, tmp_path):
    """After three tokens the decode sends one event that never ends (no blank line): past 16 MiB the
    stream ends with an error event instead of the proxy holding all of it (scanner, tap and writer)."""
    d, url, trace_file, proxy = rig(started, tmp_path, "--migrate-mid-stream")
    endless = 'data: {"id":"cmpl-up","choices":[{"index":0,"text":"' + "x" * (1 << 16)
    d.script({"chunks": WORDS + [endless], "flood": ["x" * (1 << 16), 1600], "chunk_delay": 0})  # 100 MiB
    with PeakRss(proxy.popen.pid) as rss:
        r, rid = post(url, GREEDY, timeout=20)
    assert_sse_error_end(r, "malformed_stream")
    assert rss.growth < 80 * 1024 * 1024, rss.growth
    assert len(d.journal()) == 1  # a malformed stream is not continued


def test_nothing_after_done_reaches_the_client_when_the_whole_answer_comes_at_once(started, tmp_path):
    """The first token, the finish, [DONE] and an event after it in one write (the read that commits
    the answer): the client's stream still ends at [DONE]."""
    d, url, trace_file, _ = rig(started, tmp_path)
    d.script({"chunks": ["".join(WORDS) + text_event("", [], finish="length") + DONE + JUNK]})
    r, rid = post(url, {**GREEDY, "temperature": 1})
    events = sse_events(r.text)
    assert r.status_code == 200 and events[-1] == "data: [DONE]" and "after the end" not in r.text, r.text
