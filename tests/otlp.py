"""Real OTLP receivers for tests: oteltap (OTLP/HTTP, its own process) and a gRPC TraceService."""

from __future__ import annotations

import json
import shutil
import sys
import time
from concurrent import futures

from procs import Proc, free_port
from waits import scaled


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
        deadline = time.monotonic() + scaled(10)
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
        deadline = time.monotonic() + scaled(timeout)
        while True:
            found = [s for s in self.spans() if s["traceId"] == trace_id]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.stop()


class GrpcReceiver:
    """A minimal OTLP/gRPC TraceService that keeps every span it is sent (on `port`, or a free one)."""

    def __init__(self, port: int | None = None) -> None:
        import grpc
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.requests: list[dict] = []
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver.requests.append(MessageToDict(request))
                return trace_service_pb2.ExportTraceServiceResponse()

        self.port = port or free_port()
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


class HttpReceiver:
    """An OTLP/HTTP (protobuf) receiver on 127.0.0.1, in a thread of the test process: it keeps the
    id of every span it is posted, duplicates included, then answers 200 after `delay` seconds
    (slower than the exporter's timeout: a collector that is too slow). HTTP/1.1 keep-alive; a
    connection idle for `idle_close` seconds is closed by the receiver, as collectors do."""

    def __init__(self, delay: float = 0.0, idle_close: float = 60.0) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.span_ids: list[str] = []
        self.batches: list[int] = []  # spans per post
        self.trace_posts: dict[str, set[int]] = {}  # trace id: the posts that carried its spans
        self.posts = self.connections = self.closed = 0
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle_close  # an idle kept-alive connection is closed after this long

            def setup(self):
                super().setup()
                with lock:
                    receiver.connections += 1

            def finish(self):
                try:
                    super().finish()
                finally:
                    with lock:
                        receiver.closed += 1

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                message = ExportTraceServiceRequest.FromString(body)
                with lock:
                    receiver.posts += 1
                    spans = [s for rs in message.resource_spans for ss in rs.scope_spans for s in ss.spans]
                    receiver.span_ids += [s.span_id.hex() for s in spans]
                    receiver.batches.append(len(spans))
                    for span in spans:
                        receiver.trace_posts.setdefault(span.trace_id.hex(), set()).add(receiver.posts)
                time.sleep(delay)
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    self.close_connection = True  # the exporter gave up waiting

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # an exporter that hung up is no error here
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class VllmSpans:
    """Stands in for vLLM's own tracing (`vllm serve --otlp-traces-endpoint`): for every inference
    request a simulated instance received with a `traceparent`, export one span of that instance's
    service as a child of the proxy's leg span, in the proxy's trace, to `endpoint` (OTLP/HTTP JSON).

    A background thread polls the instances' request journals (`GET /sim/requests`); `spans`
    lists what was sent, by trace id. The span covers arrival at the instance (+1 ms): the
    journal records no completion time, and the point is a second service's span in the trace.
    """

    def __init__(self, endpoint: str, instances: dict[str, str], interval: float = 0.2) -> None:
        import threading

        self.endpoint = endpoint.rstrip("/") + "/v1/traces"
        self.instances = instances  # service.name -> the sim's base URL
        self.interval = interval
        self.spans: dict[str, list[dict]] = {}  # trace id -> the OTLP/JSON spans sent, with their `service`
        self._seen: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="vllm-spans", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        import os
        import urllib.request

        for service, url in self.instances.items():
            try:
                with urllib.request.urlopen(url + "/sim/requests", timeout=5) as r:
                    entries = json.loads(r.read())["requests"]
            except OSError as e:
                self.errors.append(f"{service}: {e}")
                continue
            spans = []
            for entry in entries:
                parent = entry["headers"].get("traceparent")
                if not parent or (service, parent) in self._seen:
                    continue
                self._seen.add((service, parent))
                _, trace_id, parent_span, _ = parent.split("-")
                start = int(entry["received_at"] * 1e9)
                span = {"traceId": trace_id, "spanId": os.urandom(8).hex(), "parentSpanId": parent_span,
                        "name": "llm_request", "kind": 2, "startTimeUnixNano": str(start),
                        "endTimeUnixNano": str(start + 1_000_000),
                        "attributes": [{"key": "gen_ai.request.id",
                                        "value": {"stringValue": entry["headers"].get("x-request-id", "")}}]}
                spans.append(span)
            if spans:
                body = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
                                           "scopeSpans": [{"scope": {"name": "vllm.sim"}, "spans": spans}]}]}
                req = urllib.request.Request(self.endpoint, data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                try:
                    urllib.request.urlopen(req, timeout=5).read()
                except OSError as e:
                    self.errors.append(f"export {service}: {e}")
                    continue
                for span in spans:
                    self.spans.setdefault(span["traceId"], []).append({**span, "service": service})

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.poll()  # the last requests' spans
