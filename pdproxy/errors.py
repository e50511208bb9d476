"""Errors the proxy answers with: OpenAI-style JSON bodies, or an SSE error event once streaming began.

Every failure a client can see is a `ProxyError`: it knows its HTTP status, which stage of the
P/D flow failed, and a short machine-readable `error_type` that also labels traces and metrics.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pdproxy import jsonio

# Stages a request passes through.
QUEUE, PREFILL, KV_TRANSFER, DECODE = "queue", "prefill", "kv_transfer", "decode"

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
}


def openai_type(status: int) -> str:
    return _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": openai_type(status), "param": param, "code": code}}


class ProxyError(Exception):
    """A request failure with everything needed to answer the client and to account for it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str,
        stage: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.stage = stage
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, code=self.error_type, param=self.param)

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        headers = dict(headers or {})
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        return web.json_response(self.body(), status=self.status, headers=headers)

    def sse_event(self) -> bytes:
        """The error as vLLM sends it inside a stream: one data event, then `[DONE]`."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\ndata: [DONE]\n\n"


class UpstreamResponse(Exception):
    """An instance's own error answer (a 4xx, or a 429/503 that retries did not get past), relayed
    with its status and Retry-After. Its body is passed on when it is already an OpenAI-style error
    object; anything else (an HTML page from a load balancer, plain text) is wrapped in one."""

    def __init__(self, status: int, body: bytes, content_type: str, *, stage: str, retry_after: str | None) -> None:
        super().__init__(f"{stage} instance answered {status}")
        self.message = str(self)
        self.status = status
        self.body = body
        self.content_type = content_type
        self.stage = stage
        self.retry_after = retry_after
        self.error_type = upstream_error_type(status)

    def response(self, headers: dict[str, str]) -> web.Response:
        headers = dict(headers)
        if self.retry_after:
            headers["Retry-After"] = self.retry_after
        if _is_openai_error(self.body):
            return web.Response(status=self.status, body=self.body, headers={**headers, "Content-Type": "application/json"})
        snippet = self.body[:200].decode("utf-8", "replace").strip() or "(empty body)"
        body = error_body(f"{self.message}: {snippet}", self.status, code=self.error_type)
        return web.json_response(body, status=self.status, headers=headers)

    def in_stream(self) -> ProxyError:
        """The same failure once the client already has its 200: it can only be told in an SSE error event."""
        return ProxyError(self.status, f"{self.message}: {instance_message(self.body)}",
                          error_type=self.error_type, stage=self.stage)


def upstream_error_type(status: int) -> str:
    """The `error_type` label of an instance's own error status."""
    if status == 429:
        return "upstream_429"
    if status == 503:
        return "upstream_503"
    return "upstream_4xx" if status < 500 else "upstream_5xx"


def instance_message(raw: bytes) -> str:
    """An instance's own error message, from its error body, for the client's error."""
    try:
        error = jsonio.loads(raw).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:300]
        if isinstance(error, str):
            return error[:300]
    except (ValueError, AttributeError, UnicodeDecodeError):
        pass
    return raw[:200].decode("utf-8", "replace") or "(empty body)"


def retry_after_seconds(value: str | None) -> float | None:
    """`Retry-After` as seconds; only the delta-seconds form (what vLLM and llmock send) is understood."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if 0 <= seconds < 86400 else None


def _is_openai_error(body: bytes) -> bool:
    try:
        obj = jsonio.loads(body)
    except ValueError:  # nesting too deep included (pdproxy/jsonio.py)
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), (dict, str))


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, error_type="invalid_request", param=param)
