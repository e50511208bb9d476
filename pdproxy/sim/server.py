"""HTTP routes of a simulated instance: the OpenAI endpoints, vLLM's extras, and the /sim controls.

The request path reads top to bottom in `SimServer.generate`: journal, faults, validation,
the front-end delay, the engine, then the response (`_respond` or `_stream`). Response headers
of a stream are only sent once the first token exists, so a request that fails before it
(a KV load failure on a decode, an injected error) still gets a proper HTTP status and an
OpenAI error body instead of an error event inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import socket
import struct
import time
from typing import Any

from aiohttp import web

from pdproxy.sim.engine import Engine, Sequence
from pdproxy.sim.faults import Fault, FaultBook, FaultSpecError, RequestFaults
from pdproxy.sim.kv import HEARTBEAT_PATH, PULL_PATH, KVPuller, PullRejected, RemoteKV, TransferLink
from pdproxy.sim.metrics import SimMetrics
from pdproxy.sim.prefix_cache import block_hashes
from pdproxy.sim.protocol import (APIError, GenerationRequest, error_body, parse_detokenize, parse_generation,
                                  parse_json, parse_tokenize)
from pdproxy.sim.render import DONE, Renderer, request_metrics, usage
from pdproxy.sim.settings import SimSettings
from pdproxy.sim.timing import FrontEnd, GPUShareFile, PreciseClock, kv_bytes
from pdproxy.sim import tokens
from pdproxy.sim.generation import Generation

log = logging.getLogger("pdproxy.sim")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_dumps = functools.partial(json.dumps, separators=(",", ":"))


class Journal:
    """The last N inference requests exactly as received, for tests of what a proxy sent.

    Bodies are kept as the raw bytes and parsed when the journal is read: a thousand parsed
    prompts of token ids are millions of objects for the garbage collector to walk, and its
    pauses would show up as stalls in every stream.
    """

    def __init__(self, size: int) -> None:
        self.entries: collections.deque[tuple[str, str, dict[str, str], bytes, float]] = collections.deque(maxlen=size)

    def record(self, request: web.Request, raw: bytes, received_at: float) -> None:
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.entries.append((request.method, request.path, headers, raw, received_at))

    def to_json(self) -> list[dict[str, Any]]:
        out = []
        for method, path, headers, raw, received_at in self.entries:
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                body = None
            out.append({"method": method, "path": path, "headers": headers, "body": body,
                        "received_at": received_at})
        return out


class SimServer:
    def __init__(self, settings: SimSettings) -> None:
        self.settings = s = settings
        self.metrics = SimMetrics(s.model)
        self.clock = PreciseClock()
        self.puller = None
        if s.has_connector and not s.skip_kv_pull:
            self.puller = KVPuller(s.engine_id, self.metrics, self.clock, s.scaled(s.preset.kv_pull_overhead_ms),
                                   s.kv_lease_seconds)
        gpu = GPUShareFile(s.gpu_share_file, s.preset.gpu_share) if s.gpu_share_file and s.preset.gpu_share > 0 \
            else None
        self.engine = Engine(s, self.metrics, self.clock, self.puller, gpu)
        self.gpu = gpu
        self.kv_events = None
        if s.kv_events is not None and s.enable_prefix_caching:  # vLLM publishes only with prefix caching on
            from pdproxy.sim.kv_events import SimKVEvents

            self.kv_events = self.engine.prefix_cache.events = SimKVEvents(s.kv_events, s.preset.block_size)
        self.link = TransferLink.outgoing(s, self.clock, self.gpu)  # its copies keep this instance busy on the GPU
        self.faults = FaultBook(s.faults, s.seed)
        self.journal = Journal(s.journal_size)
        # the API server's time, growing with its load
        self.frontend = FrontEnd(s.preset, s.time_scale, seed=s.seed or 0)
        tokens.configure(s.tokens_per_word)
        self._engine_task: asyncio.Task[None] | None = None
        self.tracer = None
        if s.otlp_traces_endpoint or s.otlp_traces_file:
            from pdproxy.sim.tracing import RequestTracer

            self.tracer = RequestTracer(s.otlp_traces_endpoint, s.otlp_traces_file, s.preset.name,
                                        default_service=f"vllm-{s.role}-{s.port}", time_scale=s.time_scale)

    # ---- application -----------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_errors_as_json])
        app.add_routes([
            web.post(COMPLETIONS, self.generate),
            web.post(CHAT, self.generate),
            web.get("/v1/models", self.models),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
            web.get("/version", self.version),
            web.get("/sim/requests", self.journal_get),
            web.delete("/sim/requests", self.journal_clear),
            web.get("/sim/faults", self.faults_get),
            web.post("/sim/faults", self.faults_add),
            web.delete("/sim/faults", self.faults_clear),
            web.get("/sim/state", self.state),
            web.post(PULL_PATH, self.kv_pull),
            web.post(HEARTBEAT_PATH, self.kv_heartbeat),
        ])
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._engine_task = asyncio.create_task(self.engine.run(), name="sim-engine")
        if self.kv_events is not None:
            self.kv_events.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._engine_task:
            self._engine_task.cancel()
            try:
                await self._engine_task
            except asyncio.CancelledError:
                pass
        await self.engine.close()
        if self.kv_events is not None:
            await self.kv_events.close()
        if self.tracer is not None:
            self.tracer.close()
        if self.puller:
            await self.puller.close()

    # ---- inference ---------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrival = self.clock.now()
        received_at = time.time()
        raw = await request.read()
        try:
            body: Any = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
        self.journal.record(request, raw, received_at)
        streaming = isinstance(body, dict) and body.get("stream") is True
        faults = self.faults.draw(request.path, streaming)
        if faults.refuse or self.settings.refuse_connections:
            return self._reset(request)
        if faults.slow_start:
            await self.clock.sleep(faults.slow_start)
        if faults.error is not None:
            return self._injected_error(faults.error)

        s = self.settings
        try:
            if body is None:
                parse_json(raw)  # raises with the parser's message
            kind = "chat" if request.path == CHAT else "completion"
            req, target, reason = parse_generation(kind, body, request.headers, s.model, s.preset.max_model_len,
                                                   s.vocab_size, s.eos_after_tokens)
            remote, hold_kv = self._kv_role(req, faults)
        except APIError as exc:
            return _json(exc.body(), exc.status)
        if hold_kv:
            target, reason = 1, "length"  # a prefill for a remote decode stops after one token

        frontend = self.frontend
        if not s.instant:  # the API server's share of TTFT, parsing above included
            await self.clock.sleep_until(arrival + faults.slow_start + frontend.intake(arrival + faults.slow_start))
        seq = Sequence(req.internal_id, req.prompt_tokens, target, reason, arrival, hold_kv=hold_kv,
                       remote=remote if self.puller else None, kv_fail=faults.kv_load_failure,
                       block_hashes=self._block_hashes(req, remote))
        if remote is not None and self.puller is None:  # --skip-kv-pull: trust the params
            seq.kv_loaded = True
            seq.num_computed = req.prompt_tokens - 1
        submitted = self.clock.now()
        self.engine.submit(seq)
        frontend.in_flight += 1
        try:
            if req.stream:
                return await self._stream(request, req, seq, faults)
            return await self._respond(request, req, seq, faults)
        finally:
            frontend.in_flight -= 1
            if not seq.finished:
                self.engine.abort(seq)  # client went away (handler cancelled) or the write failed
            elif self.tracer is not None and seq.finish_reason in ("length", "stop"):
                self.tracer.finished(request.headers, seq, req.internal_id.rsplit("-", 1)[0], submitted,
                                     {"top_p": body.get("top_p", 1), "max_tokens": req.max_tokens,
                                      "temperature": body.get("temperature"), "n": body.get("n", 1)})

    def _block_hashes(self, req: GenerationRequest, remote: RemoteKV | None) -> list[int]:
        """What prefix caching needs of the prompt. A decode whose KV comes from a prefill caches the prompt's
        blocks when it arrives (as vLLM's does: the BlockStored of a KV arrival) only when it publishes events,
        so that the simulator without events behaves as it always did."""
        if not self.settings.enable_prefix_caching or (remote is not None and self.puller is not None
                                                       and self.kv_events is None):
            return []
        hashes = block_hashes(req.prompt_ids or [], self.settings.preset.block_size)
        if self.kv_events is not None:
            self.kv_events.register(hashes, req.prompt_ids or [])
        return hashes

    def _kv_role(self, req: GenerationRequest, faults: RequestFaults) -> tuple[RemoteKV | None, bool]:
        """(where to pull the prompt's KV from, whether to hold this request's KV for a decode)."""
        if not self.settings.has_connector or not req.kv_transfer_params:
            return None, False  # like vLLM without --kv-transfer-config: params are ignored
        if req.do_remote_prefill:
            try:
                return RemoteKV.parse(req.kv_transfer_params), False
            except ValueError as exc:
                raise APIError(400, str(exc), "kv_transfer_params") from None
        if req.do_remote_decode:
            return None, not faults.no_kv_params
        return None, False

    def _kv_params(self, seq: Sequence) -> dict[str, Any] | None:
        if seq.held_blocks is None:
            return None
        s = self.settings
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [seq.held_blocks],
                "remote_engine_id": s.engine_id, "remote_request_id": seq.request_id,
                "remote_host": s.kv_remote_host, "remote_port": s.port, "tp_size": s.tp_size,
                "remote_num_tokens": seq.prompt_tokens, "transfer_mode": "pull"}

    def _failure(self, seq: Sequence) -> web.Response | None:
        """The HTTP answer for a sequence that ended without output (decided before any header)."""
        if seq.finish_reason == "error":
            return _json(error_body(500, seq.error or "internal error", None, "InternalServerError"), 500)
        return None

    def _headers(self, request: web.Request, req: GenerationRequest) -> dict[str, str]:
        if not self.settings.enable_request_id_headers:
            return {}
        return {"X-Request-Id": request.headers.get("X-Request-Id") or req.external_id.split("-", 1)[1]}

    async def _respond(self, request: web.Request, req: GenerationRequest, seq: Sequence,
                       faults: RequestFaults) -> web.StreamResponse:
        waiter = seq.wait(seq.target_tokens)
        if waiter is not None:
            await waiter
        failed = self._failure(seq)
        if failed is not None:
            return failed
        await self.clock.sleep(self.frontend.finished(self.clock.now()))  # after the finishes queued before it
        if faults.stall is not None:
            await self.clock.sleep(faults.stall.seconds)
        if faults.disconnect is not None:
            return self._drop(request)
        if faults.die_before_first_token:
            return self._reset(request)
        if faults.malformed is not None:
            return web.Response(body=b'{"id": "cmpl-broken", "choices": [{"text": ', content_type="application/json")
        output = self._generation(req, seq)
        text = output.text(0, seq.num_generated)
        ids = (output.token_ids(0, seq.num_generated), req.prompt_ids) if req.return_token_ids else (None, None)
        metrics = request_metrics(seq) if self.settings.enable_per_request_metrics else None
        body = Renderer(req, int(time.time())).body(text, seq.finish_reason or "length",
                                                    usage(req.prompt_tokens, seq.num_generated),
                                                    self._kv_params(seq), metrics, *ids)
        return _json(body, 200, self._headers(request, req))

    def _generation(self, req: GenerationRequest, seq: Sequence) -> Generation:
        stale = seq.pull is not None and seq.pull.stale  # read freed blocks: the context is garbage
        return Generation(req.prompt_ids, req.sampling_seed, stale_kv=stale)

    async def _stream(self, request: web.Request, req: GenerationRequest, seq: Sequence,
                      faults: RequestFaults) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, **self._headers(request, req)})
        if faults.early_headers:
            await resp.prepare(request)  # real vLLM's order: the status line first, then the KV pull
        waiter = seq.wait(1)
        if waiter is not None:
            await waiter
        failed = self._failure(seq)
        if failed is not None and not resp.prepared:
            return failed
        if faults.die_before_first_token:
            return self._reset(request)
        if faults.stall_before_first_token:
            await self.clock.sleep(faults.stall_before_first_token)
        if not resp.prepared:
            await resp.prepare(request)

        render = Renderer(req, int(time.time()))
        words = self._generation(req, seq)
        with_ids = req.return_token_ids
        prompt_ids = req.prompt_ids if with_ids else None  # on the first chunk only
        prompt = req.prompt_tokens
        continuous = req.continuous_usage
        per_request = self.settings.enable_per_request_metrics
        interval = self.settings.stream_interval
        split = self.settings.instant  # instant: one chunk per `interval` tokens, as if each were a step
        if render.chat:
            await resp.write(render.role_chunk(usage(prompt, 0) if continuous else None, prompt_ids))
            prompt_ids = None
        if faults.any and await self._chunk_faults(request, resp, seq, faults, 0):
            return resp

        sent = chunks = 0
        final_sent = False
        while True:
            available, finished = seq.num_generated, seq.finished
            if available > sent:
                upto = min(available, sent + interval) if split else available
                text = words.text(sent, upto)
                ids = words.token_ids(sent, upto) if with_ids else None
                sent = upto
                use = usage(prompt, sent) if continuous else None
                if finished and sent == available and seq.finish_reason in ("length", "stop"):
                    # the API server finishes the streams that ended before this one first
                    await self.clock.sleep(self.frontend.finished(self.clock.now()))
                    metrics = request_metrics(seq) if per_request and not req.include_usage else None
                    data = render.final_chunk(text, seq.finish_reason, use, self._kv_params(seq), metrics, ids,
                                              prompt_ids)
                    final_sent = True
                else:
                    data = render.content_chunk(text, use, ids, prompt_ids)
                prompt_ids = None
                await resp.write(data)
                chunks += 1
                if faults.any and await self._chunk_faults(request, resp, seq, faults, chunks):
                    return resp
                continue
            if finished:
                break
            waiter = seq.wait(sent + interval)
            if waiter is not None:
                await waiter

        if not final_sent:  # ended without a last token (error after the headers went out)
            await resp.write(b"data: " + _dumps(error_body(500, seq.error or "request aborted")).encode() + b"\n\n")
        elif req.include_usage:
            metrics = request_metrics(seq) if per_request else None
            await resp.write(render.usage_chunk(usage(prompt, sent), metrics))
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def _chunk_faults(self, request: web.Request, resp: web.StreamResponse, seq: Sequence,
                            faults: RequestFaults, chunks: int) -> bool:
        """Apply mid-stream faults due after `chunks` content chunks; True when the stream is over."""
        if faults.malformed is not None and faults.malformed.after_chunks == chunks:
            await resp.write(b'data: {"id": "cmpl-broken", "choices": [{"text": \n\n')
        if faults.stall is not None and faults.stall.after_chunks == chunks:
            await self.clock.sleep(faults.stall.seconds)
        if faults.disconnect is not None and faults.disconnect.after_chunks == chunks:
            self.engine.abort(seq)
            self._drop(request)
            return True
        if faults.die_mid_stream is not None and faults.die_mid_stream.after_chunks == chunks:
            self.engine.abort(seq)
            self._reset(request)
            return True
        return False

    # ---- connection-level faults -------------------------------------------------------------------
    def _drop(self, request: web.Request) -> web.Response:
        """Close the connection mid-response (FIN): the client sees an incomplete body."""
        if request.transport is not None:
            request.transport.close()
        return web.Response(status=500)  # never reaches the client

    def _reset(self, request: web.Request) -> web.Response:
        """Abort the connection with a TCP reset and no response, like an instance that is going down."""
        transport = request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            transport.abort()
        return web.Response(status=500)

    def _injected_error(self, fault: Fault) -> web.Response:
        headers = {} if fault.retry_after is None else {"Retry-After": f"{fault.retry_after:g}"}
        return _json(error_body(fault.status, f"injected fault: HTTP {fault.status}"), fault.status, headers)

    # ---- vLLM's other endpoints ------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        s = self.settings
        return _json({"object": "list", "data": [{
            "id": s.model, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": s.model,
            "parent": None, "max_model_len": s.preset.max_model_len}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `count`, `max_model_len`, `tokens`, `token_strs` (when asked)."""
        s = self.settings
        try:
            ids, strs = parse_tokenize(parse_json(await request.read()), s.model, s.vocab_size)
        except APIError as exc:
            return _json(exc.body(), exc.status)
        return _json({"count": len(ids), "max_model_len": s.preset.max_model_len, "tokens": ids,
                      "token_strs": [tokens.piece(t) for t in ids] if strs else None})

    async def detokenize(self, request: web.Request) -> web.Response:
        s = self.settings
        try:
            ids = parse_detokenize(parse_json(await request.read()), s.model, s.vocab_size)
        except APIError as exc:
            return _json(exc.body(), exc.status)
        return _json({"prompt": tokens.decode(ids)})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        from pdproxy import __version__

        return _json({"version": f"pdproxy-sim {__version__}"})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    # ---- /sim controls -----------------------------------------------------------------------------
    async def journal_get(self, request: web.Request) -> web.Response:
        return _json({"requests": self.journal.to_json()})

    async def journal_clear(self, request: web.Request) -> web.Response:
        self.journal.entries.clear()
        return _json({"cleared": True})

    async def faults_get(self, request: web.Request) -> web.Response:
        return _json({"faults": [f.to_json() for f in self.faults.queued]})

    async def faults_add(self, request: web.Request) -> web.Response:
        try:
            body = parse_json(await request.read())
            if not isinstance(body, dict) or "faults" not in body:
                raise FaultSpecError("body must be {\"faults\": [ ... ]}")
            added = self.faults.add(body["faults"])
        except APIError as exc:
            return _json(exc.body(), exc.status)
        except FaultSpecError as exc:
            return _json(error_body(400, str(exc)), 400)
        return _json({"queued": len(self.faults.queued), "added": [f.to_json() for f in added]})

    async def faults_clear(self, request: web.Request) -> web.Response:
        self.faults.clear()
        return _json({"cleared": True})

    async def state(self, request: web.Request) -> web.Response:
        s = self.settings
        link = self.link
        return _json({
            "role": s.role, "model": s.model, "engine_id": s.engine_id, "preset": s.preset.name,
            "time_scale": s.time_scale, **self.engine.state(),
            "transfers_in_flight": link.in_flight, "transfers_queued": max(0, link.in_flight - 1),
            "transfer_bytes_total": link.bytes_total,
            "faults_queued": len(self.faults.queued), "faults_injected": dict(self.faults.injected),
            "journal_size": len(self.journal.entries), "settings": s.describe(),
        })

    # ---- the prefill's side of a KV pull -----------------------------------------------------------
    async def kv_pull(self, request: web.Request) -> web.Response:
        leases = self.engine.leases
        if leases is None:
            return _json({"reason": "no_connector", "message": "this instance has no KV connector"}, 404)
        try:
            body = parse_json(await request.read())
            engine_id, request_id = body["remote_engine_id"], body["remote_request_id"]
            blocks = body["remote_block_ids"]
        except (APIError, KeyError, TypeError):
            return _json({"reason": "bad_request", "message": "need remote_engine_id, remote_request_id and "
                                                             "remote_block_ids"}, 400)
        try:
            lease = leases.claim(str(engine_id), str(request_id), blocks if isinstance(blocks, list) else [])
        except PullRejected as exc:
            return _json({"reason": exc.reason, "message": exc.message}, exc.status)
        # all of the prompt's blocks, its own and those its prefix cache shares, unless the decode read fewer
        block_size = self.settings.preset.block_size
        blocks = lease.blocks_read if lease.read is not None and lease.read < len(lease.blocks) or not lease.num_tokens \
            else max(lease.blocks_read, -(-lease.num_tokens // block_size))
        nbytes = kv_bytes(self.settings.preset, blocks)
        try:
            queued, total = await self.link.transfer(nbytes)
        finally:
            if not lease.stale:
                leases.release(lease.request_id)  # read (or abandoned): NIXL frees the blocks either way
        return _json({"bytes": nbytes, "blocks": blocks, "tokens": lease.num_tokens,
                      "queued_seconds": round(queued, 6), "transfer_seconds": round(total, 6), "stale": lease.stale})

    async def kv_heartbeat(self, request: web.Request) -> web.Response:
        leases = self.engine.leases
        try:
            body = parse_json(await request.read())
            ok = leases is not None and leases.heartbeat(str(body["remote_engine_id"]), str(body["remote_request_id"]))
        except (APIError, KeyError, TypeError):
            ok = False
        return _json({"extended": ok}, 200 if ok else 404)


@web.middleware
async def _errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    """A bug answers like vLLM's own 500s (an OpenAI error body), never with a traceback."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return _json(error_body(500, "internal simulator error"), 500)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=_dumps(body), status=status, content_type="application/json", headers=headers)
