"""A minimal OTLP/HTTP trace receiver for the benchmark: decodes every request, counts its spans.

Why not oteltap here: oteltap prints every span as JSON, which on the 2-core machine costs the
shared CPU more than the proxy's tracing does, so "tracing on" would measure the receiver. This
sink still receives real OTLP/HTTP protobuf exports (each body is parsed with the generated
`ExportTraceServiceRequest` class; a body that does not parse is answered 400), costs a few
microseconds per span, and reports how many spans arrived: GET /count -> {"requests": n, "spans": m}.

Run: python benchmarks/otlp_sink.py --port 4318
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rawhttp beside it, also under PYTHONSAFEPATH=1 (CI)

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from rawhttp import serve, take_requests


class Sink(asyncio.Protocol):
    requests = 0
    spans = 0
    bad = 0

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        requests, self.buffer = take_requests(self.buffer + data)
        for request_line, _, body in requests:
            self.handle(request_line, body)

    def handle(self, request_line: str, body: bytes) -> None:
        if request_line.startswith("GET /count"):
            reply = json.dumps({"requests": Sink.requests, "spans": Sink.spans, "bad": Sink.bad}).encode()
            self.respond(200, "application/json", reply)
            return
        try:
            message = ExportTraceServiceRequest.FromString(body)
        except Exception:
            Sink.bad += 1
            self.respond(400, "text/plain", b"not an ExportTraceServiceRequest")
            return
        Sink.requests += 1
        Sink.spans += sum(len(ss.spans) for rs in message.resource_spans for ss in rs.scope_spans)
        self.respond(200, "application/x-protobuf", b"")  # an empty ExportTraceServiceResponse

    def respond(self, status: int, content_type: str, body: bytes) -> None:
        self.transport.write(f"HTTP/1.1 {status} OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}"
                             f"\r\n\r\n".encode() + body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve("otlp_sink", Sink, args.host, args.port))


if __name__ == "__main__":
    main()
