"""The prefill → decode flow for one request, top to bottom.

    client ─► pdproxy ─► prefill instance   (max_tokens=1, stream=false, kv_transfer_params{do_remote_decode})
                     └─► decode instance    (client's body + prefill's kv_transfer_params, streamed back)

Without prefill instances the request goes straight to a decode instance: the single-instance
baseline. Every step reports to the request's `RequestTrace`; errors become `ProxyError`s that
say which stage failed, answered as JSON before the response starts and as an SSE error event after.
Every request ends in exactly one `trace.fail(...)` (when it failed) and always one `trace.finish()`.

Retries happen only where the client cannot see them: the prefill leg, and the decode leg before
its first token (the client's status line waits for it). Which KV a retried decode gets, and how a
stream that breaks after its first token may go on elsewhere (--migrate-mid-stream), is decided in
`pdproxy/migration/`. A client that goes away cancels this handler (aiohttp's
`handler_cancellation`), and with it whichever upstream request is open: closing that connection
is how vLLM learns to abort the request and free its KV blocks. Both legs go through
`pdproxy/upstream.py`'s pooled keep-alive client.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from pdproxy import jsonio
from pdproxy.admission import Admission
from pdproxy.config import Settings
from pdproxy.errors import (DECODE, PREFILL, ProxyError, UpstreamResponse, bad_request, instance_message,
                            retry_after_seconds)
from pdproxy.migration import (BEFORE_FIRST_TOKEN, MID_STREAM, Attempt, Budget, Continuation, Handoff, TokenTap,
                               MIGRATABLE, first_token_timeout, read_head)
from pdproxy.policies import RequestView
from pdproxy.pool import Instance, Pool
from pdproxy.protocol import (COMPLETIONS, Route, check_body_encoding, decode_payload, new_uuid4, parse_body,
                              prefill_body, request_id, valid_traceparent, validate)
from pdproxy.stream import ClientGone, ResponseScan, SlowReaders, WholeEventWriter, relay
from pdproxy.telemetry import Recorder, RequestTrace
from pdproxy.telemetry.clock import now
from pdproxy.upstream import ConnectFailed, ConnectTimeout, Response, UpstreamClient, UpstreamError

log = logging.getLogger("pdproxy.pd")
T = TypeVar("T")
Resume = Callable[[ProxyError], Awaitable[Attempt]]

MAX_BACKOFF = 2.0  # seconds; the backoff between two attempts never exceeds this
CLIENT_CLOSED = 499  # as the recorder's client_gone(): nginx's "client closed the request"
_DP_RANK = re.compile(r"\d{1,6}")


class Proxy:
    """What every request needs: settings, pools, the legs' pooled client, admission and the recorder.

    `session` (aiohttp) serves the rest: /v1/models and health checks."""

    def __init__(self, settings: Settings, session: aiohttp.ClientSession, upstream: UpstreamClient,
                 prefill: Pool | None, decode: Pool, admission: Admission, recorder: Recorder, shadow=None) -> None:
        self.settings = settings
        self.session = session
        self.upstream = upstream
        self.prefill = prefill if prefill and len(prefill) else None
        self.decode = decode
        self.admission = admission
        self.recorder = recorder
        self.shadow = shadow
        self.selective = None  # pdproxy.kvevents.selective.SelectiveDisaggregation when --pd-min-prefill-tokens
        self.tokens = None  # pdproxy.kvevents.tokenize.RemoteTokenizer: text prompts' ids for routing by events
        self.slow_readers = SlowReaders(settings.write_timeout)  # started by the server for client traffic
        self.timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout,
                                             sock_connect=settings.connect_timeout, sock_read=settings.read_timeout)
        # compared as digests: equal lengths, so the comparison time says nothing about the key
        self._key_digest = hashlib.sha256(f"Bearer {settings.api_key}".encode()).digest() if settings.api_key else None

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        """Serve one client request: check it, mirror it if asked, forward it, answer."""
        try:
            rid, id_error = request_id(request.headers), None
        except ProxyError as err:
            rid, id_error = new_uuid4(), err
        trace = self.recorder.begin(route=route.name, operation=route.operation, chat=route.chat,
                                    headers=self._trace_context(request), request_id=rid,
                                    pd_mode=self.prefill is not None)
        reply_headers = {"X-Request-Id": rid}
        try:
            if id_error:
                raise id_error
            self.check_head(request)
            body, raw = await self._read_body(request, route)
            trace.set_request(body)
            headers = self._leg_headers(request, trace)
            if self.shadow is not None:
                self.shadow.mirror(body, route, trace, headers)
            return await self.forward(body, route, trace, headers,
                                      lambda attempt, resume: self._respond(request, attempt, resume, trace,
                                                                            reply_headers), raw,
                                      RequestView(body, request.headers, route.chat))
        except (ProxyError, UpstreamResponse) as err:
            trace.fail(err.status, err.error_type, err.message)
            response = err.response(reply_headers)
            if err.status in (408, 413, 415):
                response.force_close()  # the rest of that body is not worth reading
            return response
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
                      deliver: Callable[[Attempt, Resume], Awaitable[T]], raw: bytes | None = None,
                      view: RequestView | None = None) -> T:
        """Admit, choose instances, prefill, run the decode up to its first token and hand it to `deliver`.

        The same path serves client requests and their shadow copies; only `deliver` differs. `raw`:
        the client's bytes of `body` when the decode may get them as they are (`protocol.parse_body`);
        `view`: what the routing policies may read of the request (its body and the client's headers).
        `deliver` may call `resume` when the stream breaks after tokens reached the client: it gives
        the stream's continuation on another decode instance, or raises why there is none.
        """
        view = view or RequestView(body, None, route.chat)
        async with self.admission.slot():
            prefill_instance = None
            if self.tokens is not None:
                await self.tokens.prepare(view)
            decode_instance, decode_decision = self.decode.pick(view)
            verdict = self.selective.decide(view, decode_instance.address) if self.prefill and self.selective else None
            if verdict is not None:
                trace.disaggregation(verdict)
            if self.prefill and (verdict is None or not verdict.decode_only):
                prefill_instance, decision = self.prefill.pick(view)
                trace.routed(PREFILL, decision)
            trace.routed(DECODE, decode_decision)
            trace.admitted(prefill_instance and prefill_instance.address, decode_instance.address)
            kv_params = None
            if prefill_instance is not None:
                with decode_instance.reserved():
                    kv_params = await self._prefill(body, route, trace, prefill_instance, headers)
            budget = Budget.start(self.settings.decode_retries, self.settings.decode_deadline)
            continuation, tap = self._arm(body, route, trace)
            if tap is not None:
                body, raw = {**body, "return_token_ids": True}, None  # the ids a continuation needs
            attempt = await self._decode(body, raw, Handoff(kv_params, prefill_instance), route, trace,
                                         decode_instance, headers, budget, tap)
            trace.first_token()

            async def resume(failure: ProxyError) -> Attempt:
                nonlocal attempt
                broken, attempt = attempt, None
                broken.close()  # vLLM aborts the request when its connection closes
                try:
                    attempt = await self._migrate(continuation, broken, failure, trace, headers, budget)
                except UpstreamResponse as answer:  # the client has its 200: an instance's status cannot follow
                    raise answer.in_stream() from None
                return attempt

            try:
                return await deliver(attempt, resume)
            finally:
                if attempt is not None:
                    attempt.close()

    # -- the prefill leg -------------------------------------------------------------------

    async def _prefill(self, body: dict[str, Any], route: Route, trace: RequestTrace, instance: Instance,
                       headers: dict[str, str], rerun: bool = False) -> dict[str, Any] | None:
        """Run the prefill leg (retried elsewhere: nothing of it reaches the client); return its KV coordinates.
        `rerun`: fresh coordinates for a migrated decode (the request's first prefill keeps its span)."""
        payload = jsonio.dumps(prefill_body(body))
        headers = {**headers, **trace.leg_headers(PREFILL)}

        async def attempt(inst: Instance, tries: int) -> tuple[dict[str, Any] | None, int] | _Failure:
            trace.prefill_sent(inst.address, tries)
            outcome = await self._prefill_once(inst, route, payload, headers)
            if isinstance(outcome, _Failure):
                trace.prefill_failed(inst.address, tries, outcome.error.error_type)
            return outcome

        (kv_params, status), instance, tries = await self._retrying(
            self.prefill, instance, Budget.start(self.settings.prefill_retries, 0), attempt)
        if rerun:
            trace.prefill_rerun(instance.address)
        else:
            trace.prefill_done(instance.address, status, tries, "received" if kv_params else "missing")
        return kv_params

    async def _prefill_once(self, inst: Instance, route: Route, payload: bytes,
                            headers: dict[str, str]) -> tuple[dict[str, Any] | None, int] | _Failure:
        """One prefill attempt: its KV coordinates and status, or why it failed."""
        inst.inflight += 1
        resp = None
        try:
            resp = await self.upstream.post(inst.url, route.path, payload, headers)
            raw = await resp.read()
        except UpstreamError as exc:
            return _transport_failure(PREFILL, inst, exc)
        finally:
            inst.inflight -= 1
            if resp is not None:
                resp.release()  # pooled when read to its end, else closed (a cancel aborts the prefill)
        if resp.status >= 300:
            return _status_failure(PREFILL, inst, resp.status, resp.headers, raw)
        try:
            return _kv_params(raw, inst), resp.status
        except ProxyError as err:
            return _Failure(err)  # a broken answer: another instance may do better

    # -- the decode leg --------------------------------------------------------------------

    async def _decode(self, body: dict[str, Any], raw: bytes | None, handoff: Handoff, route: Route,
                      trace: RequestTrace, instance: Instance, headers: dict[str, str], budget: Budget,
                      tap: TokenTap | None) -> Attempt:
        """Send the decode leg and read its answer up to the first token (or whole, unstreamed). Nothing
        has reached the client yet, so a failure is retried on another instance, with fresh KV
        coordinates from a new prefill unless the failed one provably never got the request."""
        leg_headers = {**headers, **trace.leg_headers(DECODE)}
        timeout = self.settings.first_token_timeout if body.get("stream") else 0  # an answer's first byte is its last

        async def attempt(inst: Instance, tries: int) -> Attempt | _Failure:
            nonlocal handoff
            if tries > 1 or tap is not None and tap.splice:
                trace.migrating(BEFORE_FIRST_TOKEN if tries > 1 else MID_STREAM, inst.address)
            if not handoff.reusable:
                handoff = await self._reprefill(body, route, trace, handoff, headers)
            inst.inflight += 1
            handed_over = False  # a committed answer and the in-flight count go to the caller
            trace.decode_sent(inst.address)
            if tap is None or not tap.splice:
                trace.scan = ResponseScan(route.chat)  # nothing of a failed attempt counts
            try:
                try:
                    async with asyncio.timeout(timeout or None):
                        outcome = await self._decode_once(inst, body, raw, handoff.params, route, trace, leg_headers,
                                                          tap and tap.fresh())
                except TimeoutError:
                    outcome = _Failure(first_token_timeout(timeout))
                handed_over = isinstance(outcome, Attempt)
            finally:
                if not handed_over:
                    inst.inflight -= 1  # also when the client's disconnect cancels us here
            if isinstance(outcome, _Failure):
                abandoned = handoff.spent(outcome.reached and outcome.outlier)
                trace.decode_failed(inst.address, outcome.error.error_type, abandoned)
            return outcome

        try:
            return (await self._retrying(self.decode, instance, budget, attempt))[0]
        except (ProxyError, UpstreamResponse):
            trace.handoff_abandoned(handoff.spent(True))  # no decode will pull its blocks now
            raise

    async def _decode_once(self, inst: Instance, body: dict[str, Any], raw: bytes | None,
                           kv_params: dict[str, Any] | None, route: Route, trace: RequestTrace,
                           headers: dict[str, str], tap: TokenTap | None) -> Attempt | _Failure:
        """One decode attempt up to its commit point."""
        try:
            upstream = await self.upstream.post(inst.url, route.path, decode_payload(body, raw, kv_params), headers)
        except UpstreamError as exc:
            return _transport_failure(DECODE, inst, exc)
        trace.decode_headers(upstream.status)
        if upstream.status >= 300:
            try:
                answer = await upstream.read()
            except UpstreamError:
                answer = b""
            finally:
                upstream.release()
            return _status_failure(DECODE, inst, upstream.status, upstream.headers, answer,
                                   kv_sent=kv_params is not None)
        streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")
        try:
            head = await (read_head(upstream, trace.scan, tap) if streamed else self._whole(upstream, trace))
        except ProxyError as err:
            upstream.close()  # vLLM aborts the request and frees its KV
            return _Failure(err, charged=err.error_type != "timeout")  # silence: as _transport_failure says
        except BaseException:
            upstream.close()
            raise
        return Attempt(inst, upstream, head, streamed, tap)

    async def _reprefill(self, body: dict[str, Any], route: Route, trace: RequestTrace, spent: Handoff,
                         headers: dict[str, str]) -> Handoff:
        """Fresh KV coordinates for the next decode: the prefill again, on another instance where there is one."""
        instance = self.prefill.choose(exclude=spent.prefill)
        return Handoff(await self._prefill(body, route, trace, instance, headers, rerun=True), instance)

    def _arm(self, body: dict[str, Any], route: Route,
             trace: RequestTrace) -> tuple[Continuation | None, TokenTap | None]:
        """With --migrate-mid-stream, a stream that can be continued exactly elsewhere gets its token ids
        read as it goes; any other says why not (on its trace), and stays a plain relay."""
        if not self.settings.migrate_mid_stream or not body.get("stream"):
            return None, None
        continuation = Continuation(body, route.chat)
        trace.migration_refusal = continuation.refusal()
        return (None, None) if trace.migration_refusal else (continuation, continuation.tap())

    async def _migrate(self, continuation: Continuation | None, broken: Attempt, failure: ProxyError,
                       trace: RequestTrace, headers: dict[str, str], budget: Budget) -> Attempt:
        """Continue a stream that broke after tokens reached the client on another decode instance:
        prefill the prompt plus the tokens delivered, decode the rest. Raises `failure` when it cannot."""
        if failure.error_type != "timeout":
            self.decode.failed(broken.instance)
        if continuation is None or broken.tap is None or failure.error_type not in MIGRATABLE:
            raise failure
        trace.migration_refusal = continuation.obstacle(broken.tap)
        if trace.migration_refusal or not budget.take():
            raise failure
        trace.decode_failed(broken.instance.address, failure.error_type, abandoned=None)
        body, tap = continuation.body_after(broken.tap), broken.tap.continued()
        handoff = Handoff(None, None)
        if self.prefill:  # the prompt and the tokens delivered, prefilled anew
            prefill = self.prefill.choose()
            handoff = Handoff(await self._prefill(body, COMPLETIONS, trace, prefill, headers, rerun=True), prefill)
        instance = self.decode.choose(exclude=broken.instance)
        return await self._decode(body, None, handoff, COMPLETIONS, trace, instance, headers, budget, tap)

    async def _whole(self, upstream: Response, trace: RequestTrace) -> bytes:
        """An unstreamed answer, read whole and checked before the client gets any of it."""
        try:
            raw = await upstream.read()
        except TimeoutError:
            raise ProxyError(504, "decode instance timed out sending its response", error_type="timeout",
                             stage=DECODE) from None
        except UpstreamError as exc:
            raise ProxyError(502, f"decode instance broke its response ({type(exc).__name__})",
                             error_type="stream_broken", stage=DECODE) from None
        trace.scan.feed_whole(raw, now())
        if trace.scan.malformed:
            raise ProxyError(502, "decode instance sent a response that is not valid JSON",
                             error_type="invalid_response", stage=DECODE)
        return raw

    # -- retries ---------------------------------------------------------------------------

    async def _retrying(self, pool: Pool, instance: Instance, budget: Budget,
                        attempt: Callable[[Instance, int], Awaitable[T | _Failure]]) -> tuple[T, Instance, int]:
        """Try `instance`, then others while the failure allows it and the budget lasts (so many more
        attempts, until a deadline), each after a jittered exponential backoff. An instance that
        answered 429/503 with Retry-After is held for that long; when only held instances are left,
        the proxy waits for one if that is at most --max-retry-wait, else the client gets the
        instance's answer and its Retry-After."""
        tries = 0
        while True:
            tries += 1
            outcome = await attempt(instance, tries)
            if not isinstance(outcome, _Failure):
                pool.succeeded(instance)
                return outcome, instance, tries
            if outcome.hold is not None:
                pool.hold(instance, outcome.hold)
            if outcome.charged:
                pool.failed(instance)
            if not outcome.retry or not budget.take():
                raise outcome.error
            try:
                instance = pool.choose(exclude=instance)
            except ProxyError:
                raise outcome.error from None
            held = pool.wait_for(instance)
            if held > self.settings.max_retry_wait:
                raise outcome.error
            await asyncio.sleep(max(held, self._backoff(tries)))

    def _backoff(self, attempt: int) -> float:
        """Exponential in the attempt, jittered ±50 % so that retries of many requests spread out."""
        delay = self.settings.retry_backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
        return min(delay, MAX_BACKOFF)

    async def _respond(self, request: web.Request, attempt: Attempt, resume: Resume, trace: RequestTrace,
                       reply_headers: dict[str, str]) -> web.StreamResponse:
        """Give the client the decode's answer: whole, or relayed as it streams; a stream that breaks
        is continued on another decode when `resume` can (--migrate-mid-stream), else it ends with an
        error event."""
        status = attempt.response.status
        content_type = attempt.response.headers.get("content-type", "application/json")
        if not attempt.streamed:
            return web.Response(status=status, body=attempt.head,
                                headers={**reply_headers, "Content-Type": content_type})

        response = web.StreamResponse(status=status,
                                      headers={**reply_headers, "Content-Type": content_type, "Cache-Control": "no-cache"})
        too_slow = f"client left streamed data unread for {self.settings.write_timeout:g}s"
        client = WholeEventWriter(request, response, trace.scan, on_delivered=trace.delivered,
                                  on_cut_off=lambda: trace.fail(CLIENT_CLOSED, "client_too_slow", too_slow))
        self.slow_readers.writers.add(client)
        try:
            try:
                while True:
                    await client.write(attempt.head)  # the status line goes out with the first token
                    try:
                        await relay(attempt.response, client, trace.scan, attempt.tap)
                        break
                    except ProxyError as err:
                        attempt = await resume(err)  # raises when the stream cannot go on elsewhere
                await client.flush()
            except ProxyError as err:
                trace.fail(response.status, err.error_type, err.message)  # the client already has its 200
                await response.write(err.sse_event())
            await response.write_eof()
        except (ClientGone, ConnectionError):
            trace.client_gone()  # unless it was cut off for reading too slowly: the first failure stands
        finally:
            self.slow_readers.writers.discard(client)
        return response

    # -- helpers ----------------------------------------------------------------------------

    def check_head(self, request: web.Request) -> None:
        """Everything decided from the request head, before a byte of the body is read or invited
        (`100 Continue`, pdproxy/server.py): its encoding, the API key, capacity, the declared size."""
        check_body_encoding(request.headers)
        self.authenticate(request)
        self.admission.check()  # saturated: refuse before spending anything on the body
        limit = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(limit)  # said so up front: not one byte of it is read

    def _trace_context(self, request: web.Request) -> Any:
        """The headers the request's trace continues from: none when `traceparent` is invalid (W3C
        Trace Context: ignore it and start a new trace), which is counted."""
        if valid_traceparent(request.headers):
            return request.headers
        self.recorder.metrics.invalid_traceparent.inc()
        return {}

    def authenticate(self, request: web.Request) -> None:
        """Check the client's API key (when --api-key is set); also guards the debug endpoint."""
        if self._key_digest is None:
            return
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(hashlib.sha256(given).digest(), self._key_digest):
            raise ProxyError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                             error_type="unauthorized")

    async def _read_body(self, request: web.Request, route: Route) -> tuple[dict[str, Any], bytes | None]:
        """The body as a checked JSON object, read within --body-timeout and --max-body-bytes; and its
        bytes when the decode leg may get them as they are."""
        limit = self.settings.max_body_bytes
        try:
            if request.content.is_eof():  # the whole body came with the headers: no deadline to arm
                raw = await request.read()
            else:
                async with asyncio.timeout(self.settings.body_timeout):
                    raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(limit) from None
        except TimeoutError:
            raise ProxyError(408, f"request body not received within {self.settings.body_timeout:g}s",
                             error_type="body_timeout") from None
        except RequestPayloadError as exc:
            raise bad_request(f"request body is malformed ({exc})") from None
        except ConnectionError:
            raise ProxyError(CLIENT_CLOSED, "client closed the connection while sending its body",
                             error_type="client_disconnect") from None
        if not raw.strip():
            raise bad_request("request body is empty; send a JSON object")
        body, forward = parse_body(raw)
        return validate(body, route, self.settings.client_kv_params), forward

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
            if not _DP_RANK.fullmatch(rank.strip()):
                raise bad_request("X-data-parallel-rank must be a non-negative integer", param="X-data-parallel-rank")
            headers["X-data-parallel-rank"] = rank.strip()
        return headers


def _too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"request body is larger than {limit} bytes", error_type="body_too_large")


