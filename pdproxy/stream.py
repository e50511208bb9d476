"""Relaying a decode response to the client while timing its tokens.

The bytes go to the client exactly as the instance sent them; the scanner only reads them to
learn when each token-bearing event arrived, how many tokens it carried (when the stream reports
`usage` on every chunk) and what the response said about itself (id, usage, finish reasons,
vLLM's per-request `metrics`, an in-band error).
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
from aiohttp import web

from pdproxy.errors import DECODE, ProxyError


class ClientGone(Exception):
    """The client closed its connection while we were writing to it."""


class ResponseScan:
    """What the proxy learns from one response, streamed or not."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.chunk_times: list[int] = []  # monotonic ns of each token-bearing event
        self.chunk_tokens: list[int] = []  # tokens each carried; 0 when the stream did not say
        self.response_id: str | None = None
        self.finish_reasons: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.server_metrics: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.done = False  # saw `data: [DONE]`
        self.malformed = 0
        self._buffer = b""
        self._completion_tokens = 0

    @property
    def first_token_ns(self) -> int | None:
        return self.chunk_times[0] if self.chunk_times else None

    # -- streamed responses -------------------------------------------------------------

    def feed(self, data: bytes, now_ns: int) -> None:
        buffer = self._buffer + data
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        *events, self._buffer = buffer.split(b"\n\n")
        for event in events:
            self._event(event, now_ns)

    def _event(self, event: bytes, now_ns: int) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments (`:`), `event:` and `id:` lines carry no tokens
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                self.malformed += 1
                continue
            if isinstance(obj, dict):
                self._observe(obj, now_ns, streamed=True)
            else:
                self.malformed += 1

    # -- whole responses ----------------------------------------------------------------

    def feed_whole(self, body: bytes, now_ns: int) -> None:
        try:
            obj = json.loads(body)
        except ValueError:
            self.malformed += 1
            return
        if isinstance(obj, dict):
            self._observe(obj, now_ns, streamed=False)

    # -- shared ------------------------------------------------------------------------

    def _observe(self, obj: dict[str, Any], now_ns: int, streamed: bool) -> None:
        if "error" in obj and isinstance(obj["error"], dict):
            self.error = obj["error"]
            return
        if self.response_id is None and isinstance(obj.get("id"), str):
            self.response_id = obj["id"]
        bearing = False
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.finish_reasons.append(str(choice["finish_reason"]))
            if self._has_output(choice, streamed):
                bearing = True
        usage = obj.get("usage")
        tokens = 0
        if isinstance(usage, dict):
            self.usage = usage
            completion = usage.get("completion_tokens")
            if isinstance(completion, int) and completion > self._completion_tokens:
                tokens = completion - self._completion_tokens
                self._completion_tokens = completion
                # a choice whose token text the detokenizer still holds back is a token all the same;
                # the trailing usage-only event (no choices) is not
                bearing = bearing or (streamed and bool(obj.get("choices")))
        if isinstance(obj.get("metrics"), dict):
            self.server_metrics = obj["metrics"]
        if bearing or (not streamed and obj.get("choices")):
            self.chunk_times.append(now_ns)
            self.chunk_tokens.append(tokens)

    def _has_output(self, choice: dict[str, Any], streamed: bool) -> bool:
        if not self.chat:
            return bool(choice.get("text"))
        part = choice.get("delta") if streamed else choice.get("message")
        if not isinstance(part, dict):
            return False
        # the role-only opening delta of a chat stream is not a token
        return bool(part.get("content") or part.get("reasoning_content") or part.get("reasoning") or part.get("tool_calls"))


async def relay(upstream: aiohttp.ClientResponse, downstream: web.StreamResponse | None, scan: ResponseScan) -> None:
    """Copy the upstream stream to the client (or nowhere, for shadow traffic), timing it on the way.

    Upstream failures, including a stream that ends without `[DONE]`, surface as
    `ProxyError(stage=decode)`; a client that went away as `ClientGone`.
    """
    clock = time.monotonic_ns
    content = upstream.content
    while True:
        try:
            data = await content.readany()
        except TimeoutError:  # aiohttp's read timeout is a TimeoutError too
            raise ProxyError(504, "decode instance went silent mid-stream (read timeout)",
                             error_type="timeout", stage=DECODE) from None
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise ProxyError(502, f"decode instance broke the stream: {exc.__class__.__name__}",
                             error_type="stream_broken", stage=DECODE) from None
        if not data:
            break
        scan.feed(data, clock())
        if downstream is not None:
            try:
                await downstream.write(data)
            except ConnectionError:
                raise ClientGone() from None
    if not scan.done and scan.error is None:
        raise ProxyError(502, "decode instance ended the stream without [DONE]", error_type="stream_truncated",
                         stage=DECODE)
