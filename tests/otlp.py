"""Real OTLP receivers for tests: oteltap (OTLP/HTTP, its own process) and a gRPC TraceService."""

from __future__ import annotations

import json
import shutil
import sys
import time
from concurrent import futures

from procs import Proc, free_port


def attrs(span: dict) -> dict:
    """OTLP/JSON attributes as plain Python values."""
    out = {}
    for a in span.get("attributes", []):
        (kind, value), = a["value"].items()
        if kind == "intValue":
            value = int(value)
        elif kind == "arrayValue":
            value = [list(v.values())[0] for v in value.get("values", [])]
        out[a["key"]] = value
    return out


def duration_ns(span: dict) -> int:
    return int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])


class TapReceiver:
    """oteltap listening on 127.0.0.1, printing every span it receives as one JSON line."""

    def __init__(self) -> None:
        self.port = free_port()
        exe = shutil.which("oteltap") or sys.executable
        args = [exe, "--port", str(self.port)] if exe != sys.executable else [exe, "-m", "oteltap", "--port", str(self.port)]
        self.proc = Proc(args, name="oteltap")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 10
        while "Listening" not in self.proc.output():
            if time.monotonic() > deadline:
                raise TimeoutError(self.proc.output())
            time.sleep(0.05)

    def spans(self) -> list[dict]:
        out = []
        for line in self.proc.output().splitlines():
            if line.startswith("{"):
                item = json.loads(line)
                if "spanId" in item:
                    out.append(item)
        return out

    def trace(self, trace_id: str, count: int, timeout: float = 10.0) -> list[dict]:
        """The spans of one trace, once `count` of them have arrived."""
        deadline = time.monotonic() + timeout
        while True:
            found = [s for s in self.spans() if s["traceId"] == trace_id]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.stop()


class GrpcReceiver:
    """A minimal OTLP/gRPC TraceService that keeps every span it is sent."""

    def __init__(self) -> None:
        import grpc
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.requests: list[dict] = []
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver.requests.append(MessageToDict(request))
                return trace_service_pb2.ExportTraceServiceResponse()

        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def span_names(self) -> list[str]:
        return [s["name"] for r in self.requests for rs in r.get("resourceSpans", []) for ss in rs.get("scopeSpans", [])
                for s in ss.get("spans", [])]

    def stop(self) -> None:
        self.server.stop(0)