@dataclass
class _Failure:
    """One failed attempt at a leg: what the client gets if it stays failed, and what may be done about it."""

    error: ProxyError | UpstreamResponse
    retry: bool = True  # may another attempt help?
    outlier: bool = True  # a fault, not load (a busy answer is not one: the request never started)
    charged: bool = True  # the instance is to blame: counts towards its passive ejection
    hold: float | None = None  # the instance asked for this many seconds of peace (Retry-After)
    reached: bool = True  # the instance got the request (a decode may have used its KV coordinates)


def _transport_failure(role: str, instance: Instance, exc: BaseException) -> _Failure:
    """Connect errors and timeouts, resets and broken answers are the instance's fault; read timeouts
    are not charged to it: how long an answer takes is the request's doing (a non-streamed decode
    sends its status line after its last token, so `max_tokens` alone can outlast --read-timeout; a
    prefill's time grows with the prompt). An instance that hangs outright fails its active health
    check, which has its own short timeout; retries already steer each request away from it."""
    where = f"{role} instance {instance.address}"
    if isinstance(exc, ConnectTimeout):
        return _Failure(ProxyError(504, f"{where} did not accept a connection in time", error_type="connect_timeout",
                                   stage=role), reached=False)
    if isinstance(exc, TimeoutError):
        return _Failure(ProxyError(504, f"{where} timed out", error_type="timeout", stage=role), charged=False)
    if isinstance(exc, ConnectFailed):
        return _Failure(ProxyError(503, f"{where} is unreachable ({type(exc).__name__})", error_type="connect_error",
                                   stage=role), reached=False)
    return _Failure(ProxyError(502, f"{where} dropped the connection before answering ({type(exc).__name__})",
                               error_type="upstream_disconnect", stage=role))


