"""pdproxy.jsonio reads what the instances send exactly as the standard library does."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from pdproxy import jsonio
from pdproxy.protocol import parse_body

scalars = st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 63 - 1) | st.floats() | st.text()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                      max_leaves=20)


def same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN compares equal as text


@settings(max_examples=300, deadline=None)
@given(values, st.booleans())
def test_reads_what_json_reads(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)  # NaN and Infinity included: json writes them
    assert same(jsonio.loads(text.encode()), json.loads(text))


@pytest.mark.parametrize("text", ['{"a":NaN}', '[-Infinity]', '{"s":"\\ud800"}',
                                  '{"a":1,"a":2}', '"\\u00e9"'])
def test_what_orjson_refuses_goes_to_json(text):
    try:
        expected = json.loads(text)
    except (ValueError, RecursionError) as exc:
        with pytest.raises(type(exc)):
            jsonio.loads(text.encode())
        return
    assert same(jsonio.loads(text.encode()), expected)


@pytest.mark.parametrize("text", ["", "{", '{"a":}', "nul", '{"a":1}x'])
def test_invalid_json_is_a_value_error(text):
    with pytest.raises(ValueError):
        jsonio.loads(text.encode())


def test_deep_nesting_is_read_not_a_recursion_error():
    # json.loads raises RecursionError past ~1000 levels, which is no ValueError: an instance's event
    # nested that deep would have escaped the scanner's error handling; orjson reads it
    value, depth = jsonio.loads(b"[" * 5000 + b"]" * 5000), 1
    while value:
        (value,), depth = value, depth + 1
    assert value == [] and depth == 5000


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(), values, max_size=6) | st.dictionaries(st.text(), st.integers(), max_size=3))
def test_a_body_is_written_as_json_dumps_writes_it(body):
    # what the legs get: the client's body as parse_body read it, written again
    read, _ = parse_body(json.dumps(body).encode())
    assert same(json.loads(jsonio.dumps(read)), json.loads(json.dumps(read)))


@pytest.mark.parametrize("body", [{"temperature": float("nan")}, {"x": [float("inf"), -float("inf")]},
                                  {"seed": 2 ** 70}, {"s": "\ud800"}])
def test_what_orjson_would_write_differently_goes_to_json(body):
    read, _ = parse_body(json.dumps(body).encode())
    assert jsonio.dumps(read) == json.dumps(read).encode()
