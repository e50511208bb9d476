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
`pdproxy/migration/`. A client that goes away cancels this handler (both servers do, see
`pdproxy/serving/`), and with it whichever upstream request is open: closing that connection
is how vLLM learns to abort the request and free its KV blocks. Both legs go through
`pdproxy/upstream.py`'s pooled keep-alive client; how a failed attempt is told apart and retried,
and how the prefill's answer is read, is `pdproxy/legs.py`. Each leg is a loop whose first attempt
pays for none of that: every coroutine on this path is resumed at each wake-up of the request.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import aiohttp

from pdproxy import jsonio
from pdproxy.admission import Admission
from pdproxy.config import Settings
from pdproxy.errors import CLIENT_CLOSED, DECODE, PREFILL, ProxyError, UpstreamResponse, bad_request, too_large
from pdproxy.legs import Deadline, Failure, kv_params, retry, status_failure, transport_failure
from pdproxy.migration import (BEFORE_FIRST_TOKEN, MID_STREAM, Attempt, Budget, Continuation, Handoff, TokenTap,
                               MIGRATABLE, first_token_timeout, read_head)
from pdproxy.policies import RequestView
from pdproxy.pool import Instance, Pool
from pdproxy.protocol import (COMPLETIONS, Route, check_body_encoding, decode_payload, new_uuid4, parse_body,
                              prefill_body, request_id, valid_traceparent, validate)
from pdproxy.serving.exchange import Exchange
from pdproxy.stream import ClientGone, ResponseScan, SlowReaders, WholeEventWriter, relay
from pdproxy.telemetry import Recorder, RequestTrace
from pdproxy.telemetry.clock import now
from pdproxy.upstream import Response, UpstreamClient, UpstreamError

if TYPE_CHECKING:
    from pdproxy.kvevents.selective import SelectiveDisaggregation
    from pdproxy.kvevents.tokenize import RemoteTokenizer
    from pdproxy.served import ServedModels

log = logging.getLogger("pdproxy.pd")
_DP_RANK = re.compile(r"\d{1,6}")


