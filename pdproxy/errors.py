"""Errors the proxy answers with: OpenAI-style JSON bodies, or an SSE error event once streaming began.

Every failure a client can see is a `ProxyError`: it knows its HTTP status, which stage of the
P/D flow failed, and a short machine-readable `error_type` that also labels traces and metrics.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pdproxy import jsonio

CLIENT_CLOSED = 499  # nginx's "client closed the request": a client that left before its answer
JSON = "application/json; charset=utf-8"  # what aiohttp's json_response says

# Stages a request passes through.
QUEUE, PREFILL, KV_TRANSFER, DECODE = "queue", "prefill", "kv_transfer", "decode"

# Failures the request (or its client) caused, not an instance: a bad or unauthorised request, one no
# instance can serve (refused by the proxy before its prefill, or by an instance with a 4xx other than
# 429: its "busy"), a client that went away or read too slowly. They page no one (the recording rule
# behind PdproxyStageErrorRatioHigh leaves them out) and give no hand-off up on the cluster's account.
CLIENT_CAUSED = frozenset({"client_disconnect", "client_too_slow", "invalid_request", "unauthorized", "body_too_large",
                           "body_timeout", "model_not_found", "context_length_exceeded", "upstream_4xx"})

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

    def reply(self, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        """The answer: status, JSON body and headers."""
        headers = {**headers, "Content-Type": JSON} if headers else {"Content-Type": JSON}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        return self.status, json.dumps(self.body()).encode(), headers

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return _response(self.reply(headers))

    def sse_event(self) -> bytes:
        """The error as vLLM sends it inside a stream: one data event, then `[DONE]`."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\ndata: [DONE]\n\n"


class VllmError(ProxyError):
    """A refusal in vLLM's own words and shape (`type`: its exception name, `code`: the status), for what the
    proxy refuses as vLLM would (pdproxy/served.py). Here beside ProxyError: compiled, a subclass must be too."""

    def __init__(self, status: int, message: str, vllm_type: str, param: str, *, error_type: str) -> None:
        super().__init__(status, message, error_type=error_type, param=param)
        self.vllm_type = vllm_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.vllm_type, "param": self.param, "code": self.status}}


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

    def reply(self, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        """The answer: the instance's status, its error body (or one made from what it sent), and headers."""
        headers = dict(headers)
        if self.retry_after:
            headers["Retry-After"] = self.retry_after
        if _is_openai_error(self.body):
            return self.status, self.body, {**headers, "Content-Type": "application/json"}
        snippet = self.body[:200].decode("utf-8", "replace").strip() or "(empty body)"
        body = error_body(f"{self.message}: {snippet}", self.status, code=self.error_type)
        return self.status, json.dumps(body).encode(), {**headers, "Content-Type": JSON}

    def in_stream(self) -> ProxyError:
        """The same failure once the client already has its 200: it can only be told in an SSE error event."""
        return ProxyError(self.status, f"{self.message}: {instance_message(self.body)}",
                          error_type=self.error_type, stage=self.stage)


def upstream_error_type(status: int) -> str:
    """The `error_type` label of an instance's own error status: `upstream_4xx` (other than 429) is a
    request the instance cannot serve, the client's doing (`CLIENT_CAUSED`)."""
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


# A request body that cannot be read, from either server (pdproxy/serving/)
def too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"request body is larger than {limit} bytes", error_type="body_too_large")


def body_timeout(timeout: float) -> ProxyError:
    return ProxyError(408, f"request body not received within {timeout:g}s", error_type="body_timeout")


def client_closed() -> ProxyError:
    return ProxyError(CLIENT_CLOSED, "client closed the connection while sending its body",
                      error_type="client_disconnect")


def _response(reply: tuple[int, bytes, dict[str, str]]) -> web.Response:
    status, body, headers = reply
    return web.Response(status=status, body=body, headers=headers)
