"""`pdproxy sim`: run one simulated vLLM instance (prefill, decode or single) until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

from aiohttp import web

from pdproxy.sim.faults import FaultRates
from pdproxy.sim.kv_events import parse_config
from pdproxy.sim.presets import DEFAULT_PRESET, PRESETS
from pdproxy.sim.settings import ROLES, SimSettings, preset_with


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Presets: " + "; ".join(f"{p.name}: {p.description}" for p in PRESETS.values())
                     + ". Token rule: 1-3 tokens per word, --tokens-per-word on average (see docs/reference/sim.md).")
    g = parser.add_argument_group("instance")
    g.add_argument("--role", choices=ROLES, default="single",
                   help="prefill, decode (both run a NIXL-like KV connector) or single (no connector: "
                        "the non-disaggregated baseline; kv_transfer_params are ignored). Default: single")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8100, help="port to listen on (default 8100)")
    g.add_argument("--advertise-host", default=None,
                   help="host a decode should pull KV from, put into remote_host (default: --host; when "
                        "--host is a wildcard, this machine's address as its hostname resolves, e.g. the "
                        "container IP)")
    g.add_argument("--model", default="sim-model",
                   help="served model name; requests naming another model get 404 (default sim-model)")
    g.add_argument("--engine-id", default="", help="KV engine id in kv_transfer_params (default: random)")
    g.add_argument("--tp-size", type=int, default=1, help="tp_size reported in kv_transfer_params (default 1)")
    g.add_argument("--seed", type=int, default=None, help="seed of the random faults (default: random)")
    g.add_argument("--journal-size", type=int, default=1000,
                   help="inference requests kept for GET /sim/requests (default 1000, newest last)")

    g = parser.add_argument_group("timing model")
    g.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
                   help=f"calibrated parameter set (default {DEFAULT_PRESET}); 'instant' has no delays and "
                        "no capacity limits, for measuring a proxy's own overhead")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every simulated duration (steps, transfers, overheads) by this; 0.5 runs "
                        "twice as fast. Leases and faults' seconds are wall time. Default 1.0")
    g.add_argument("--frontend-overhead-ms", type=float, default=None,
                   help="per-request API-server latency before the engine queue (preset: 8 ms)")
    g.add_argument("--frontend-request-ms", type=float, default=None,
                   help="API-server intake work per request, done one request at a time: requests arriving "
                        "together queue for it (preset: 1 ms)")
    g.add_argument("--frontend-stream-ms", type=float, default=None,
                   help="extra API-server time of a request's intake per stream the instance is serving "
                        "(preset: 1 ms; recorded vLLM 0.23: ~11 ms beside 4 streams, ~23 ms beside 16)")
    g.add_argument("--frontend-finish-ms", type=float, default=None,
                   help="API-server work of finishing a stream, one stream at a time: streams ending in one step "
                        "reach their clients this far apart (presets: 0, off; recorded vLLM 0.23: 1.0-1.3 ms)")
    g.add_argument("--frontend-jitter-ms", type=float, default=None,
                   help="each request's API-server time up to this much longer, uniformly at random (--seed; "
                        "presets: 0, off; recorded vLLM 0.23: lone requests' spans ~1 ms)")
    g.add_argument("--kv-pull-overhead-ms", type=float, default=None,
                   help="decode-side cost of taking over a remote prefill, besides the transfer (preset: 4 ms)")

    g = parser.add_argument_group("scheduler and KV cache (vLLM flags)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (preset: 16384)")
    _on_off(g, "enable-chunked-prefill", None,
            "split prompts longer than the remaining step budget into chunks (the default, as in vLLM V1)",
            "prompts must fit the remaining budget whole; one longer than the whole budget still runs whole in one "
            "step")
    _on_off(g, "async-scheduling", None,
            "schedule the next step while one runs, as vLLM's engine core does: a prompt arriving mid-step misses "
            "the step already scheduled (preset: off)",
            "schedule each step when the one before it ends")
    _on_off(g, "enable-prefix-caching", True,
            "keep computed prompt blocks and reuse them for prompts with the same prefix (vLLM's automatic prefix "
            "caching; the default, as in vLLM)",
            "compute every prompt in full")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="vLLM's KV-cache events: publish BlockStored/BlockRemoved on a ZMQ PUB socket with a replay "
                        "socket, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
                        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5567\"}' (tcp endpoints always bind)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one step (preset: 1024)")
    g.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV cache size in blocks; requests queue when it is full (preset: 50000; 0 = unbounded)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (preset: 16)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + max_tokens above this gets HTTP 400 (preset: 4608)")

    g = parser.add_argument_group("KV transfer (P/D)")
    g.add_argument("--kv-lease-seconds", type=float, default=30.0,
                   help="how long a prefill holds KV blocks for a decode to read (default 30, like NIXL)")
    g.add_argument("--kv-bandwidth-gbps", type=float, default=None,
                   help="GB/s of this prefill's outgoing KV link; transfers share it one at a time "
                        "(preset: 0.341, two instances on one H200; 11.2 in h200-llama8b-2gpu; 0 = infinite)")
    g.add_argument("--kv-latency-ms", type=float, default=None, help="fixed latency per KV transfer (preset: 4.75; 4.0 in h200-llama8b-2gpu)")
    g.add_argument("--kv-bytes-per-token", type=int, default=None,
                   help="KV bytes per prompt token (preset: 131072, Llama-3.1-8B bf16)")
    stall = g.add_mutually_exclusive_group()
    stall.add_argument("--kv-pull-stalls-decode", dest="kv_pull_stalls_decode", action="store_true", default=None,
                       help="decode: start no engine step for a KV pull's own link time, so the other streams "
                            "stall for the transfer, as recorded on two real H200s (preset: on in h200-llama8b-2gpu, "
                            "off in the others)")
    stall.add_argument("--no-kv-pull-stalls-decode", dest="kv_pull_stalls_decode", action="store_false",
                       help="decode: keep stepping during KV pulls (the one-GPU and instant presets' default)")
    g.add_argument("--kv-intake-gbps", type=float, default=None,
                   help="decode: GB/s at which it takes in a KV that lands while another prefill's pull is still "
                        "in its hands, one at a time (several prefills feeding it at once; 0 = no such intake, "
                        "the presets' default)")
    g.add_argument("--kv-intake-bursts", action="store_true", default=None,
                   help="decode: take KV in by batches: a KV landing while a batch is copied in joins the next, and "
                        "a batch is released when its last KV is in (off in every preset)")
    g.add_argument("--gpu-share", type=float, default=None,
                   help="instances time-sharing one GPU: how much each other instance stepping at the same time "
                        "stretches a step (0 = a GPU of its own, the presets' default; 1 = full time-slicing); "
                        "applies between the instances given the same --gpu-share-file")
    _on_off(g, "kv-link-shares-gpu", None,
            "prefill: the KV it sends is copied on the shared GPU, stretching and stretched by the steps beside it "
            "like one more busy instance (the presets' default)",
            "prefill: its KV copies run beside the steps on the shared GPU, neither slowing nor slowed by them")
    g.add_argument("--gpu-share-file", default=None, metavar="PATH",
                   help="a file the instances on one GPU share (one slot each: when its current step ends)")
    g.add_argument("--skip-kv-pull", action="store_true",
                   help="decode: trust kv_transfer_params without contacting the prefill (no transfer time)")

    g.add_argument("--tokens-per-word", type=float, default=2.3,
                   help="mean tokens of the simulated tokenizer per word, 1 to 3 (default 2.3, what Llama-3's "
                        "tokenizer makes of the bench's words); /tokenize and usage count with it")

    g = parser.add_argument_group("output")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per SSE chunk, like vLLM's --stream-interval (default 1; under load several "
                        "tokens that are ready at once share a chunk, as in vLLM)")
    g.add_argument("--enable-per-request-metrics", action="store_true",
                   help="add vLLM's per-request `metrics` object to responses (final usage chunk of a stream)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="echo X-Request-Id on responses, like vLLM's flag of the same name")
    g.add_argument("--eos-after-tokens", type=int, default=0,
                   help="finish with 'stop' after this many tokens unless ignore_eos (min_tokens respected); "
                        "0 = never (the default: output runs to max_tokens)")

    g = parser.add_argument_group("tracing (vLLM's llm_request span per request)")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="vLLM's flag: export one llm_request span per finished request to this OTLP endpoint "
                        "(gRPC, or OTLP/HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); "
                        "service.name from OTEL_SERVICE_NAME")
    g.add_argument("--otlp-traces-file", default=None, metavar="PATH",
                   help="sim only: append those spans to PATH as OTLP-JSON lines instead (like a Collector's "
                        "file exporter)")

    g = parser.add_argument_group("faults (random, per request; POST /sim/faults queues one-shot faults)")
    g.add_argument("--error-rate", type=float, default=0.0, help="probability of answering with --error-status")
    g.add_argument("--error-status", type=int, default=500, help="HTTP status of injected errors (default 500)")
    g.add_argument("--slow-start-seconds", type=float, default=0.0,
                   help="delay before a request is processed (default 0 = off)")
    g.add_argument("--slow-start-rate", type=float, default=1.0,
                   help="probability of the slow start when --slow-start-seconds is set (default 1)")
    g.add_argument("--stall-seconds", type=float, default=0.0, help="pause of a stream mid-way (default 0 = off)")
    g.add_argument("--stall-rate", type=float, default=1.0,
                   help="probability of the stall when --stall-seconds is set (default 1)")
    g.add_argument("--stall-after-chunks", type=int, default=1, help="content chunks before the stall (default 1)")
    g.add_argument("--disconnect-rate", type=float, default=0.0,
                   help="probability of closing the connection mid-stream (default 0)")
    g.add_argument("--disconnect-after-chunks", type=int, default=1,
                   help="content chunks before the disconnect (default 1)")
    g.add_argument("--kv-load-failure-rate", type=float, default=0.0,
                   help="decode: probability that a KV pull fails (the request gets HTTP 500, like vLLM with "
                        "kv_load_failure_policy=fail)")
    g.add_argument("--refuse-connections", action="store_true",
                   help="reset (TCP RST, no response) every connection carrying an inference request; /health, "
                        "/metrics and /sim/* still answer so the process can be managed. For 'connection "
                        "refused', point the client at a port nothing listens on")


def _on_off(group: Any, flag: str, default: bool | None, on: str, off: str) -> None:
    """vLLM's pair of flags for a switch: --FLAG and --no-FLAG, one destination, exclusive."""
    pair = group.add_mutually_exclusive_group()
    dest = flag.replace("-", "_")
    pair.add_argument(f"--{flag}", dest=dest, action="store_true", default=default, help=on)
    pair.add_argument(f"--no-{flag}", dest=dest, action="store_false", help=off)


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    if args.gpu_share and not args.gpu_share_file:
        raise ValueError("--gpu-share needs --gpu-share-file: the file the instances on one GPU share")
    preset = preset_with(
        args.preset,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=args.enable_chunked_prefill,
        max_num_seqs=args.max_num_seqs, num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size,
        max_model_len=args.max_model_len, kv_bandwidth_gbps=args.kv_bandwidth_gbps, kv_latency_ms=args.kv_latency_ms,
        kv_bytes_per_token=args.kv_bytes_per_token, frontend_overhead_ms=args.frontend_overhead_ms,
        frontend_request_ms=args.frontend_request_ms, frontend_stream_ms=args.frontend_stream_ms,
        frontend_finish_ms=args.frontend_finish_ms, frontend_jitter_ms=args.frontend_jitter_ms,
        kv_pull_overhead_ms=args.kv_pull_overhead_ms, kv_pull_stalls_decode=args.kv_pull_stalls_decode,
        gpu_share=args.gpu_share, kv_intake_gbps=args.kv_intake_gbps, kv_intake_bursts=args.kv_intake_bursts,
        async_scheduling=args.async_scheduling, kv_link_shares_gpu=args.kv_link_shares_gpu,
    )
    faults = FaultRates(
        error_rate=args.error_rate, error_status=args.error_status, slow_start_seconds=args.slow_start_seconds,
        slow_start_rate=args.slow_start_rate, stall_seconds=args.stall_seconds, stall_rate=args.stall_rate,
        stall_after_chunks=args.stall_after_chunks, disconnect_rate=args.disconnect_rate,
        disconnect_after_chunks=args.disconnect_after_chunks, kv_load_failure_rate=args.kv_load_failure_rate,
    )
    return SimSettings(
        role=args.role, host=args.host, port=args.port, advertise_host=args.advertise_host, model=args.model,
        preset=preset, time_scale=args.time_scale, engine_id=args.engine_id, tp_size=args.tp_size,
        kv_lease_seconds=args.kv_lease_seconds, skip_kv_pull=args.skip_kv_pull,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_per_request_metrics=args.enable_per_request_metrics,
        enable_request_id_headers=args.enable_request_id_headers, stream_interval=args.stream_interval,
        eos_after_tokens=args.eos_after_tokens, tokens_per_word=args.tokens_per_word, seed=args.seed,
        refuse_connections=args.refuse_connections,
        journal_size=args.journal_size, faults=faults, otlp_traces_endpoint=args.otlp_traces_endpoint,
        otlp_traces_file=args.otlp_traces_file, gpu_share_file=args.gpu_share_file,
        kv_events=parse_config(args.kv_events_config) if args.kv_events_config else None,
    )


