"""vLLM's P/D wire protocol: what a client may send, and what each leg receives.

See docs/reference/protocol.md (which summarises the research notes on vLLM's proxies): the prefill leg is the
client's body made to stop after one token and to keep its KV for a decode instance; the decode
leg is the client's original body plus the prefill's `kv_transfer_params`, verbatim.
"""

from __future__ import annotations

import codecs
import random
import re
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from pdproxy import jsonio
from pdproxy.errors import ProxyError, bad_request

# The NIXL pull connector's request to a prefill instance; vLLM's own proxies send all six fields.
NIXL_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces: safe in logs and vLLM ids
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?")


@dataclass(frozen=True)
class Route:
    path: str
    name: str  # metric label
    operation: str  # gen_ai.operation.name
    chat: bool


COMPLETIONS = Route("/v1/completions", "completions", "text_completion", chat=False)
CHAT = Route("/v1/chat/completions", "chat_completions", "chat", chat=True)


def request_id(headers: Any) -> str:
    """The client's `X-Request-Id` when it is usable, else a fresh uuid4 (vLLM's toy proxy's choice)."""
    given = headers.get("X-Request-Id")
    if given is None:
        return new_uuid4()
    if not _REQUEST_ID.fullmatch(given):
        raise bad_request("X-Request-Id must be 1-256 printable ASCII characters without spaces", param="X-Request-Id")
    return given


def new_uuid4() -> str:
    """A random (version 4) UUID string, as `str(uuid.uuid4())` but without its object and system call:
    an id, not a secret (the same generator as the trace ids; reseeded in each forked worker)."""
    n = random.getrandbits(128) & _UUID4_CLEAR | _UUID4_SET
    h = f"{n:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))  # version nibble, variant bits
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)  # version 4, RFC 4122 variant


def check_body_encoding(headers: Any) -> None:
    """vLLM takes no compressed request bodies, and a proxy that inflates one lets a 1 MB gzip body
    cost a gigabyte: a `Content-Encoding` other than identity is refused (415) from the head alone.
    The body is never inflated anywhere (pdproxy/listener.py turns aiohttp's decompression off)."""
    value = headers.get("Content-Encoding")
    if value is not None and {c.strip().lower() for c in value.split(",")} - {"identity", ""}:
        raise ProxyError(415, "compressed request bodies are not accepted (Content-Encoding); send plain JSON",
                         error_type="unsupported_encoding", param="Content-Encoding")


def valid_traceparent(headers: Any) -> bool:
    """Whether a W3C `traceparent` the client sent is well formed. An invalid one is ignored, as
    Trace Context asks (with its `tracestate`): the request starts a new trace and is counted."""
    value = headers.get("traceparent")
    if value is None:
        return True
    value = value.strip()
    match = _TRACEPARENT.fullmatch(value)
    return not (not match or value.startswith("ff") or set(value[3:35]) == {"0"} or set(value[36:52]) == {"0"}
                or (value.startswith("00") and match.group(1)))


