"""The scanner's byte-level fast path must learn exactly what a full JSON parse of every event learns."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.stream import ResponseScan

TEXTS = st.one_of(st.just(""), st.text(max_size=12),
                  st.sampled_from(['"', '\\', '": ', '"text":"', '"finish_reason":"x"', "data: {", "\n", "}"]))


def compact(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@st.composite
def event(draw, chat: bool, index: int, usage_each: bool, spaced: bool):
    """One SSE event in vLLM's shape (compact JSON), with the variations a stream may carry."""
    text = draw(TEXTS)
    finish = draw(st.sampled_from([None, None, None, "length", "stop"]))
    if chat:
        delta = draw(st.sampled_from([{"content": text}, {"content": text}, {}, {"role": "assistant", "content": ""},
                                      {"reasoning_content": text}, {"content": None}]))
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    choices = draw(st.sampled_from([[choice], [choice], [choice], [choice, choice], []]))
    obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": choices}
    if usage_each:
        obj["usage"] = {"prompt_tokens": 3, "total_tokens": 3 + index, "completion_tokens": index}
    elif draw(st.booleans()):
        obj["usage"] = None
    if draw(st.integers(0, 30)) == 0:
        obj = {"error": {"message": "boom", "type": "x", "code": 500}}
    body = json.dumps(obj) if spaced else compact(obj)
    return "data: " + body + "\n\n"


@st.composite
def stream(draw):
    chat = draw(st.booleans())
    usage_each = draw(st.booleans())
    spaced = draw(st.integers(0, 5)) == 0
    n = draw(st.integers(0, 40))
    events = [draw(event(chat, i + 1, usage_each, spaced)) for i in range(n)]
    if draw(st.booleans()):
        events.append("data: " + compact({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 3,
                                                                                  "completion_tokens": n}}) + "\n\n")
    extras = draw(st.lists(st.sampled_from([": keep-alive\n\n", "data: not json\n\n", "event: x\ndata: {}\n\n"]),
                           max_size=2))
    for extra in extras:
        events.insert(draw(st.integers(0, len(events))), extra)
    if draw(st.booleans()):
        events.append("data: [DONE]\n\n")
    raw = "".join(events).encode()
    if draw(st.integers(0, 4)) == 0:
        raw = raw.replace(b"\n", b"\r\n")
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    return chat, raw, cuts


def learned(scan: ResponseScan) -> dict:
    return {"times": scan.chunk_times, "tokens": scan.chunk_tokens, "id": scan.response_id,
            "finish": scan.finish_reasons, "usage": scan.usage, "error": scan.error, "done": scan.done,
            "metrics": scan.server_metrics}


@settings(max_examples=400, deadline=None)
@given(stream())
def test_fast_path_learns_what_the_full_parse_learns(case):
    chat, raw, cuts = case
    fast, reference = ResponseScan(chat), ResponseScan(chat, fast=False)
    bounds = [0, *cuts, len(raw)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):  # each read arrives at its own instant
        fast.feed(raw[a:b], i)
        reference.feed(raw[a:b], i)
    assert learned(fast) == learned(reference)


def test_a_read_of_many_plain_events_is_counted_without_parsing(monkeypatch):
    head = 'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"'

    def events(*texts: str) -> bytes:
        return "".join(head + f'{t}","logprobs":null,"finish_reason":null,"stop_reason":null}}]}}\n\n'
                       for t in texts).encode()

    scan = ResponseScan(chat=False)
    scan.feed(events("a"), 1)  # the stream's id
    scan.feed(events("b"), 2)  # the shape of its plain events
    calls = []
    monkeypatch.setattr("pdproxy.stream.jsonio.loads", lambda *a, **k: calls.append(a))
    texts = ["c", ""] + [chr(ord("d") + i) for i in range(8)]
    scan.feed(events(*texts), 3)
    assert calls == []
    assert scan.chunk_times == [1, 2] + [3] * (len(texts) - 1) and scan.chunk_tokens == [0] * (len(texts) + 1)


def test_key_counts_of_two_unusual_events_cannot_pass_for_plain_ones():
    plain = ('data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
             '"text":"","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n')
    two_choices = plain.replace("}]}", '},{"index":0,"text":"","logprobs":null,"finish_reason":null,'
                                       '"stop_reason":null}],"usage":null}')
    error = 'data: {"error":{"message":"boom","type":"x","code":500}}\n\n'
    fast, reference = ResponseScan(chat=False), ResponseScan(chat=False, fast=False)
    for scan in (fast, reference):
        scan.feed((plain + plain + two_choices + error).encode(), 1)
    assert learned(fast) == learned(reference) and fast.error == {"message": "boom", "type": "x", "code": 500}


