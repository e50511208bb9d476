"""A span sink writing OTLP-JSON lines: the format of the Collector's `file` exporter.

Each export call appends one line holding an `ExportTraceServiceRequest` in the OTLP/JSON
encoding (camelCase keys, hex trace and span ids, integer enums, 64-bit integers as strings),
so `pdproxy report` reads pdproxy's own files and a Collector's file exports the same way.
"""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


class TraceFileExporter:
    """Receives encoded `ExportTraceServiceRequest`s from the export thread (see tracing.Sink)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def send(self, payload: bytes) -> bool:
        message = MessageToDict(ExportTraceServiceRequest.FromString(payload), use_integers_for_enums=True)
        for resource_spans in message.get("resourceSpans", ()):
            for scope_spans in resource_spans.get("scopeSpans", ()):
                for span in scope_spans.get("spans", ()):
                    _hex_ids(span)
                    for link in span.get("links", ()):
                        _hex_ids(link)
        line = json.dumps(message, separators=(",", ":"))
        with self._lock:
            if self._file.closed:
                return False
            self._file.write(line + "\n")
            self._file.flush()
        return True

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _hex_ids(obj: dict) -> None:
    """Protobuf's JSON mapping writes bytes as base64; OTLP/JSON wants ids as hex."""
    for key in _ID_KEYS:
        if key in obj:
            obj[key] = base64.b64decode(obj[key]).hex()
