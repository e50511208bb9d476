"""Where the proxy's batches of spans go, posted from its event loop.

Why on the loop: OTLP/HTTP needs no thread of its own, so it is posted with the legs' own HTTP
client (pdproxy/upstream.py): one buffer written per batch, the answer parsed by llhttp, no GIL
hand-offs between threads per post. (In CPU per request the change from the export thread was not
resolvable end to end on the 2-core machine: benchmarks/RESULTS.md, fourth round.) What blocks by
nature (gRPC's synchronous call, writing the trace file) runs on a thread of its own per sink, one
batch at a time and in order, and the sinks get a batch side by side, so a slow collector never
holds up the file nor the loop.
"""

from __future__ import annotations

import asyncio
import gzip
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from pdproxy.telemetry.otlp import GrpcTransport, HttpTarget, Transport, otlp_target
from pdproxy.upstream import UpstreamClient, UpstreamError

__all__ = ["LoopSink", "HttpExporter", "ThreadedSink", "otlp_sink"]


class LoopSink(Protocol):
    """Takes one encoded `ExportTraceServiceRequest`; True when it was stored (or sent and accepted)."""

    async def send(self, payload: bytes) -> bool: ...
    async def close(self) -> None: ...


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

    async def send(self, payload: bytes) -> bool:
        target = self.target
        # gzip of a 512-span batch takes milliseconds: off the loop (zlib lets go of the GIL meanwhile)
        body = await asyncio.to_thread(gzip.compress, payload) if target.gzip else payload
        try:
            async with asyncio.timeout(target.timeout):
                response = await self.client.post(self.base, target.path, body, target.headers)
                try:
                    await response.read()
                finally:
                    response.release()
        except (UpstreamError, TimeoutError):
            return False
        return 200 <= response.status < 300

    async def close(self) -> None:
        await self.client.close()


class ThreadedSink:
    """A sink that blocks (gRPC's synchronous call, the trace file), on a thread of its own."""

    def __init__(self, sink: Transport) -> None:
        self.sink = sink
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="pdproxy-span-export")

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
