"""The aiohttp application: routes, start-up and shutdown, and errors as OpenAI-style JSON."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from pdproxy import __version__, compiled, kvevents, membership, policies, routing, workers
from pdproxy.admission import Admission
from pdproxy.config import Settings
from pdproxy.errors import ProxyError, error_body
from pdproxy.listener import handler_options, listen
from pdproxy.pd import Proxy
from pdproxy.pool import DECODE, PREFILL, HealthChecker, Pool
from pdproxy.protocol import CHAT, COMPLETIONS, check_body_encoding
from pdproxy.runtime import LoopLag, tune_gc, tune_malloc
from pdproxy.served import ServedModels
from pdproxy.serving import AioExchange
from pdproxy.telemetry import check_trace_file, trace_destination
from pdproxy.telemetry import setup as setup_telemetry
from pdproxy.telemetry import status as telemetry_status
from pdproxy.telemetry.clock import now
from pdproxy.telemetry.metrics import merge_expositions
from pdproxy.upstream import UpstreamClient

log = logging.getLogger("pdproxy")

PROXY_KEY = web.AppKey("proxy", Proxy)
WORKER_KEY = web.AppKey("worker", workers.WorkerInfo)
LOOP_LAG_KEY = web.AppKey("loop_lag", LoopLag)
KV_EVENTS_KEY = web.AppKey("kv_events", kvevents.Following)  # its `current`: None while events are off
MEMBERSHIP_KEY = web.AppKey("membership", membership.Membership)
ADMIN_KEY = web.AppKey("admin", membership.AdminAPI)
SHUTDOWN_GRACE = 10.0  # seconds in-flight requests get to finish on SIGTERM


def create_app(settings: Settings) -> web.Application:
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[json_errors])
    app.cleanup_ctx.append(lambda app: _lifecycle(app, settings))
    app.router.add_post(COMPLETIONS.path, _inference(COMPLETIONS), expect_handler=expect_continue)
    app.router.add_post(CHAT.path, _inference(CHAT), expect_handler=expect_continue)
    app.router.add_get("/healthcheck", healthcheck)
    app.router.add_get("/health", health)
    app.router.add_get("/status", status)
    app.router.add_get("/v1/models", models)
    for path in TOKENIZER_PATHS:
        app.router.add_post(path, tokenizer)
    app.router.add_get("/metrics", metrics)
    if settings.admin_api:
        membership.admin_routes(app, ADMIN_KEY)
    if settings.debug_endpoints:
        app.router.add_get("/debug/runtime", debug_runtime)
    return app


async def _lifecycle(app: web.Application, settings: Settings):
    """One pooled session, the pools, health checks and telemetry for the app's lifetime."""
    recorder, tracing = setup_telemetry(settings)
    keep = settings.upstream_keep_alive  # health checks and /v1/models meet the same idle timeouts as the legs
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True,
                                     **({"keepalive_timeout": keep} if keep > 0 else {"force_close": True}))
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",))
    upstream = UpstreamClient(settings.connect_timeout, settings.read_timeout,  # the two legs (pdproxy/upstream.py)
                              keepalive=settings.upstream_keep_alive)
    ejection = {"eject_after": settings.eject_after_failures, "eject_seconds": settings.eject_seconds,
                "max_ejection_percent": settings.max_ejection_percent}
    params = policies.params_of(settings)
    # the pools start empty: membership (pdproxy/membership) puts the flags' instances in before serving,
    # and those found or added at run time as they come
    prefill = (Pool(PREFILL, [], policies.create(settings.prefill_policy, params), **ejection)
               if settings.mode == "pd" else None)
    decode = Pool(DECODE, [], policies.create(settings.decode_policy, params), **ejection)
    pools = [p for p in (prefill, decode) if p is not None]
    admission = Admission(settings.max_inflight, settings.max_queue, settings.queue_timeout)
    auth = {"Authorization": f"Bearer {settings.upstream_api_key}"} if settings.upstream_api_key else {}
    checker = None
    if settings.health_check_interval > 0:
        checker = HealthChecker(pools, session, settings.health_check_path, settings.health_check_interval,
                                settings.health_check_timeout, auth)
    following = app[KV_EVENTS_KEY] = kvevents.Following(settings, recorder.metrics.registry, pools, recorder.stalls,
                                                        decode.has_address)
    members = app[MEMBERSHIP_KEY] = membership.start(settings, pools, following, recorder.metrics, checker)
    await members.start()  # the flags' instances in the pools; discovery goes on
    recorder.metrics.watch(
        lambda: [(p.role, i.address, i.inflight, i.healthy) for p in pools for i in p.instances],
        lambda: (admission.inflight, admission.waiting),
    )
    recorder.metrics.watch_engine_reads(
        lambda: [(p.role, i.address, p.policy.failures.get(i.url, 0)) for p in pools
                 if hasattr(p.policy, "failures") for i in p.instances])
    recorder.metrics.registry.register(membership.Collector(members))
    kv_events = following.current
    router = routing.build(settings, session, prefill, decode, kv_events, recorder.metrics, auth)
    shadow = None
    if settings.shadow_url:
        from pdproxy.shadow import Shadow

        shadow = Shadow(settings, session, upstream, recorder)
    proxy = app[PROXY_KEY] = Proxy(settings, session, upstream, router, admission, recorder, shadow)
    proxy.slow_readers.start()
    lag = app[LOOP_LAG_KEY] = LoopLag()
    if settings.debug_endpoints:
        lag.start()
    if checker is not None:
        checker.start()
    if settings.admin_api:
        key = settings.admin_api_key or settings.api_key
        app[ADMIN_KEY] = membership.AdminAPI(members, key, settings.mode == "pd", forward=_forwarder(app))
    for pool in pools:
        pool.start(session, auth)  # load_aware reads the engines' /metrics
    # what the instances serve: checked before a prefill, and the model names that may label telemetry
    proxy.served = ServedModels(recorder.models, [*settings.served_model_name, *filter(None, [settings.model])])
    learning = asyncio.create_task(proxy.served.watch(
        session, lambda: [i.url for p in pools for i in p.instances], auth, settings.health_check_interval,
        settings.health_check_timeout), name="served-models")
    yield
    learning.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await learning
    await members.stop()
    await proxy.slow_readers.stop()
    await following.stop()
    await lag.stop()
    if checker:
        await checker.stop()
    for pool in pools:
        await pool.stop()
    if shadow is not None:
        await shadow.close()
    await upstream.close()
    await session.close()
    recorder.flush()  # records waiting for their stalls' attribution window, before their spans can go
    if tracing is not None:
        await tracing.shutdown()


