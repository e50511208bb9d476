"""The prefill → decode flow for one request, top to bottom.

    client ─► pdproxy ─► prefill instance   (max_tokens=1, stream=false, kv_transfer_params{do_remote_decode})
                     └─► decode instance    (client's body + prefill's kv_transfer_params, streamed back)

Without prefill instances the request goes straight to a decode instance: the single-instance
baseline. Every step reports to the request's `RequestTrace`; errors become `ProxyError`s that
say which stage failed, answered as JSON before the response starts and as an SSE error event after.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from pdproxy.admission import Admission
from pdproxy.config import Settings
from pdproxy.errors import DECODE, PREFILL, ProxyError, UpstreamResponse, bad_request
from pdproxy.pool import Instance, Pool
from pdproxy.protocol import Route, check_trace_headers, decode_body, prefill_body, request_id, validate
from pdproxy.stream import ClientGone, relay
from pdproxy.telemetry import Recorder, RequestTrace
from pdproxy.telemetry.clock import now

log = logging.getLogger("pdproxy.pd")
T = TypeVar("T")


class Proxy:
    """What every request needs: settings, pools, one pooled HTTP session, admission and the recorder."""

    def __init__(self, settings: Settings, session: aiohttp.ClientSession, prefill: Pool | None, decode: Pool,
                 admission: Admission, recorder: Recorder, shadow=None) -> None:
        self.settings = settings
        self.session = session
        self.prefill = prefill if prefill and len(prefill) else None
        self.decode = decode
        self.admission = admission
        self.recorder = recorder
        self.shadow = shadow
        self.timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout,
                                             sock_connect=settings.connect_timeout, sock_read=settings.read_timeout)

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        """Serve one client request: check it, mirror it if asked, forward it, answer."""
        try:
            rid, id_error = request_id(request.headers), None
        except ProxyError as err:
            rid, id_error = str(uuid.uuid4()), err
        trace = self.recorder.begin(route=route.name, operation=route.operation, chat=route.chat,
                                    headers=request.headers, request_id=rid, pd_mode=self.prefill is not None)
        reply_headers = {"X-Request-Id": rid}
        try:
            if id_error:
                raise id_error
            check_trace_headers(request.headers)
            self._authenticate(request)
            body = await self._read_body(request, route)
            trace.set_request(body)
            headers = self._leg_headers(request, trace)
            if self.shadow is not None:
                self.shadow.mirror(body, route, trace, headers)
            return await self.forward(body, route, trace, headers,
                                      lambda upstream: self._respond(request, upstream, trace, reply_headers))
        except (ProxyError, UpstreamResponse) as err:
            trace.fail(err.status, err.error_type, err.message)
            return err.response(reply_headers)
        except asyncio.CancelledError:
            trace.client_gone()  # aiohttp cancels the handler when the client disconnects
            raise
        except Exception:
            log.exception("unexpected error serving request %s", rid)
            err = ProxyError(500, "internal proxy error", error_type="internal")
            trace.fail(err.status, err.error_type, err.message)
            return err.response(reply_headers)
        finally:
            trace.finish()

    async def forward(self, body: dict[str, Any], route: Route, trace: RequestTrace, headers: dict[str, str],
                      deliver: Callable[[aiohttp.ClientResponse], Awaitable[T]]) -> T:
        """Admit, choose instances, prefill, open the decode and hand its answer to `deliver`.

        The same path serves client requests and their shadow copies; only `deliver` differs.
        """
        async with self.admission.slot():
            prefill_instance = self.prefill.choose() if self.prefill else None
            decode_instance = self.decode.choose()
            trace.admitted(prefill_instance and prefill_instance.address, decode_instance.address)
            kv_params = None
            if prefill_instance is not None:
                kv_params = await self._prefill(body, route, trace, prefill_instance, headers)
            upstream, decode_instance = await self._open_decode(body, kv_params, route, trace, decode_instance, headers)
            try:
                return await deliver(upstream)
            finally:
                # an answer not read to its end is closed, not pooled: that aborts it on the instance
                upstream.release() if upstream.content.at_eof() else upstream.close()
                decode_instance.inflight -= 1

    # -- the prefill leg -------------------------------------------------------------------

    async def _prefill(self, body: dict[str, Any], route: Route, trace: RequestTrace, instance: Instance,
                       headers: dict[str, str]) -> dict[str, Any] | None:
        """Run the prefill leg (retrying elsewhere on 5xx or connection errors); return its KV coordinates."""
        payload = json.dumps(prefill_body(body)).encode()
        headers = {**headers, **trace.leg_headers(PREFILL)}
        attempt = 0
        while True:
            attempt += 1
            instance.inflight += 1
            try:
                async with self.session.post(instance.url + route.path, data=payload, headers=headers,
                                             timeout=self.timeout) as resp:
                    raw = await resp.read()
                    status, content_type = resp.status, resp.headers.get("Content-Type", "application/json")
                    retry_after = resp.headers.get("Retry-After")
            except TimeoutError:
                err = ProxyError(504, f"prefill instance {instance.address} timed out", error_type="timeout",
                                 stage=PREFILL)
            except (aiohttp.ClientError, OSError) as exc:
                err = ProxyError(503, f"prefill instance {instance.address} is unreachable ({type(exc).__name__})",
                                 error_type="connect_error", stage=PREFILL)
            else:
                if status < 300:
                    self.prefill.succeeded(instance)
                    kv_params = _kv_params(raw, instance)
                    trace.prefill_done(instance.address, status, attempt, "received" if kv_params else "missing")
                    return kv_params
                if status < 500:
                    raise UpstreamResponse(status, raw, content_type, stage=PREFILL, retry_after=retry_after)
                err = ProxyError(502, f"prefill instance {instance.address} answered {status}: {_message(raw)}",
                                 error_type="upstream_5xx", stage=PREFILL)
            finally:
                instance.inflight -= 1
            self.prefill.failed(instance)
            if attempt > self.settings.prefill_retries:
                raise err
            await self._backoff(attempt)
            instance = self.prefill.choose(exclude=instance)

    # -- the decode leg --------------------------------------------------------------------

    async def _open_decode(self, body: dict[str, Any], kv_params: dict[str, Any] | None, route: Route,
                           trace: RequestTrace, instance: Instance,
                           headers: dict[str, str]) -> tuple[aiohttp.ClientResponse, Instance]:
        """Send the decode leg and wait for a 2xx status line; nothing has reached the client yet, so
        5xx answers and connection errors may still be retried on another instance."""
        payload = json.dumps(decode_body(body, kv_params)).encode()
        headers = {**headers, **trace.leg_headers(DECODE)}
        attempt = 0
        while True:
            attempt += 1
            instance.inflight += 1
            trace.decode_sent(instance.address)
            try:
                upstream = await self.session.post(instance.url + route.path, data=payload, headers=headers,
                                                   timeout=self.timeout)
            except TimeoutError:
                err = ProxyError(504, f"decode instance {instance.address} timed out", error_type="timeout",
                                 stage=DECODE)
            except (aiohttp.ClientError, OSError) as exc:
                err = ProxyError(503, f"decode instance {instance.address} is unreachable ({type(exc).__name__})",
                                 error_type="connect_error", stage=DECODE)
            else:
                trace.decode_headers(upstream.status)
                if upstream.status < 300:
                    self.decode.succeeded(instance)
                    return upstream, instance  # the caller releases it and the instance's in-flight count
                try:
                    raw = await upstream.read()
                except (aiohttp.ClientError, TimeoutError):
                    raw = b""
                finally:
                    upstream.release()
                if upstream.status < 500:
                    instance.inflight -= 1
                    raise UpstreamResponse(upstream.status, raw, upstream.headers.get("Content-Type", "application/json"),
                                           stage=DECODE, retry_after=upstream.headers.get("Retry-After"))
                err = ProxyError(502, f"decode instance {instance.address} answered {upstream.status}: {_message(raw)}",
                                 error_type="upstream_5xx", stage=DECODE)
            instance.inflight -= 1
            self.decode.failed(instance)
            if attempt > self.settings.decode_retries:
                raise err
            await self._backoff(attempt)
            instance = self.decode.choose(exclude=instance)

    async def _respond(self, request: web.Request, upstream: aiohttp.ClientResponse, trace: RequestTrace,
                       reply_headers: dict[str, str]) -> web.StreamResponse:
        """Give the client the decode instance's answer: relayed as it streams, or whole."""
        content_type = upstream.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            try:
                raw = await upstream.read()
            except TimeoutError:
                raise ProxyError(504, "decode instance timed out sending its response", error_type="timeout",
                                 stage=DECODE) from None
            except aiohttp.ClientError as exc:
                raise ProxyError(502, f"decode instance broke its response ({type(exc).__name__})",
                                 error_type="stream_broken", stage=DECODE) from None
            trace.scan.feed_whole(raw, now())
            return web.Response(status=upstream.status, body=raw,
                                headers={**reply_headers, "Content-Type": content_type})

        response = web.StreamResponse(status=upstream.status,
                                      headers={**reply_headers, "Content-Type": content_type, "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            try:
                await relay(upstream, response, trace.scan)
            except ProxyError as err:
                trace.fail(response.status, err.error_type, err.message)  # the client already has its 200
                await response.write(err.sse_event())
            await response.write_eof()
        except (ClientGone, ConnectionError):
            trace.client_gone()
        return response

    # -- helpers ----------------------------------------------------------------------------

    def _authenticate(self, request: web.Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ProxyError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                             error_type="unauthorized")

    async def _read_body(self, request: web.Request, route: Route) -> dict[str, Any]:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ProxyError(413, f"request body is larger than {self.settings.max_body_bytes} bytes",
                             error_type="body_too_large") from None
        if not raw.strip():
            raise bad_request("request body is empty; send a JSON object")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise bad_request(f"request body is not valid JSON ({exc})") from None
        return validate(body, route, self.settings.client_kv_params)

    def _leg_headers(self, request: web.Request, trace: RequestTrace) -> dict[str, str]:
        """Headers both legs share. Authorization: the configured upstream key if any, else the
        client's own header, unless the client authenticated to pdproxy itself (never forwarded)."""
        headers = {"Content-Type": "application/json", "X-Request-Id": trace.request_id}
        if self.settings.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.settings.upstream_api_key}"
        elif not self.settings.api_key and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        rank = request.headers.get("X-data-parallel-rank")
        if rank is not None:
            headers["X-data-parallel-rank"] = rank
        return headers

    async def _backoff(self, attempt: int) -> None:
        await asyncio.sleep(self.settings.retry_backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))


def _kv_params(raw: bytes, instance: Instance) -> dict[str, Any] | None:
    """The prefill's `kv_transfer_params`; None when it sent none (the decode then prefills locally)."""
    try:
        answer = json.loads(raw)
    except ValueError:
        raise ProxyError(502, f"prefill instance {instance.address} sent a response that is not JSON",
                         error_type="invalid_prefill_response", stage=PREFILL) from None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if params is None or params == {}:
        log.warning("prefill instance %s returned no kv_transfer_params; decode will recompute the prompt",
                    instance.address)
        return None
    if not isinstance(params, dict):
        raise ProxyError(502, f"prefill instance {instance.address} sent malformed kv_transfer_params",
                         error_type="invalid_kv_params", stage=PREFILL)
    return params


def _message(raw: bytes) -> str:
    """The instance's own error message, for the client's error body."""
    try:
        error = json.loads(raw).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:300]
        if isinstance(error, str):
            return error[:300]
    except (ValueError, AttributeError):
        pass
    return raw[:200].decode("utf-8", "replace") or "(empty body)"
