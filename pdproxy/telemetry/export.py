"""Where the proxy's batches of spans go, posted from its event loop.

Why on the loop: OTLP/HTTP needs no thread of its own, so it is posted with the legs' own HTTP
client (pdproxy/upstream.py): one buffer written per batch, the answer parsed by llhttp, no GIL
hand-offs between threads per post. (In CPU per request the change from the export thread was not
resolvable end to end on the 2-core machine: benchmarks/RESULTS.md, fourth round.) What blocks by
nature (gRPC's synchronous call, writing the trace file) runs on a thread of its own per sink, one
batch at a time and in order, and the sinks get a batch side by side, so a slow collector never
holds up the file nor the loop.

Every sink is watched (`Exporter`): a failed batch is said in the log at once, with the destination
and the reason, then summarised at most once a minute while failures go on, and its return said
too; /status shows each destination's state (last success, last error, spans sent and dropped).
At start-up the OTLP endpoint is probed with a TCP connect, off the serving path: one line when
nothing answers there. A collector that is down never costs a request anything but its spans.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol
from urllib.parse import urlsplit

from pdproxy.telemetry.otlp import GrpcTransport, HttpTarget, Transport, http_refusal, otlp_target, transport_error
from pdproxy.upstream import UpstreamClient, UpstreamError

__all__ = ["Exporter", "LoopSink", "HttpExporter", "LossLog", "ThreadedSink", "otlp_sink"]

log = logging.getLogger("pdproxy.export")

SUMMARY_EVERY = 60.0  # seconds between two summaries of the same ongoing loss
PROBE_TIMEOUT = 2.0  # seconds the start-up probe waits for a TCP connection to the OTLP endpoint
DROPPED = 'pdproxy_spans_dropped_total{reason="%s"}'


class LoopSink(Protocol):
    """Takes one encoded `ExportTraceServiceRequest`; True when it was stored (or sent and accepted),
    else False with `error` saying why."""

    @property
    def error(self) -> str | None: ...

    async def send(self, payload: bytes) -> bool: ...
    async def close(self) -> None: ...


class LossLog:
    """Loss said in the log without flooding it: the first loss at once, then what was lost since, at
    most once every `every` seconds while it goes on, and when it stops (`recovered`).

    `subject` and the two verbs make the lines: "span export to OTLP grpc http://otelcol:4317" "failed"
    ... "works again"; "span queue (8192 spans, --span-queue-size)" "is full" ... "has room again"."""

    def __init__(self, subject: str, reason_metric: str, failed: str = "failed", works: str = "works again",
                 every: float = SUMMARY_EVERY) -> None:
        self.subject = subject
        self.failed = failed
        self.works = works
        self.metric = DROPPED % reason_metric
        self.every = every
        self.failing_since: float | None = None
        self.said_at = 0.0
        self.unsaid_times = 0
        self.unsaid_spans = 0
        self.spans_in_outage = 0

    def lost(self, spans: int, reason: str | None, now: float) -> None:
        """`spans` spans lost at `now` (monotonic seconds) for `reason`."""
        self.spans_in_outage += spans
        reason = reason or "unknown reason"
        if self.failing_since is None:
            self.failing_since = self.said_at = now
            log.warning("%s %s: %s; %d span(s) dropped (counted in %s); while this goes on, a summary follows at "
                        "most every %g s", self.subject, self.failed, reason, spans, self.metric, self.every)
            return
        self.unsaid_times += 1
        self.unsaid_spans += spans
        if now - self.said_at >= self.every:
            log.warning("%s %s again: %d more time(s), %d span(s) dropped in the last %.0f s; last: %s",
                        self.subject, self.failed, self.unsaid_times, self.unsaid_spans, now - self.said_at, reason)
            self.said_at = now
            self.unsaid_times = self.unsaid_spans = 0

    def recovered(self, now: float) -> None:
        if self.failing_since is None:
            return
        log.warning("%s %s after %.0f s; %d span(s) were dropped meanwhile", self.subject, self.works,
                    now - self.failing_since, self.spans_in_outage)
        self.failing_since = None
        self.unsaid_times = self.unsaid_spans = self.spans_in_outage = 0


class Exporter:
    """One destination of the span batches and what became of them: the log lines (`LossLog`) and its
    state in /status. `kind` is "otlp" or "file"; `target` what the operator configured."""

    def __init__(self, sink: LoopSink, kind: str = "sink", target: str = "", probe: tuple[str, int] | None = None,
                 every: float = SUMMARY_EVERY) -> None:
        self.sink = sink
        self.kind = kind
        self.target = target
        self.probe_address = probe  # (host, port) of an OTLP endpoint, probed once at start-up
        what = f"span export to OTLP {target}" if kind == "otlp" else f"span export to {kind} {target}".rstrip()
        self.loss = LossLog(what, "export_failed", every=every)
        self.batches_sent = self.spans_sent = self.batches_failed = self.spans_dropped = 0
        self.last_success: float | None = None  # unix seconds
        self.last_error: tuple[float, str] | None = None  # (unix seconds, reason)
        self.unreachable: str | None = None  # why the start-up probe found nothing listening
        self.probing: asyncio.Task | None = None

    async def export(self, payload: bytes, spans: int) -> bool:
        """Send one batch of `spans` spans; True when the destination took it."""
        try:
            ok = await self.sink.send(payload)
            reason = None if ok else getattr(self.sink, "error", None)
        except Exception as exc:  # a sink's bug must not end the export
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        now = time.time()
        if ok:
            self.batches_sent += 1
            self.spans_sent += spans
            self.last_success = now
            self.unreachable = None
            self.loss.recovered(time.monotonic())
        else:
            self.batches_failed += 1
            self.spans_dropped += spans
            self.last_error = (now, reason or "unknown reason")
            self.loss.lost(spans, reason, time.monotonic())
        return ok

    def start_probe(self) -> None:
        """Probe the OTLP endpoint in the background (on the running loop): serving never waits for it."""
        if self.probe_address is not None and self.probing is None:
            self.probing = asyncio.get_running_loop().create_task(self._probe(*self.probe_address),
                                                                  name="otlp-probe")

    async def _probe(self, host: str, port: int) -> None:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                _, writer = await asyncio.open_connection(host, port)
            writer.close()
        except (OSError, TimeoutError) as exc:
            if self.last_success is not None:  # a batch got through meanwhile: it can be reached
                return
            self.unreachable = transport_error(exc, PROBE_TIMEOUT)
            log.warning("OTLP endpoint %s cannot be reached at start-up (%s:%d: %s): spans are dropped and counted "
                        "in %s until it answers", self.target, host, port, self.unreachable,
                        DROPPED % "export_failed")

    def state(self) -> str:
        """"ok" (the last batch went), "failing" (it did not), "unreachable" (nothing sent yet and the
        start-up probe found nothing there), "idle" (nothing sent yet)."""
        if self.last_error is not None and (self.last_success is None or self.last_error[0] >= self.last_success):
            return "failing"
        if self.last_success is not None:
            return "ok"
        return "unreachable" if self.unreachable else "idle"

    def status(self) -> dict[str, Any]:
        now = time.time()
        error = None
        if self.last_error is not None:
            error = {"at": _iso(self.last_error[0]), "seconds_ago": round(now - self.last_error[0], 1),
                     "reason": self.last_error[1]}
        success = None
        if self.last_success is not None:
            success = {"at": _iso(self.last_success), "seconds_ago": round(now - self.last_success, 1)}
        out: dict[str, Any] = {"kind": self.kind, "target": self.target, "state": self.state(),
                               "last_success": success, "last_error": error, "batches_sent": self.batches_sent,
                               "spans_sent": self.spans_sent, "batches_failed": self.batches_failed,
                               "spans_dropped": self.spans_dropped}
        if self.unreachable:
            out["unreachable_at_start"] = self.unreachable
        return out

    async def close(self) -> None:
        if self.probing is not None:
            self.probing.cancel()
        await self.sink.close()


def _iso(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix)) + f".{int(unix % 1 * 1000):03d}Z"


class HttpExporter:
    """OTLP/HTTP protobuf on the event loop: one kept-alive connection, a batch sent at most once.

    The upstream client's rule applies: only a request the collector provably did not take (a reused
    connection closed before any byte of an answer) goes again, once, on a new connection; a batch
    not answered within the timeout is never sent again (the collector may be storing it)."""

    def __init__(self, endpoint: str | None) -> None:
        self.target = target = HttpTarget(endpoint)
        self.base = f"{target.url.scheme}://{target.url.netloc}"
        tls = target.tls() if target.url.scheme == "https" else None
        self.client = UpstreamClient(target.timeout, target.timeout, max_idle=1, tls=tls)
        self.error: str | None = None

    async def send(self, payload: bytes) -> bool:
        target = self.target
        # gzip of a 512-span batch takes milliseconds: off the loop (zlib lets go of the GIL meanwhile)
        body = await asyncio.to_thread(gzip.compress, payload) if target.gzip else payload
        try:
            async with asyncio.timeout(target.timeout):
                response = await self.client.post(self.base, target.path, body, target.headers)
                try:
                    answer = await response.read()
                finally:
                    response.release()
        except TimeoutError:
            self.error = f"no answer within {target.timeout:g} s"
            return False
        except UpstreamError as exc:
            self.error = str(exc) or type(exc).__name__
            return False
        if 200 <= response.status < 300:
            return True
        self.error = http_refusal(response.status, answer)
        return False

    async def close(self) -> None:
        await self.client.close()


class ThreadedSink:
    """A sink that blocks (gRPC's synchronous call, the trace file), on a thread of its own."""

    def __init__(self, sink: Transport) -> None:
        self.sink = sink
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="pdproxy-span-export")

    @property
    def error(self) -> str | None:
        return self.sink.error

    async def send(self, payload: bytes) -> bool:
        return await asyncio.get_running_loop().run_in_executor(self.thread, self.sink.send, payload)

    async def close(self) -> None:
        # after a send still in progress (a slow collector at shutdown), by the thread that sends: the
        # sink is never closed under it, and exit does not wait for it
        self.thread.submit(self.sink.close)
        self.thread.shutdown(wait=False)


def otlp_sink(endpoint: str | None, protocol: str | None) -> LoopSink | None:
    """The proxy's OTLP sink when an endpoint is configured by flag or by the standard OTEL_* variables."""
    target = otlp_target(endpoint, protocol)
    if target is None:
        return None
    protocol, endpoint = target
    return ThreadedSink(GrpcTransport(endpoint)) if protocol == "grpc" else HttpExporter(endpoint)


def otlp_exporter(endpoint: str | None, protocol: str | None, shown: str) -> Exporter | None:
    """The proxy's watched OTLP destination (`shown`: the endpoint as the log may show it, credentials
    masked), probed at start-up; None when no endpoint is configured."""
    target = otlp_target(endpoint, protocol)
    sink = otlp_sink(endpoint, protocol)
    if target is None or sink is None:
        return None
    return Exporter(sink, "otlp", f"{target[0]} {shown}", probe=_host_port(*target))


def _host_port(protocol: str, endpoint: str) -> tuple[str, int] | None:
    parts = urlsplit(endpoint if "://" in endpoint else "http://" + endpoint)
    try:
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    default = 4317 if protocol == "grpc" else (443 if parts.scheme == "https" else 80)
    return parts.hostname, port or default