def validate(body: Any, route: Route, client_kv_params: str = "reject") -> dict[str, Any]:
    """Check the fields the proxy relies on; everything else is the instance's business."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if route.chat:
        messages = body.get("messages")
        # (every message's type looked at by C calls alone: a chat of millions of `{}` is checked in milliseconds)
        if not isinstance(messages, list) or not messages or not all(map(isinstance, messages, repeat(dict))):
            raise bad_request("'messages' must be a non-empty list of message objects", param="messages")
    else:
        if not _valid_prompt(body.get("prompt")):
            raise bad_request("'prompt' must be a string, a list of strings, or token ids", param="prompt")
    _typed(body, "model", str)
    _typed(body, "stream", bool)
    for key in ("max_tokens", "max_completion_tokens", "min_tokens", "min_completion_tokens", "n"):
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise bad_request(f"'{key}' must be a non-negative integer", param=key)
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    if "kv_transfer_params" in body:
        if client_kv_params == "reject":
            raise bad_request("kv_transfer_params is set by the proxy, not by clients", param="kv_transfer_params")
        body = {k: v for k, v in body.items() if k != "kv_transfer_params"}  # "strip": never forwarded
    if _xargs_kv_params(body):
        # vLLM copies vllm_xargs into the request's extra_args, where its KV connector reads
        # "kv_transfer_params" when the top-level field does not override it (docs/reference/protocol.md)
        if client_kv_params == "reject":
            raise bad_request("vllm_xargs.kv_transfer_params is set by the proxy, not by clients",
                              param="vllm_xargs")
        xargs = {k: v for k, v in body["vllm_xargs"].items() if k != "kv_transfer_params"}
        body = {**body, "vllm_xargs": xargs}
    return body


def _xargs_kv_params(body: dict[str, Any]) -> bool:
    """Whether the body's `vllm_xargs` holds `kv_transfer_params` (however the key was spelt)."""
    xargs = body.get("vllm_xargs")
    return isinstance(xargs, dict) and "kv_transfer_params" in xargs


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, no stream, and the KV kept for a remote decode."""
    leg = dict(body)
    leg["kv_transfer_params"] = dict(NIXL_PREFILL_PARAMS)
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    # vLLM rejects min > max. min_tokens=1 (as vllm-router forces it) also stops the prefill from
    # sampling EOS first: it then finishes length-capped, the state in which every connector offers its KV
    leg["min_tokens"] = 1
    if leg.get("min_completion_tokens") is not None:
        leg["min_completion_tokens"] = min(leg["min_completion_tokens"], 1)
    return leg


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the client's body untouched, plus the prefill's KV coordinates when it gave any."""
    if kv_transfer_params is None:
        return body
    return {**body, "kv_transfer_params": kv_transfer_params}


def decode_payload(body: dict[str, Any], raw: bytes | None, kv_transfer_params: dict[str, Any] | None) -> bytes:
    """The decode leg's bytes. From the client's own bytes when they may go as they are (`raw`, see
    `parse_body`): unchanged, or with the prefill's `kv_transfer_params` spliced in before the closing
    brace. The body is then never serialised again; otherwise `decode_body`'s dict is."""
    if raw is None:
        return jsonio.dumps(decode_body(body, kv_transfer_params))
    if kv_transfer_params is None:
        return raw
    end = raw.rindex(b"}")  # a JSON object's last non-blank byte; never `{}` (prompt or messages is required)
    return b"".join((raw[:end], b',"kv_transfer_params":', jsonio.dumps(kv_transfer_params), raw[end:]))


def parse_body(raw: bytes) -> tuple[Any, bytes | None]:
    """A request body's JSON value, and `raw` when the decode leg may get those bytes as they are.

    The encoding rule is explicit, and the same as vLLM's (its server hands the bytes to `json.loads`,
    which reads UTF-8, UTF-16 and UTF-32, with or without a BOM): a body with neither a NUL byte nor
    a UTF-8 BOM is read as strict UTF-8; any other as `json.loads` detects it. Only the first kind
    may be forwarded raw: UTF-16/32 bytes (BOM-less UTF-16-LE starts `{\\x00`) would not survive
    a splice. And a body whose parsed object holds `kv_transfer_params`, at its top or in its
    `vllm_xargs`, however the key is spelt (`"kv\\u005ftransfer_params"` decodes to it), is never
    forwarded raw: the decode gets the re-serialised, checked object, so no client coordinates can
    reach it. Numbers are read as `jsonio.loads_exact` reads them, so the legs mean what the client sent
    (by orjson when it reads the body the same way, `jsonio.loads_if_exact`).
    """
    plain = 0 not in raw and not raw.startswith(codecs.BOM_UTF8)  # no NUL byte (an int needle: see stream.CR)
    body = jsonio.loads_if_exact(raw) if plain else jsonio.NOT_READ
    if body is jsonio.NOT_READ:
        try:
            body = jsonio.loads_exact(raw.decode("utf-8") if plain else raw)
        except ValueError as exc:  # UnicodeDecodeError and nesting too deep are ValueErrors
            raise bad_request(f"request body is not valid JSON ({type(exc).__name__}: {str(exc)[:100]})") from None
    forward = plain and isinstance(body, dict) and "kv_transfer_params" not in body and not _xargs_kv_params(body)
    return body, raw if forward else None


def _typed(body: dict[str, Any], key: str, kind: type) -> None:
    if body.get(key) is not None and not isinstance(body[key], kind):
        raise bad_request(f"'{key}' must be a {kind.__name__}", param=key)


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(p, str) for p in prompt):
        return True
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return True
    return all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt)
