"""The prefill's kv_transfer_params are read fast (orjson) only when that reads them exactly as the
standard library does: every answer the fast reader would change goes to the exact one
(pdproxy/legs.py, `kv_params`). The proxy-level checks (a 128-bit id reaching the decode verbatim,
answers nested too deep) are in tests/test_proxy_json.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from pdproxy import jsonio, legs
from pdproxy.errors import ProxyError
from pdproxy.pool import Instance

PREFILL = Instance("http://127.0.0.1:1", "prefill")
NIXL = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(range(2000)),
        "remote_engine_id": "e-1", "remote_host": "10.0.0.2", "remote_port": 5600, "tp_size": 1,
        "remote_request_id": "cmpl-1"}

# integers past 64 bits and floats (infinite and NaN included: json writes them) anywhere in the parameters
scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.integers() | st.floats()
           | st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner,
                                                                                            max_size=5),
                      max_leaves=30)


def answer(params, **extra) -> bytes:
    return json.dumps({"id": "cmpl-p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 1}, **extra,
                       "kv_transfer_params": params}).encode()


def exact(raw: bytes):
    """What the proxy sent before the fast reader: loads_exact's reading, or the error it led to."""
    try:
        return "ok", json.dumps(legs_exact(raw), sort_keys=True)  # a float where an int was shows as text
    except ProxyError as err:
        return "refused", err.error_type


def legs_exact(raw: bytes):
    params = jsonio.loads_exact(raw).get("kv_transfer_params")
    if params is None or params == {}:
        return None
    if not isinstance(params, dict):
        raise ProxyError(502, "malformed", error_type="invalid_kv_params")
    return params


def fast(raw: bytes):
    try:
        return "ok", json.dumps(legs.kv_params(raw, PREFILL), sort_keys=True)
    except ProxyError as err:
        return "refused", err.error_type


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.text(max_size=6), values, max_size=6) | values)
def test_the_parameters_read_are_the_exact_readers(params):
    raw = answer(params)
    assert fast(raw) == exact(raw)


@pytest.mark.parametrize("params", [
    {"remote_request_id": 2 ** 127 + 12345},  # orjson: 1.7014118346046923e+38
    {"remote_request_id": -(2 ** 63) - 1},
    {"ids": [1, 2, 2 ** 64]},  # in a list of integers
    {"deep": {"deeper": [{"id": 2 ** 65}]}},
    {"x": float("inf")},  # json writes Infinity: orjson refuses it
    {"x": float("nan")},
    {"x": 0.5},
    {"x": "\ud800"},  # a lone surrogate: orjson refuses it, json reads it
])
def test_answers_the_fast_reader_would_change_are_read_exactly(params):
    raw = answer(params)
    assert legs.read_fast(raw) is None
    assert fast(raw) == exact(raw)


def test_a_number_past_a_floats_range_stays_infinite_for_the_decode():
    raw = b'{"kv_transfer_params": {"x": 1e999, "y": -1e999}}'
    params = legs.kv_params(raw, PREFILL)
    assert jsonio.dumps(params) == b'{"x": Infinity, "y": -Infinity}'  # as json.dumps writes it, not orjson's null


def test_an_answer_nested_deeper_than_the_exact_reader_reads_is_refused_as_before():
    nested = "[" * 5000 + "]" * 5000  # orjson 3.8 reads it; the exact reader refuses it
    raw = ('{"choices": [], "kv_transfer_params": {"x": %s}}' % nested).encode()
    assert legs.read_fast(raw) is None
    with pytest.raises(ProxyError) as refused:
        legs.kv_params(raw, PREFILL)
    assert refused.value.error_type == "invalid_prefill_response"
    shallow = ('{"choices": [], "extra": %s, "kv_transfer_params": {"x": 1}}' % nested).encode()
    with pytest.raises(ProxyError):  # the parameters are fine, but not the answer: refused all the same
        legs.kv_params(shallow, PREFILL)


def test_a_usual_answer_is_read_by_the_fast_reader():
    for params in (NIXL, {"do_remote_decode": True, "remote_request_id": 2 ** 64 - 1}, None):
        raw = answer(params)
        assert legs.read_fast(raw) == jsonio.loads_exact(raw)


def test_broken_answers_are_refused_as_before():
    for raw, error in ((b"not json", "invalid_prefill_response"), (b"[1, 2]", "invalid_prefill_response"),
                       (answer([1, 2]), "invalid_kv_params"), (answer("x"), "invalid_kv_params"),
                       (b'{"kv_transfer_params": {"x": NaN}', "invalid_prefill_response")):
        assert fast(raw) == ("refused", error)
    assert legs.kv_params(answer(None), PREFILL) is None and legs.kv_params(answer({}), PREFILL) is None


def test_the_fast_reader_bounds_the_answers_depth_not_its_brackets():
    # 200 lists, four levels deep: read fast (a count of brackets sent it to the exact reader); 65 levels are not
    wide = answer({**NIXL, "remote_block_ids": [[i] for i in range(200)]})
    assert legs.read_fast(wide) == jsonio.loads_exact(wide)
    for depth, read_fast in ((62, True), (63, False)):  # lists in the answer's two objects: 64 and 65 levels
        raw = ('{"choices": [], "kv_transfer_params": {"x": %s}}' % ("[" * depth + "]" * depth)).encode()
        assert (legs.read_fast(raw) is not None) == read_fast, depth
        assert fast(raw) == exact(raw)