def _forwarder(app: web.Application) -> membership.admin.Forward | None:
    """With --workers N: an admin change made in one worker, applied in the others too."""
    def forward(action: str, fields: dict) -> Awaitable[list[str]]:
        return workers.forward_admin(app[WORKER_KEY], action, fields)
    return forward if WORKER_KEY in app else None


def _inference(route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An inference route through aiohttp's application: the requests the lean server hands over
    (pdproxy/serving/lean.py), served by the same flow."""
    async def handler(request: web.Request) -> web.StreamResponse:
        client = AioExchange(request)
        await request.app[PROXY_KEY].handle(client, route)
        assert client.response is not None, "Proxy.handle answers every request"
        return client.response

    _TRACED_HANDLERS.add(handler)
    return handler


_TRACED_HANDLERS: set[Callable] = set()  # they check the request head themselves (Intake.check_head), traced
INFERENCE_ROUTES = {COMPLETIONS.path.encode(): COMPLETIONS, CHAT.path.encode(): CHAT}


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` on an inference route: invite the body only when the head passes the
    checks made before reading it (encoding, key, capacity, declared size). Otherwise say nothing:
    the handler then refuses the request (traced and counted) without waiting for the body."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        return web.json_response(error_body("only 'Expect: 100-continue' is understood", 417), status=417)
    try:
        request.app[PROXY_KEY].intake.check_head(request.headers, request.content_length)
    except ProxyError:
        return None
    if request.version >= aiohttp.HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim answer is not the response (aiohttp's own handler does this)
    return None


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """Unknown routes, wrong methods and unexpected failures answer in OpenAI's error shape; a
    compressed body is refused on every route, before it is read (the inference routes do it in
    Proxy.handle, which traces the refusal)."""
    try:
        if request.match_info.handler not in _TRACED_HANDLERS:
            check_body_encoding(request.headers)
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        message = {404: f"no route {request.path}", 405: f"method {request.method} is not allowed on {request.path}"}
        return web.json_response(error_body(message.get(exc.status, exc.reason), exc.status), status=exc.status,
                                 headers=headers)
    except ProxyError as err:
        response = err.response()
        if err.status == 415:
            response.force_close()
        return response


async def healthcheck(request: web.Request) -> web.Response:
    """vLLM toy proxy's shape."""
    proxy = request.app[PROXY_KEY]
    return web.json_response({"status": "ok", "prefill_instances": len(proxy.prefill or ()),
                              "decode_instances": len(proxy.decode)})


async def health(request: web.Request) -> web.Response:
    """200 while every role has an instance that passes its active health check, else 503 (load
    balancers take the proxy out). Passive ejections do not count: requests cause them, and a few
    requests (a client's, even) must not take the whole proxy out; panic routing still serves then."""
    proxy = request.app[PROXY_KEY]
    pools = [p for p in (proxy.prefill, proxy.decode) if p is not None]
    roles = {p.role: sum(i.probe_ok for i in p.instances) for p in pools}
    ejected = {p.role: sum(i.ejected for i in p.instances) for p in pools}
    ok = all(roles.values())
    return web.json_response({"status": "ok" if ok else "unavailable", "healthy_instances": roles,
                              "ejected_instances": ejected}, status=200 if ok else 503)


async def status(request: web.Request) -> web.Response:
    """vLLM demo proxy's shape, plus health and load per instance."""
    proxy = request.app[PROXY_KEY]
    prefill = proxy.prefill.instances if proxy.prefill else []
    decode = proxy.decode.instances

    members = request.app[MEMBERSHIP_KEY]

    def describe(pool):
        if pool is None:
            return []
        scores = pool.policy.status(pool.instances)
        return [{"url": i.url, "healthy": i.healthy, "ejected": i.ejected, "inflight": i.inflight,
                 "policy": pool.policy.name, "scores": scores.get(i.address, {}), **members.describe(i)}
                for i in pool.instances]

    return web.json_response({
        "prefill_node_count": len(prefill), "decode_node_count": len(decode),
        "prefill_nodes": [i.address for i in prefill], "decode_nodes": [i.address for i in decode],
        "instances": {"prefill": describe(proxy.prefill), "decode": describe(proxy.decode)},
        "mode": proxy.settings.mode, "version": __version__,
        "tracing": trace_destination(proxy.settings).as_dict(),
        "telemetry": telemetry_status(proxy.recorder),
        "shadow": proxy.shadow.status() if proxy.shadow is not None else None,
        "model_labels": proxy.recorder.models.describe(),
        "served_models": proxy.served.describe() if proxy.served is not None else None,
        "membership": members.status(),
        "kv_events": events.status() if (events := request.app[KV_EVENTS_KEY].current) is not None else None,
        "compiled": compiled.report(),
    })


async def models(request: web.Request) -> web.Response:
    """Forwarded to a decode instance, so clients see the served model names."""
    proxy = request.app[PROXY_KEY]
    try:
        proxy.intake.authenticate(request.headers)  # as vLLM guards all of /v1 with its --api-key
        instance = proxy.decode.choose()
        headers = {}
        if proxy.settings.upstream_api_key:
            headers["Authorization"] = f"Bearer {proxy.settings.upstream_api_key}"
        async with proxy.session.get(instance.url + "/v1/models", headers=headers, timeout=proxy.timeout) as resp:
            body = await resp.read()
            return web.Response(status=resp.status, body=body,
                                headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
    except ProxyError as err:
        return err.response()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        if proxy.settings.model:
            return web.json_response({"object": "list", "data": [{"id": proxy.settings.model, "object": "model",
                                                                  "owned_by": "vllm"}]})
        err = ProxyError(502, f"decode instance did not answer /v1/models ({type(exc).__name__})",
                         error_type="connect_error")
        return err.response()


TOKENIZER_PATHS = ("/tokenize", "/detokenize")


async def tokenizer(request: web.Request) -> web.Response:
    """vLLM's /tokenize and /detokenize, answered by a decode instance (clients size prompts in the
    served model's tokens through the proxy as through vLLM). The body goes as it came; the status and
    body come back as the instance gave them; one span records it. They pass the checks and the
    admission of the inference routes (--max-inflight counts them), and a call refused before
    admission is traced within --trace-rejected-rate, like a refused completion: a flood of them
    cannot push real spans out of the export queue."""
    proxy = request.app[PROXY_KEY]
    start = now()
    address = None
    admitted = False
    try:
        proxy.intake.check_head(request.headers, request.content_length)  # encoding, API key, capacity, declared size
        try:
            async with asyncio.timeout(proxy.settings.body_timeout):
                raw = await request.read()
        except TimeoutError:
            raise ProxyError(408, f"request body not received within {proxy.settings.body_timeout:g}s",
                             error_type="body_timeout") from None
        headers = {"Content-Type": "application/json"}
        if proxy.settings.upstream_api_key:
            headers["Authorization"] = f"Bearer {proxy.settings.upstream_api_key}"
        elif not proxy.settings.api_key and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        with proxy.admission.take() or await proxy.admission.queue():
            admitted = True
            instance = proxy.decode.choose()
            address = instance.address
            async with proxy.session.post(instance.url + request.path, data=raw, headers=headers,
                                          timeout=proxy.timeout) as resp:
                body = await resp.read()
        proxy.recorder.forwarded(request.path, request.headers, address, resp.status, start,
                                 None if resp.status < 400 else f"upstream_{resp.status // 100}xx")
        return web.Response(status=resp.status, body=body,
                            headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
    except ProxyError as err:
        proxy.recorder.forwarded(request.path, request.headers, address, err.status, start, err.error_type,
                                 refused=not admitted)
        return err.response()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        err = ProxyError(502, f"decode instance {address} did not answer {request.path} ({type(exc).__name__})",
                         error_type="connect_error", stage=DECODE)
        proxy.recorder.forwarded(request.path, request.headers, address, err.status, start, err.error_type)
        return err.response()


async def debug_runtime(request: web.Request) -> web.Response:
    """What the process holds (pdproxy/runtime.py), for leak checks; behind --api-key when set."""
    from pdproxy.runtime import snapshot

    proxy = request.app[PROXY_KEY]
    try:
        proxy.intake.authenticate(request.headers)
    except ProxyError as err:
        return err.response()
    return web.json_response({**snapshot(proxy), "loop_lag_max_seconds": request.app[LOOP_LAG_KEY].take()})


async def metrics(request: web.Request) -> web.Response:
    """This process's metrics; with --workers, every worker's merged (pdproxy/workers.py)."""
    accept = request.headers.get("Accept", "")
    own = request.app[PROXY_KEY].recorder.metrics.exposition
    worker = request.app.get(WORKER_KEY)
    if worker is None:
        body, content_type = own(accept)
    else:
        texts = [own("application/openmetrics-text")[0].decode(), *await workers.sibling_expositions(worker)]
        body, content_type = merge_expositions(texts, accept)
    return web.Response(body=body, headers={"Content-Type": content_type})


# -- running ------------------------------------------------------------------------------


def serve(settings: Settings) -> int:
    """Run until SIGINT/SIGTERM; with --workers N, N processes share the port (pdproxy/workers.py)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        traces = trace_destination(settings)
        trace_file_warning = check_trace_file(settings)
    except ValueError as exc:
        print(f"pdproxy serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        sock = workers.bind(settings.host, settings.port, reuse_port=settings.workers > 1)
    except OSError as exc:
        print(f"pdproxy serve: error: cannot listen on {settings.host}:{settings.port}: {exc.strerror}",
              file=sys.stderr)
        return 2
    log.info("pdproxy %s listening on http://%s:%d (%s mode: %d prefill, %d decode given, %d worker(s))",
             __version__, settings.host, sock.getsockname()[1], settings.mode, len(settings.prefill_urls),
             len(settings.decode_urls), settings.workers)
    if settings.ignored_flags:
        log.warning("vllm-router flag(s) with no effect here: %s (see `pdproxy serve --help`)",
                 ", ".join(sorted(set(settings.ignored_flags))))
    # said at warning level when nobody chose it: a proxy with no trace destination records no spans at all
    quiet = traces.enabled or not settings.tracing
    log.log(logging.INFO if quiet else logging.WARNING, "%s", traces.summary())
    if trace_file_warning:
        log.warning("%s", trace_file_warning)
    if settings.shadow_url:
        from pdproxy.shadow import describe

        log.info("%s", describe(settings))
    # a stale or partial build runs code other than the sources beside it, a failed compile fell back: said louder
    form = compiled.report()
    log.log(logging.WARNING if compiled.warns(form) else logging.INFO, "%s", compiled.summary(form))
    if settings.workers == 1:
        return _run_worker(settings, sock, None)
    return workers.run_workers(settings.workers, sock, settings.host,
                               lambda worker_sock, info: _run_worker(settings, worker_sock, info))


def _run_worker(settings: Settings, sock: socket.socket, worker: workers.WorkerInfo | None) -> int:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    tune_gc()  # after the imports: start-up's objects out of the collector's way
    tune_malloc()
    return asyncio.run(_serve_forever(settings, sock, worker))


async def _serve_forever(settings: Settings, sock: socket.socket, worker: workers.WorkerInfo | None) -> int:
    app = create_app(settings)
    private = None
    if worker is not None:
        app[WORKER_KEY] = worker
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE, **handler_options(settings))
    await runner.setup()
    if worker is not None:
        app[PROXY_KEY].recorder.metrics.process.worker = str(worker.index)  # each worker's process_* series
        admin = app.get(ADMIN_KEY)
        private = await workers.serve_private(worker, app[PROXY_KEY].recorder.metrics.exposition,
                                              admin.apply if admin is not None else None)
    # plain inference POSTs on pdproxy's own protocol, everything else on aiohttp's (pdproxy/listener.py)
    listening, lean = await listen(runner, sock, settings, INFERENCE_ROUTES, app[PROXY_KEY].handle)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    listening.close()
    if private is not None:
        await private.cleanup()
    await lean.shutdown(SHUTDOWN_GRACE)  # aiohttp's requests go on meanwhile: its grace then is what is left
    await runner.cleanup()  # the app's teardown (pools, legs' client, telemetry) comes last
    return 0

