"""JSON on the hot path: orjson, with the standard library for what orjson reads or writes differently.

orjson reads standard JSON several times faster than `json`. What it refuses but `json` reads
(NaN and Infinity, lone surrogates, nesting past its depth limit) goes to `json.loads`, so the
proxy accepts what it did with the standard library and rejects the same invalid JSON (orjson also
reads nesting deeper than `json`'s recursion limit, where `json` raised RecursionError, which is
no ValueError: an answer nested that deep is now read, not an escaped exception). Used for what the
instances send (prefill answers, stream events); integers past 64 bits, which orjson reads as
floats, do not occur in them (token counts and ids, block ids, ports).

Writing: the legs' bodies are built from client bodies the standard library read (`protocol.parse_body`).
orjson writes them as `json.dumps` would, in compact form with UTF-8 rather than `\\u` escapes,
except what it refuses: integers past 64 bits, lone surrogates, and the NaN and Infinity a client may
send, which `parse_body` reads as `Constant` (orjson would write a float NaN as `null`). Those
bodies are written by `json.dumps`, as before.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


class Constant(float):
    """NaN, Infinity or -Infinity as read from a client's body: a float that orjson will not write."""


def loads(data: bytes | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data, parse_constant=Constant)


def dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj).encode()