# a plain event's bytes before and after its text, completions (False) and chat (True)
AROUND_TEXT = {
    False: (b'data: {"id":"c-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"',
            b'","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'),
    True: (b'data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
           b'"delta":{"content":"', b'"},"logprobs":null,"finish_reason":null}]}\n\n'),
}


def test_plain_events_after_the_adopted_one_are_read_without_a_parse(monkeypatch):
    """Single events of the adopted head and tail (a stream read event by event) cost no parse."""
    for chat, (head, tail) in AROUND_TEXT.items():
        scan = ResponseScan(chat)
        scan.feed(head + b"a" + tail, 1)  # the stream's id
        scan.feed(head + b"b" + tail, 2)  # adopted
        calls = []
        monkeypatch.setattr("pdproxy.stream.jsonio.loads", lambda *a, **k: calls.append(a))
        for i, text in enumerate(["c", "", "\\n\\u00e9\\\\", "é"]):
            scan.feed(head + text.encode() + tail, 3 + i)
        monkeypatch.undo()
        assert calls == []
        assert scan.chunk_times == [1, 2, 3, 5, 6] and scan.chunk_tokens == [0] * 5


# texts between an adopted head and tail that are not a JSON string's content: each must be read as the parse reads it
BROKEN_TEXTS = [b"a\x01b", b"a\nb", b"\\q", b"tail\\", b"\\u12", b'x"y', b'x","finish_reason":"stop', b"\xff\xfe",
                b"\xed\xa0\x80", b"\\ud800", b"\\\\", b"\\/", b"\x7f"]


def test_texts_the_parse_refuses_or_reads_otherwise_are_not_taken_for_plain_ones():
    for chat, (head, tail) in AROUND_TEXT.items():
        for text in BROKEN_TEXTS:
            fast, reference = ResponseScan(chat), ResponseScan(chat, fast=False)
            for scan in (fast, reference):
                for i, t in enumerate([b"a", b"b", text, b"c"]):
                    scan.feed(head + t + tail, i)
            assert learned(fast) == learned(reference) and fast.malformed == reference.malformed, text


def test_an_event_with_more_than_its_text_to_say_is_not_adopted():
    """Reasoning or tool calls beside the content: later events of the same bytes are read as the parse reads them."""
    head = b'data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{'
    for second in (b'"reasoning_content":"r","content":"b"},"finish_reason":null}]}',
                   b'"content":"b","tool_calls":[{"id":"t"}]},"finish_reason":null}]}'):
        events = [head + b'"content":"a"},"finish_reason":null}]}', head + second, head + second.replace(b'"b"', b'""')]
        fast, reference = ResponseScan(True), ResponseScan(True, fast=False)
        for scan in (fast, reference):
            for i, e in enumerate(events):
                scan.feed(e + b"\n\n", i)
        assert learned(fast) == learned(reference) and len(fast.chunk_times) == 3


def test_only_the_choices_own_text_is_left_open_between_head_and_tail():
    """The first `"text":"` of an event may be another object's: the second parse rules it out as the text."""
    event = 'data: {{"id":"c-1","meta":{{"text":"{}"}},"choices":[{{"index":0,"text":"x","finish_reason":null}}]}}\n\n'
    fast, reference = ResponseScan(False), ResponseScan(False, fast=False)
    for scan in (fast, reference):
        for i, meta in enumerate(["x", "x", "", "y"]):
            scan.feed(event.format(meta).encode(), i)
    assert learned(fast) == learned(reference) and fast.chunk_times == [0, 1, 2, 3]


def test_a_completions_stream_is_read_without_a_parse_from_its_second_event(monkeypatch):
    head, tail = AROUND_TEXT[False]
    scan = ResponseScan(chat=False)
    scan.feed(head + b"a" + tail, 1)  # the stream's id, and its head and tail
    calls = []
    monkeypatch.setattr("pdproxy.stream.jsonio.loads", lambda *a, **k: calls.append(a))
    scan.feed(head + b"b" + tail, 2)
    monkeypatch.undo()
    assert calls == [] and scan.response_id == "c-1" and scan.chunk_times == [1, 2]