BEHIND_CHECK_S = 5.0  # how often the sim looks at its engine's late steps
BEHIND_SHARE = 0.05  # simulated time lost per wall second above which it warns
BEHIND_EVERY_S = 60.0  # at most one warning per minute, each saying what was lost since the last


async def warn_when_behind(engine: Any, time_scale: float) -> None:
    """Say when the host does not keep up with the simulated timeline (a busy machine, too many sims per
    core at --time-scale 1): the engine restarts its timeline after a step starts late, and the time lost
    stretches every figure the sim produces. Warns once a check period loses more than BEHIND_SHARE of it,
    then at most once a minute, with what was lost since the last line."""
    log = logging.getLogger("pdproxy.sim")
    loop = asyncio.get_running_loop()
    seen_steps, seen_seconds = 0, 0.0
    said_at: float | None = None
    since, unsaid_steps, unsaid_seconds = loop.time(), 0, 0.0
    while True:
        await asyncio.sleep(BEHIND_CHECK_S)
        steps, seconds = engine.late_steps - seen_steps, engine.late_seconds - seen_seconds
        seen_steps, seen_seconds = engine.late_steps, engine.late_seconds
        unsaid_steps += steps
        unsaid_seconds += seconds
        now = loop.time()
        if seconds > BEHIND_SHARE * BEHIND_CHECK_S and (said_at is None or now - said_at >= BEHIND_EVERY_S):
            log.warning("falling behind: %d engine step(s) started late in the last %.0f s, %.2f s of simulated "
                        "time lost; this host does not keep up with this load at --time-scale %g, so latencies "
                        "come out longer than the preset's: give a larger --time-scale, run fewer sims per core or "
                        "send less load", unsaid_steps, now - since, unsaid_seconds, time_scale)
            said_at = since = now
            unsaid_steps, unsaid_seconds = 0, 0.0


