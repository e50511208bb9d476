"""`stream.through_done` cuts a read after its first `[DONE]` event; its shortcut for the usual read
([DONE] last, and only once) gives what the event-by-event reading gives."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pdproxy.stream import through_done

PARTS = [b'data: {"a":1}\n\n', b"data: [DONE]\n\n", b"data: [DONE] \n\n", b"data:[DONE]\n\n", b": c\n\n",
         b"data: x[DONE]\n\n", b"\n\n", b"\n", b"data: [DONE]", b"event: e\ndata: [DONE]\n\n", b"x", b"\r\n"]


def event_by_event(data: bytes) -> bytes:
    """The reading through_done gives every read that is not the usual one."""
    if b"\r" in data:
        return data
    events = data.split(b"\n\n")
    for i, event in enumerate(events[:-1]):
        if any(line[5:].strip() == b"[DONE]" for line in event.split(b"\n") if line.startswith(b"data:")):
            return b"\n\n".join(events[:i + 1]) + b"\n\n"
    return data


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(PARTS), max_size=8))
def test_the_shortcut_cuts_where_reading_event_by_event_does(parts):
    data = b"".join(parts)
    assert through_done(data) == event_by_event(data)


def test_nothing_after_the_first_done_reaches_the_client():
    assert through_done(b'data: {"a":1}\n\ndata: [DONE]\n\n') == b'data: {"a":1}\n\ndata: [DONE]\n\n'
    assert through_done(b"data: [DONE]\n\ndata: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert through_done(b"data: [DONE]\n\ndata: {}\n\n") == b"data: [DONE]\n\n"
