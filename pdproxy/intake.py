"""A client request's intake: what is checked of its head and body before it is served, and the headers its
legs carry. Everything decided from the head (encoding, API key, capacity, declared size) is decided before a
byte of the body is read or invited (`100 Continue`, pdproxy/server.py)."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Any

from pdproxy.admission import Admission
from pdproxy.config import Settings
from pdproxy.errors import ProxyError, bad_request, too_large
from pdproxy.protocol import Route, check_body_encoding, parse_body, valid_traceparent, validate
from pdproxy.serving.exchange import Exchange
from pdproxy.telemetry import Recorder, RequestTrace

_DP_RANK = re.compile(r"\d{1,6}")


class Intake:
    def __init__(self, settings: Settings, admission: Admission, recorder: Recorder) -> None:
        self.settings, self.admission, self.recorder = settings, admission, recorder
        # compared as digests: equal lengths, so the comparison time says nothing about the key
        self._key_digest = hashlib.sha256(f"Bearer {settings.api_key}".encode()).digest() if settings.api_key else None

    def check_head(self, headers: Mapping[str, str], content_length: int | None) -> None:
        """Its encoding, the API key, capacity, the declared size."""
        check_body_encoding(headers)
        self.authenticate(headers)
        self.admission.check()  # saturated: refuse before spending anything on the body
        limit = self.settings.max_body_bytes
        if content_length is not None and content_length > limit:
            raise too_large(limit)  # said so up front: not one byte of it is read

    def authenticate(self, headers: Mapping[str, str]) -> None:
        """Check the client's API key (when --api-key is set); also guards the debug endpoint."""
        if self._key_digest is None:
            return
        given = headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(hashlib.sha256(given).digest(), self._key_digest):
            raise ProxyError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                             error_type="unauthorized")

    def trace_context(self, headers: Mapping[str, str]) -> Any:
        """The headers the request's trace continues from: none when `traceparent` is invalid (W3C
        Trace Context: ignore it and start a new trace), which is counted."""
        if valid_traceparent(headers):
            return headers
        self.recorder.metrics.invalid_traceparent.inc()
        return {}

    async def read_body(self, client: Exchange, route: Route) -> tuple[dict[str, Any], bytes | None]:
        """The body as a checked JSON object, read within --body-timeout and --max-body-bytes; and its
        bytes when the decode leg may get them as they are."""
        raw = await client.read_body(self.settings.max_body_bytes, self.settings.body_timeout)
        if not raw.strip():
            raise bad_request("request body is empty; send a JSON object")
        body, forward = parse_body(raw)
        return validate(body, route, self.settings.client_kv_params), forward

    def leg_headers(self, client_headers: Mapping[str, str], trace: RequestTrace) -> dict[str, str]:
        """Headers both legs share. Authorization: the configured upstream key if any, else the
        client's own header, unless the client authenticated to pdproxy itself (never forwarded)."""
        headers = {"Content-Type": "application/json", "X-Request-Id": trace.request_id}
        if self.settings.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.settings.upstream_api_key}"
        elif not self.settings.api_key and "Authorization" in client_headers:
            headers["Authorization"] = client_headers["Authorization"]
        rank = client_headers.get("X-data-parallel-rank")
        if rank is not None:
            if not _DP_RANK.fullmatch(rank.strip()):
                raise bad_request("X-data-parallel-rank must be a non-negative integer", param="X-data-parallel-rank")
            headers["X-data-parallel-rank"] = rank.strip()
        return headers