class CannotListen(Exception):
    """The port is taken (or the address is not this machine's): one line and exit status 2, as `serve` says it."""


async def serve(settings: SimSettings) -> None:
    from pdproxy.sim.server import SimServer

    server = SimServer(settings)
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, shutdown_timeout=1.0, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        reason = os.strerror(exc.errno) if exc.errno else str(exc)  # asyncio's strerror repeats the address
        raise CannotListen(f"cannot listen on {settings.host}:{settings.port}: {reason}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    behind = asyncio.create_task(warn_when_behind(server.engine, settings.time_scale), name="sim-behind")
    p = settings.preset
    print(f"pdproxy sim: role={settings.role} model={settings.model} preset={p.name} engine_id={settings.engine_id} "
          f"listening on http://{settings.host}:{settings.port}", flush=True)
    if settings.kv_events is not None:  # what `pdproxy serve --kv-events-*` needs to be told
        events = settings.kv_events
        where = (f"KV events on {events['endpoint']} (replay {events['replay_endpoint'] or 'none'}, "
                 f"topic {events['topic'] or '(any)'})")
        if not settings.enable_prefix_caching:
            where = "no KV events: --kv-events-config is given but prefix caching is off (as vLLM, nothing to publish)"
        print(f"pdproxy sim: {where}", flush=True)
    try:
        await stop.wait()
    finally:
        behind.cancel()
        await runner.cleanup()
    print("pdproxy sim: stopped", flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        if settings.otlp_traces_endpoint and not settings.otlp_traces_file:
            from pdproxy.sim.tracing import check_protocol

            check_protocol()
    except ValueError as exc:
        print(f"pdproxy sim: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The step timer runs in a helper thread; a busy event loop hands it the GIL only every
    # switch interval (5 ms by default, a whole decode step), so shorten that.
    sys.setswitchinterval(0.0005)
    loop_factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            runner.run(serve(settings))
        except CannotListen as exc:
            print(f"pdproxy sim: error: {exc}", file=sys.stderr)
            return 2
    return 0