def _status_failure(role: str, instance: Instance, status: int, headers: dict[str, str], raw: bytes,
                    kv_sent: bool = True) -> _Failure:
    """An error status from an instance. 429, and 503 with Retry-After, mean "busy": retried elsewhere
    without counting against the instance. Other 4xx are the request's fault: relayed at once. 5xx
    are the instance's fault: retried, counted, and a 502 naming the instance if they persist. A KV
    load failure is counted only when the decode got the prefill's own coordinates (`kv_sent`):
    whatever it failed to load otherwise, the proxy did not name it."""
    retry_after = headers.get("retry-after")  # the upstream client lower-cases header names
    advised = retry_after_seconds(retry_after)
    content_type = headers.get("content-type", "application/json")
    if status == 429 or (status == 503 and advised is not None):
        return _Failure(UpstreamResponse(status, raw, content_type, stage=role, retry_after=retry_after),
                        outlier=False, charged=False, hold=advised)
    if status < 500:
        return _Failure(UpstreamResponse(status, raw, content_type, stage=role, retry_after=retry_after),
                        retry=False, outlier=False, charged=False)
    message = instance_message(raw)
    if role == DECODE and _is_kv_load_failure(message):
        return _Failure(ProxyError(502, f"{role} instance {instance.address} could not load the prompt's KV cache "
                                        f"({status}: {message})", error_type="kv_load_failed", stage=role),
                        charged=kv_sent)
    return _Failure(ProxyError(502, f"{role} instance {instance.address} answered {status}: {message}",
                               error_type="upstream_5xx", stage=role))


