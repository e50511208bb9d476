"""JSON on the hot path: orjson where it reads and writes as the standard library does, `json` elsewhere.

Two readers, for two uses:

* `loads_exact`, for what is passed on (a client's body, a prefill's answer, whose
  `kv_transfer_params` the decode gets verbatim): the standard library's reading, so every integer
  stays exact (orjson reads integers past 64 bits as floats: a 128-bit id would reach the decode as
  `3.402823669209385e+38`), and a number too large for a float (`1e999`) or a NaN/Infinity literal
  is read as a `Constant`, which `dumps` writes again as `json.dumps` would (`Infinity`, not
  orjson's `null`). `loads_if_exact` reads such JSON by orjson when that is the same reading
  (most bodies and answers: no integer past 64 bits, no NaN, shallow nesting).
* `loads`, for what is only looked at (stream events, usage): orjson, several times faster.
  What it refuses but `json` reads (NaN and Infinity, lone surrogates, nesting past its depth
  limit) goes to `loads_exact`, so the same JSON is accepted and the same is refused.

Both raise `ValueError` for whatever they cannot read, nesting too deep included: `json` raises
RecursionError past ~1,000 levels, which is no ValueError and would escape every handler written
for invalid JSON. orjson's own depth limit depends on its version (3.8 reads thousands of levels,
3.13 refuses more than 1,024), so such input is read or refused as a ValueError, never anything else.

Writing: orjson writes a body as `json.dumps` would, in compact form with UTF-8 rather than `\\u`
escapes, except what it refuses: integers past 64 bits, lone surrogates and `Constant`s (a float
subclass, which orjson does not take). Those bodies are written by `json.dumps`, as before orjson.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
from mypy_extensions import mypyc_attr


@mypyc_attr(native_class=False)  # compiled, a class derived from float is a plain Python class
class Constant(float):
    """NaN or ±Infinity as read from JSON (the literals, or a number past a float's range such as
    `1e999`): a float that orjson will not write, so that `dumps` writes it as `json.dumps` does."""


def _number(text: str) -> Any:
    # Returns of type Any, and no `a if c else Constant(a)`: compiled, a value typed float is unboxed, and boxed
    # again as a plain float, dropping the Constant
    value = float(text)
    if math.isfinite(value):
        return value
    return Constant(value)


_EXACT = json.JSONDecoder(parse_constant=Constant, parse_float=_number)  # json.loads(..., hooks) builds one a call


def loads_exact(data: bytes | str) -> Any:
    """JSON as `json.loads` reads it (UTF-8, -16 or -32 bytes; exact integers); ValueError for
    anything it cannot read, nesting too deep included."""
    if isinstance(data, (bytes, bytearray)):
        data = data.decode(json.detect_encoding(data), "surrogatepass")  # as json.loads does
    elif data.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", data, 0)
    try:
        return _EXACT.decode(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def loads(data: bytes | str) -> Any:
    """JSON that is only looked at, fast: as `loads_exact` reads it, but integers past 64 bits are floats."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return loads_exact(data)


def dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj).encode()


NOT_READ = object()  # `loads_if_exact`: orjson's reading is not the exact reader's, or orjson refused the JSON
FAST_DEPTH = 64  # containers nested at most this deep: far within the exact reader's recursion limit
# JSON longer than this goes to the exact reader: proving orjson's reading exact walks every value it read, which
# for a body of small containers costs several times the parse itself (8 MB of `{},` is 2.7 million dicts: ~3 s
# of walk on a ~0.5 s parse, the event loop held throughout), and at this size the exact reader is no slower
# than orjson on what dominates a big body (a long string, token ids)
FAST_MAX_BYTES = 64 << 10
_INT64 = float(2 ** 63)  # orjson reads an integer outside [-2**63, 2**64) as a float at least this large


def loads_if_exact(data: bytes) -> Any:
    """UTF-8 JSON as orjson reads it (~5x faster), when that is how `loads_exact` reads it; NOT_READ otherwise.
    orjson refuses what the exact reader reads differently (NaN, Infinity, `1e999`, lone surrogates) and
    reads a float as `float()` does, but an integer past 64 bits as a float: a float that large, or
    nesting deeper than FAST_DEPTH (the exact reader may refuse it), sends the JSON to the exact reader.
    So does JSON longer than FAST_MAX_BYTES, whose walk would cost more than the exact reading."""
    if len(data) > FAST_MAX_BYTES:
        return NOT_READ
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return NOT_READ
    return value if _as_exact(value, FAST_DEPTH) else NOT_READ


def _as_exact(value: Any, depth: int) -> bool:
    """Whether `value`, as orjson read it, is what the exact reader reads (see `loads_if_exact`). (A list
    walked natively: compiled, a generic iteration and a tuple isinstance cost twice as much.)"""
    if isinstance(value, float):
        return -_INT64 < value < _INT64
    if isinstance(value, dict):
        items: list[Any] = list(value.values())
    elif isinstance(value, list):
        items = value
    else:
        return True
    if depth <= 0:
        return False
    for item in items:  # the scalars looked at here: a call each cost more than the look
        if isinstance(item, float):
            if not -_INT64 < item < _INT64:
                return False
        elif (isinstance(item, dict) or isinstance(item, list)) and not _as_exact(item, depth - 1):
            return False
    return True