class Proxy:
    """What every request needs: settings, pools, the legs' pooled client, admission and the recorder.

    `session` (aiohttp) serves the rest: /v1/models and health checks."""

    def __init__(self, settings: Settings, session: aiohttp.ClientSession, upstream: UpstreamClient,
                 prefill: Pool | None, decode: Pool, admission: Admission, recorder: Recorder,
                 shadow: Any = None) -> None:
        self.settings = settings
        self.session = session
        self.upstream = upstream
        self.prefill = prefill if prefill and len(prefill) else None
        self.decode = decode
        self.admission = admission
        self.recorder = recorder
        self.shadow = shadow  # pdproxy.shadow.Shadow (which imports this module) when --shadow-url
        self.selective: SelectiveDisaggregation | None = None  # when --pd-min-prefill-tokens
        self.tokens: RemoteTokenizer | None = None  # text prompts' ids for routing by events
        self.served: ServedModels | None = None  # what the instances serve (pdproxy/served.py)
        self.slow_readers = SlowReaders(settings.write_timeout)  # started by the server for client traffic
        self._too_slow = f"client left streamed data unread for {settings.write_timeout:g}s"
        self.timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout,
                                             sock_connect=settings.connect_timeout, sock_read=settings.read_timeout)
        # compared as digests: equal lengths, so the comparison time says nothing about the key
        self._key_digest = hashlib.sha256(f"Bearer {settings.api_key}".encode()).digest() if settings.api_key else None

    async def handle(self, client: Exchange, route: Route) -> None:
        """Serve one client request: check it, mirror it if asked, forward it, answer."""
        headers = client.headers
        try:
            rid, id_error = request_id(headers), None
        except ProxyError as err:
            rid, id_error = new_uuid4(), err
        trace = self.recorder.begin(route=route.name, operation=route.operation, chat=route.chat,
                                    headers=self._trace_context(headers), request_id=rid,
                                    pd_mode=self.prefill is not None)
        reply_headers = {"X-Request-Id": rid}
        try:
            if id_error:
                raise id_error
            self.check_head(headers, client.content_length)
            body, raw = await self._read_body(client, route)
            trace.set_request(body)
            if self.served is not None:
                self.served.check(body, route.chat)  # vLLM's refusal, before any prefill is spent on it
            leg_headers = self._leg_headers(headers, trace)
            if self.shadow is not None:
                self.shadow.mirror(body, route, trace, leg_headers)
            view = RequestView(body, headers, route.chat)
            await self.forward(body, route, trace, leg_headers, raw, view, client, reply_headers)
        except (ProxyError, UpstreamResponse) as exc:
            trace.fail(exc.status, exc.error_type, exc.message)
            # after 408, 413 and 415 the rest of that body is not worth reading
            client.answer(*exc.reply(reply_headers), close=exc.status in (408, 413, 415))
        except asyncio.CancelledError:
            trace.client_gone()  # the server cancels the handler when the client disconnects
            raise
        except Exception:
            log.exception("unexpected error serving request %s", rid)
            internal = ProxyError(500, "internal proxy error", error_type="internal")
            trace.fail(internal.status, internal.error_type, internal.message)
            client.answer(*internal.reply(reply_headers))
        finally:
            trace.finish()

    async def forward(self, body: dict[str, Any], route: Route, trace: RequestTrace, headers: dict[str, str],
                      raw: bytes | None = None, view: RequestView | None = None, client: Exchange | None = None,
                      reply_headers: dict[str, str] | None = None) -> None:
        """Admit, choose instances, prefill, run the decode up to its first token and answer `client`.

        The same path serves client requests and their shadow copies (no `client`: the answer is read
        for its timing only). `raw`: the client's bytes of `body` when the decode may get them as they
        are (`protocol.parse_body`); `view`: what the routing policies may read of the request (its
        body and the client's headers).
        """
        view = view or RequestView(body, None, route.chat)
        with self.admission.take() or await self.admission.queue():  # no coroutine unless it queues
            prefill_instance: Instance | None = None
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
            trace.admitted(prefill_instance.address if prefill_instance else None, decode_instance.address)
            kv: dict[str, Any] | None = None
            if prefill_instance is not None:
                with decode_instance.reserved():
                    kv = await self._prefill(body, route, trace, prefill_instance, headers)
            budget = Budget.start(self.settings.decode_retries, self.settings.decode_deadline)
            continuation, tap = self._arm(body, route, trace)
            if tap is not None:
                body, raw = {**body, "return_token_ids": True}, None  # the ids a continuation needs
            attempt = await self._decode(body, raw, Handoff(kv, prefill_instance), route, trace, decode_instance,
                                         headers, budget, tap)
            trace.first_token()
            if client is None:
                try:
                    if attempt.streamed:
                        await relay(attempt.response, None, trace.scan, attempt.tap)
                finally:
                    attempt.close()
                return
            await self._respond(client, attempt, trace, reply_headers or {}, continuation, headers, budget)

    # -- the prefill leg -------------------------------------------------------------------

    async def _prefill(self, body: dict[str, Any], route: Route, trace: RequestTrace, instance: Instance,
                       headers: dict[str, str], rerun: bool = False) -> dict[str, Any] | None:
        """Run the prefill leg (retried elsewhere: nothing of it reaches the client); return its KV coordinates.
        `rerun`: fresh coordinates for a migrated decode (the request's first prefill keeps its span)."""
        pool = self.prefill
        assert pool is not None
        payload = jsonio.dumps(prefill_body(body))
        headers = {**headers, **trace.leg_headers(PREFILL)}
        tries, budget = 1, None
        while True:
            trace.prefill_sent(instance.address, tries)
            outcome = await self._prefill_once(instance, route, payload, headers)
            if not isinstance(outcome, Failure):
                break
            trace.prefill_failed(instance.address, tries, outcome.error.error_type)
            budget = budget or Budget.start(self.settings.prefill_retries, 0)
            instance = await retry(pool, instance, outcome, budget, tries, self.settings.retry_backoff,
                                   self.settings.max_retry_wait)
            tries += 1
        pool.succeeded(instance)
        params, status = outcome
        if rerun:
            trace.prefill_rerun(instance.address)
        else:
            trace.prefill_done(instance.address, status, tries, "received" if params else "missing")
        return params

    async def _prefill_once(self, inst: Instance, route: Route, payload: bytes,
                            headers: dict[str, str]) -> tuple[dict[str, Any] | None, int] | Failure:
        """One prefill attempt: its KV coordinates and status, or why it failed."""
        inst.inflight += 1
        try:
            resp = await self.upstream.post(inst.url, route.path, payload, headers)
            try:
                raw = await resp.read()
            finally:
                resp.release()  # pooled when read to its end, else closed (a cancel aborts the prefill)
        except UpstreamError as exc:
            return transport_failure(PREFILL, inst, exc)
        finally:
            inst.inflight -= 1
        if resp.status >= 300:
            return status_failure(PREFILL, inst, resp.status, resp.headers, raw)
        try:
            return kv_params(raw, inst), resp.status
        except ProxyError as err:
            return Failure(err)  # a broken answer: another instance may do better

    # -- the decode leg --------------------------------------------------------------------

    async def _decode(self, body: dict[str, Any], raw: bytes | None, handoff: Handoff, route: Route,
                      trace: RequestTrace, instance: Instance, headers: dict[str, str], budget: Budget,
                      tap: TokenTap | None) -> Attempt:
        """Send the decode leg and read its answer up to the first token (or whole, unstreamed). Nothing
        has reached the client yet, so a failure is retried on another instance, with fresh KV
        coordinates from a new prefill unless the failed one provably never got the request."""
        leg_headers = {**headers, **trace.leg_headers(DECODE)}
        timeout = self.settings.first_token_timeout if body.get("stream") else 0  # an answer's first byte is its last
        tries = 1
        try:
            while True:
                if tries > 1 or tap is not None and tap.splice:
                    trace.migrating(BEFORE_FIRST_TOKEN if tries > 1 else MID_STREAM, instance.address)
                if not handoff.reusable:
                    handoff = await self._reprefill(body, route, trace, handoff, headers)
                instance.inflight += 1  # an answer at its commit point takes it along (Attempt.close)
                trace.decode_sent(instance.address)
                if tap is None or not tap.splice:
                    trace.scan = ResponseScan(route.chat)  # nothing of a failed attempt counts
                try:
                    outcome = await self._decode_once(instance, body, raw, handoff.params, route, trace, leg_headers,
                                                      tap.fresh() if tap is not None else None, timeout)
                except BaseException:
                    instance.inflight -= 1  # the client's disconnect cancels us here
                    raise
                if not isinstance(outcome, Failure):
                    self.decode.succeeded(instance)
                    return outcome
                instance.inflight -= 1
                trace.decode_failed(instance.address, outcome.error.error_type,
                                    handoff.spent(outcome.reached and outcome.outlier))
                instance = await retry(self.decode, instance, outcome, budget, tries, self.settings.retry_backoff,
                                       self.settings.max_retry_wait)
                tries += 1
        except (ProxyError, UpstreamResponse) as failed:
            trace.handoff_abandoned(handoff.spent(True), failed.error_type)  # no decode will pull its blocks now
            raise

    async def _decode_once(self, inst: Instance, body: dict[str, Any], raw: bytes | None,
                           kv: dict[str, Any] | None, route: Route, trace: RequestTrace,
                           headers: dict[str, str], tap: TokenTap | None, timeout: float) -> Attempt | Failure:
        """One decode attempt up to its commit point, within `timeout` seconds (0: none)."""
        deadline = Deadline(timeout) if timeout else None
        try:
            try:
                upstream = await self.upstream.post(inst.url, route.path, decode_payload(body, raw, kv), headers)
            except UpstreamError as exc:
                return transport_failure(DECODE, inst, exc)
            trace.decode_headers(upstream.status)
            if upstream.status >= 300:
                try:
                    answer = await upstream.read()
                except UpstreamError:
                    answer = b""
                finally:
                    upstream.release()
                return status_failure(DECODE, inst, upstream.status, upstream.headers, answer, kv_sent=kv is not None)
            streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")
            try:
                head = await (read_head(upstream, trace.scan, tap) if streamed else self._whole(upstream, trace))
            except ProxyError as err:
                upstream.close()  # vLLM aborts the request and frees its KV
                return Failure(err, charged=err.error_type != "timeout")  # silence: as transport_failure says
            except BaseException:
                upstream.close()
                raise
            return Attempt(inst, upstream, head, streamed, tap)
        except asyncio.CancelledError:
            if deadline is None or not deadline.end(cancelled=True):
                raise
            return Failure(first_token_timeout(timeout))
        finally:
            if deadline is not None:
                deadline.end()

    async def _reprefill(self, body: dict[str, Any], route: Route, trace: RequestTrace, spent: Handoff,
                         headers: dict[str, str]) -> Handoff:
        """Fresh KV coordinates for the next decode: the prefill again, on another instance where there is one."""
        assert self.prefill is not None
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
        prefill the prompt plus the tokens delivered, decode the rest. Raises why it cannot (the
        client has its 200: an instance's status cannot follow, its error goes in the stream)."""
        broken.close()  # vLLM aborts the request when its connection closes
        if failure.error_type != "timeout":
            self.decode.failed(broken.instance)
        if continuation is None or broken.tap is None or failure.error_type not in MIGRATABLE:
            raise failure
        trace.migration_refusal = continuation.obstacle(broken.tap)
        if trace.migration_refusal or not budget.take():
            raise failure
        trace.decode_failed(broken.instance.address, failure.error_type, abandoned=None)
        body, tap = continuation.body_after(broken.tap), broken.tap.continued()
        try:
            handoff = Handoff(None, None)
            if self.prefill:  # the prompt and the tokens delivered, prefilled anew
                prefill = self.prefill.choose()
                handoff = Handoff(await self._prefill(body, COMPLETIONS, trace, prefill, headers, rerun=True), prefill)
            instance = self.decode.choose(exclude=broken.instance)
            return await self._decode(body, None, handoff, COMPLETIONS, trace, instance, headers, budget, tap)
        except UpstreamResponse as answer:
            raise answer.in_stream() from None

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

    async def _respond(self, client: Exchange, attempt: Attempt, trace: RequestTrace,
                       reply_headers: dict[str, str], continuation: Continuation | None, headers: dict[str, str],
                       budget: Budget) -> None:
        """Give the client the decode's answer: whole, or relayed as it streams; a stream that breaks
        is continued on another decode when it can be (--migrate-mid-stream), else it ends with an
        error event."""
        try:
            status = attempt.response.status
            content_type = attempt.response.headers.get("content-type", "application/json")
            if not attempt.streamed:
                client.answer(status, attempt.head, {**reply_headers, "Content-Type": content_type})
                return
            client.start(status, {**reply_headers, "Content-Type": content_type, "Cache-Control": "no-cache"})
            writer = WholeEventWriter(client, trace.scan, on_delivered=trace.delivered,
                                      on_cut_off=partial(trace.fail, CLIENT_CLOSED, "client_too_slow", self._too_slow))
            self.slow_readers.writers.add(writer)
            try:
                try:
                    while True:
                        # the status line goes out with the first token; the end too, when that was all
                        await writer.write(attempt.head, end=trace.scan.done and attempt.response.at_eof)
                        try:
                            await relay(attempt.response, writer, trace.scan, attempt.tap)
                            break
                        except ProxyError as err:  # raises when the stream cannot go on elsewhere
                            attempt = await self._migrate(continuation, attempt, err, trace, headers, budget)
                    await writer.flush()
                except ProxyError as err:
                    trace.fail(status, err.error_type, err.message)  # the client already has its 200
                    await client.send(err.sse_event(), end=True)
                await client.send(b"", end=True)  # (when the stream's own end did not end it)
            except (ClientGone, ConnectionError):
                trace.client_gone()  # unless it was cut off for reading too slowly: the first failure stands
            finally:
                self.slow_readers.writers.discard(writer)
        finally:
            attempt.close()

    # -- helpers ----------------------------------------------------------------------------

    def check_head(self, headers: Mapping[str, str], content_length: int | None) -> None:
        """Everything decided from the request head, before a byte of the body is read or invited
        (`100 Continue`, pdproxy/server.py): its encoding, the API key, capacity, the declared size."""
        check_body_encoding(headers)
        self.authenticate(headers)
        self.admission.check()  # saturated: refuse before spending anything on the body
        limit = self.settings.max_body_bytes
        if content_length is not None and content_length > limit:
            raise too_large(limit)  # said so up front: not one byte of it is read

    def _trace_context(self, headers: Mapping[str, str]) -> Any:
        """The headers the request's trace continues from: none when `traceparent` is invalid (W3C
        Trace Context: ignore it and start a new trace), which is counted."""
        if valid_traceparent(headers):
            return headers
        self.recorder.metrics.invalid_traceparent.inc()
        return {}

    def authenticate(self, headers: Mapping[str, str]) -> None:
        """Check the client's API key (when --api-key is set); also guards the debug endpoint."""
        if self._key_digest is None:
            return
        given = headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(hashlib.sha256(given).digest(), self._key_digest):
            raise ProxyError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                             error_type="unauthorized")

    async def _read_body(self, client: Exchange, route: Route) -> tuple[dict[str, Any], bytes | None]:
        """The body as a checked JSON object, read within --body-timeout and --max-body-bytes; and its
        bytes when the decode leg may get them as they are."""
        raw = await client.read_body(self.settings.max_body_bytes, self.settings.body_timeout)
        if not raw.strip():
            raise bad_request("request body is empty; send a JSON object")
        body, forward = parse_body(raw)
        return validate(body, route, self.settings.client_kv_params), forward

    def _leg_headers(self, client_headers: Mapping[str, str], trace: RequestTrace) -> dict[str, str]:
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

