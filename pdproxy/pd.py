"""The prefill → decode flow for one request, top to bottom.

    client ─► pdproxy ─► prefill instance   (max_tokens=1, stream=false, kv_transfer_params{do_remote_decode})
                     └─► decode instance    (client's body + prefill's kv_transfer_params, streamed back)

Where the request goes (its decode, and its prefill unless there is no prefill pool or it is sent
decode-only) is `pdproxy/routing/`'s one decision, asked for once. Without prefill instances the request
goes straight to a decode instance: the single-instance baseline. Every step reports to the request's
`RequestTrace`; errors become `ProxyError`s that say which stage failed, answered as JSON before the
response starts and as an SSE error event after.
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
import logging
from functools import partial
from typing import TYPE_CHECKING, Any

import aiohttp

from pdproxy import jsonio
from pdproxy.admission import Admission
from pdproxy.config import Settings
from pdproxy.errors import CLIENT_CLOSED, DECODE, PREFILL, ProxyError, UpstreamResponse
from pdproxy.intake import Intake
from pdproxy.legs import Deadline, Failure, kv_params, retry, status_failure, transport_failure
from pdproxy.migration import (BEFORE_FIRST_TOKEN, MID_STREAM, Attempt, Budget, Continuation, Handoff, TokenTap,
                               MIGRATABLE, arm, first_token_timeout, read_head, read_whole)
from pdproxy.policies import RequestView
from pdproxy.pool import Instance
from pdproxy.protocol import COMPLETIONS, Route, decode_payload, new_uuid4, prefill_body, request_id
from pdproxy.routing import Router
from pdproxy.serving.exchange import Exchange
from pdproxy.stream import ClientGone, ResponseScan, SlowReaders, WholeEventWriter, relay
from pdproxy.telemetry import Recorder, RequestTrace
from pdproxy.upstream import UpstreamClient, UpstreamError

if TYPE_CHECKING:
    from pdproxy.served import ServedModels

log = logging.getLogger("pdproxy.pd")


class Proxy:
    """What every request needs: settings, the router and its pools, the legs' pooled client, admission and the
    recorder. `session` (aiohttp) serves the rest: /v1/models and health checks."""

    def __init__(self, settings: Settings, session: aiohttp.ClientSession, upstream: UpstreamClient,
                 router: Router, admission: Admission, recorder: Recorder, shadow: Any = None) -> None:
        self.settings = settings
        self.session = session
        self.upstream = upstream
        self.router = router
        self.prefill, self.decode = router.prefill, router.decode
        self.admission = admission
        self.recorder = recorder
        self.intake = Intake(settings, admission, recorder)
        self.shadow = shadow  # pdproxy.shadow.Shadow (which imports this module) when --shadow-url
        self.served: ServedModels | None = None  # what the instances serve (pdproxy/served.py)
        self.slow_readers = SlowReaders(settings.write_timeout)  # started by the server for client traffic
        self._too_slow = f"client left streamed data unread for {settings.write_timeout:g}s"
        self.timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout,
                                             sock_connect=settings.connect_timeout, sock_read=settings.read_timeout)

    async def handle(self, client: Exchange, route: Route) -> None:
        """Serve one client request: check it, mirror it if asked, forward it, answer."""
        headers = client.headers
        try:
            rid, id_error = request_id(headers), None
        except ProxyError as err:
            rid, id_error = new_uuid4(), err
        trace = self.recorder.begin(route=route.name, operation=route.operation, chat=route.chat,
                                    headers=self.intake.trace_context(headers), request_id=rid,
                                    pd_mode=self.prefill is not None)
        reply_headers = {"X-Request-Id": rid}
        try:
            if id_error:
                raise id_error
            self.intake.check_head(headers, client.content_length)
            body, raw = await self.intake.read_body(client, route)
            trace.set_request(body)
            if self.served is not None and (asking := self.served.check(body, route.chat)) is not None:
                await asking  # vLLM's refusal before any prefill is spent; a name nobody lists: the instances asked
            leg_headers = self.intake.leg_headers(headers, trace)
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
            placement = await self.router.place(view)
            trace.placed(placement)
            prefill_instance, decode_instance = placement.prefill, placement.decode
            kv: dict[str, Any] | None = None
            if prefill_instance is not None:
                with decode_instance.reserved():
                    kv = await self._prefill(body, route, trace, prefill_instance, headers)
                if decode_instance.draining:  # it began leaving the pool meanwhile: another takes the request
                    decode_instance = self.router.next_decode(exclude=decode_instance)
            budget = Budget.start(self.settings.decode_retries, self.settings.decode_deadline)
            continuation, tap, trace.migration_refusal = (arm(body, route.chat) if self.settings.migrate_mid_stream
                                                          else (None, None, None))
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
        pool = self.router.prefill
        assert pool is not None
        payload = jsonio.dumps(prefill_body(body))
        headers = trace.leg_headers(PREFILL, headers)
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
        leg_headers = trace.leg_headers(DECODE, headers)
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
                head = await (read_head(upstream, trace.scan, tap) if streamed else read_whole(upstream, trace.scan))
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
        instance = self.router.next_prefill(exclude=spent.prefill)
        return Handoff(await self._prefill(body, route, trace, instance, headers, rerun=True), instance)

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
                prefill = self.router.next_prefill()
                handoff = Handoff(await self._prefill(body, COMPLETIONS, trace, prefill, headers, rerun=True), prefill)
            instance = self.router.next_decode(exclude=broken.instance)
            return await self._decode(body, None, handoff, COMPLETIONS, trace, instance, headers, budget, tap)
        except UpstreamResponse as answer:
            raise answer.in_stream() from None

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
