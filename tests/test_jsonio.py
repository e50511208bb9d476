"""pdproxy.jsonio reads what the instances send exactly as the standard library does."""

from __future__ import annotations

import json
import math

import orjson
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


@settings(max_examples=200, deadline=None)
@given(values, st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32-be"]))
def test_the_exact_reader_reads_what_json_reads_in_every_encoding(value, encoding):
    data = json.dumps(value).encode(encoding)
    assert same(jsonio.loads_exact(data), json.loads(data))


def test_the_exact_reader_refuses_what_json_refuses():
    for data in ("\ufeff{}", b"\xff{}", '{"a": 1', "[1,]"):
        with pytest.raises(ValueError):
            json.loads(data)
        with pytest.raises(ValueError):
            jsonio.loads_exact(data)


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


DEEP = 5000  # levels: past json's recursion limit (~1,000) and orjson 3.13's (1,024)


def depth_of(value) -> int:
    depth = 1
    while value:
        (value,), depth = value, depth + 1
    return depth


def strict_orjson(data):
    """orjson 3.13 and later: nesting past 1,024 levels is a JSONDecodeError (3.8 reads it)."""
    raise orjson.JSONDecodeError("Recursion limit reached", data.decode(), 0)


@pytest.mark.parametrize("refuses", [False, True], ids=["installed orjson", "orjson refusing the depth"])
def test_deep_nesting_is_read_or_a_value_error_never_a_recursion_error(monkeypatch, refuses):
    # json.loads raises RecursionError past ~1,000 levels, which is no ValueError: an instance's event
    # nested that deep escaped the scanner's error handling once orjson handed it to json (orjson
    # refusing the depth, as 3.13 does, or anything else inside it, such as NaN)
    if refuses:
        monkeypatch.setattr(jsonio.orjson, "loads", strict_orjson)
    plain, with_nan = b"[" * DEEP + b"]" * DEEP, b"[" * DEEP + b"NaN" + b"]" * DEEP
    try:
        value = jsonio.loads(plain)
    except ValueError:
        assert refuses or orjson_version() >= (3, 13), orjson.__version__
    else:
        assert not refuses and depth_of(value) == DEEP
    with pytest.raises(ValueError):  # NaN sends every orjson to json
        jsonio.loads(with_nan)
    for data in (plain, with_nan):  # the reader of what is passed on refuses it whatever orjson does
        with pytest.raises(ValueError):
            jsonio.loads_exact(data)


def orjson_version() -> tuple[int, ...]:
    return tuple(int(part) for part in orjson.__version__.split(".")[:2])


def test_numbers_are_written_as_the_client_wrote_them():
    # orjson writes float infinity (json reads 1e999 as that) as null, and reads a 128-bit integer as a float
    read, _ = parse_body(b'{"top_p": 1e999, "logit_bias": {"5": -1e999}, "x": [1.5, 1e308]}')
    assert json.loads(jsonio.dumps(read)) == {"top_p": math.inf, "logit_bias": {"5": -math.inf}, "x": [1.5, 1e308]}
    assert jsonio.dumps(read) == json.dumps(json.loads('{"top_p": 1e999, "logit_bias": {"5": -1e999}, '
                                                      '"x": [1.5, 1e308]}')).encode()  # as before orjson
    big = jsonio.loads_exact(b'{"id": %d}' % (2 ** 127 + 1))
    assert big == {"id": 2 ** 127 + 1} and jsonio.dumps(big) == b'{"id": %d}' % (2 ** 127 + 1)


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


def typed(value):
    """`value` with every number's type in it: 1 and 1.0 (and a Constant) differ."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, value if value == value else "nan")


def nested(depth: int) -> str:
    return '{"prompt":' + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "}"


TRICKY_BODIES = [
    '{"prompt":"x","seed":%d}' % n for n in (2 ** 63 - 1, 2 ** 63, -2 ** 63, -2 ** 63 - 1, 2 ** 64 - 1, 2 ** 64, 2 ** 70)
] + [
    '{"prompt":"x","t":%s}' % f for f in ("0.1", "1e20", "-1e20", "9.223372036854775807e18", "5e-324", "1e-400",
                                         "2.2250738585072011e-308", "1.7976931348623157e308", "1e999", "-0.0",
                                         "0.30000000000000004441", "123456789012345678901234567890.5", "NaN")
] + [
    '{"prompt":"\\ud800"}', '{"prompt":"\\u00e9\\ud83d\\ude00","a":1,"a":2.5}', '{"kv\\u005ftransfer_params":{}}',
    '{"vllm_xargs":{"kv_transfer_params":1}}', '{"prompt":[1,2],"x":[{"y":[1.5,{"z":2e400}]}]}', '[1]', 'null',
    nested(63), nested(64), nested(65), nested(1000), nested(1100), '{"prompt":"x"', '{"prompt":"x"} x',
]


@pytest.mark.parametrize("text", TRICKY_BODIES)
def test_the_fast_exact_reader_reads_what_the_exact_one_reads_or_leaves_it(text):
    raw = text.encode()
    fast = jsonio.loads_if_exact(raw)
    try:
        exact = jsonio.loads_exact(raw.decode())
    except ValueError:
        assert fast is jsonio.NOT_READ  # refused the same way: by the exact reader's error
        with pytest.raises(Exception, match="not valid JSON"):
            parse_body(raw)
        return
    if fast is jsonio.NOT_READ:
        return  # parse_body reads it by the exact reader (which, on 3.12, reads 1,000 levels: typed() would not)
    assert typed(fast) == typed(exact)
    assert not isinstance(exact, dict) or list(fast) == list(exact)  # the keys' order too
    assert typed(parse_body(raw)[0]) == typed(exact)


def test_the_fast_exact_reader_takes_plain_bodies_and_leaves_ambiguous_ones():
    plain = {"model": "m", "prompt": "p " * 300, "max_tokens": 8, "temperature": 0.7, "seed": 2 ** 63 - 1,
             "stream": True, "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "é"}]}
    assert jsonio.loads_if_exact(json.dumps(plain).encode()) == plain
    for text in ('{"seed":%d}' % 2 ** 64, '{"t":1e20}', '{"t":NaN}', '{"s":"\\ud800"}', nested(65)):
        assert jsonio.loads_if_exact(text.encode()) is jsonio.NOT_READ, text


def test_a_long_body_goes_to_the_exact_reader_without_a_walk():
    """Past FAST_MAX_BYTES the walk proving orjson's reading exact would cost several times the parse (a body
    of millions of `{}`, issue 54 item 8): such JSON is left to the exact reader, which reads it the same."""
    raw = b'{"messages":[' + b",".join([b"{}"] * (jsonio.FAST_MAX_BYTES // 3 + 1)) + b"]}"
    assert len(raw) > jsonio.FAST_MAX_BYTES
    assert jsonio.loads_if_exact(raw) is jsonio.NOT_READ
    assert parse_body(raw)[0] == jsonio.loads_exact(raw)
    short = b'{"messages":[' + b",".join([b"{}"] * ((jsonio.FAST_MAX_BYTES - 16) // 3)) + b"]}"
    assert len(short) <= jsonio.FAST_MAX_BYTES and jsonio.loads_if_exact(short) == jsonio.loads_exact(short)