def _is_kv_load_failure(message: str) -> bool:
    """vLLM ends a request whose KV pull failed with HTTP 500 (kv_load_failure_policy=fail); its message
    names the KV load. Told apart only for the error type: every decode 5xx is retried the same way."""
    text = message.lower()
    return "kv" in text and any(word in text for word in ("load", "transfer", "pull", "recv"))


_missing_kv_warned: set[str] = set()


def _kv_params(raw: bytes, instance: Instance) -> dict[str, Any] | None:
    """The prefill's `kv_transfer_params`; None when it sent none (the decode then prefills locally;
    connectors such as LMCache and Mooncake never send any, so this is a warning once, not an error)."""
    try:
        answer = jsonio.loads_exact(raw)  # its kv_transfer_params go on to the decode: every integer exact
    except ValueError:
        raise ProxyError(502, f"prefill instance {instance.address} sent a response that is not JSON",
                         error_type="invalid_prefill_response", stage=PREFILL) from None
    if not isinstance(answer, dict):
        raise ProxyError(502, f"prefill instance {instance.address} sent a response that is not a JSON object",
                         error_type="invalid_prefill_response", stage=PREFILL)
    params = answer.get("kv_transfer_params")
    if params is None or params == {}:
        if instance.address not in _missing_kv_warned:
            _missing_kv_warned.add(instance.address)
            log.warning("prefill instance %s returned no kv_transfer_params; decodes will compute the prompt "
                        "themselves (traces say pd.kv_transfer_params=missing)", instance.address)
        return None
    if not isinstance(params, dict):
        raise ProxyError(502, f"prefill instance {instance.address} sent malformed kv_transfer_params",
                         error_type="invalid_kv_params", stage=PREFILL)
    return params
