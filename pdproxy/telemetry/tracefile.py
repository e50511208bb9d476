"""A span sink writing OTLP-JSON lines: the format of the Collector's `file` exporter.

Each export call appends one line holding an `ExportTraceServiceRequest` in the OTLP/JSON
encoding (camelCase keys, hex trace and span ids, integer enums, 64-bit integers as strings),
so `pdproxy report` reads pdproxy's own files and a Collector's file exports the same way.

The file has a size bound (`--trace-file-max-bytes`): a line that would take it past the bound
first rotates it, as logging's RotatingFileHandler does (FILE -> FILE.1 -> ... -> FILE.N, the
oldest deleted), and a batch too big for one line is split across several. With `--workers N`
every worker appends to the same file, so a write and the rotation happen under an exclusive
`flock` of the file, and a worker whose file was rotated away reopens the new one before writing.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import threading
from pathlib import Path
from typing import BinaryIO

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


class TraceFileExporter:
    """Receives encoded `ExportTraceServiceRequest`s on its export thread (telemetry/export.py, `ThreadedSink`).

    `max_bytes` bounds each file (0: no bound); `backups` rotated files are kept beside it."""

    def __init__(self, path: str | Path, max_bytes: int = 0, backups: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.backups = backups
        self._file: BinaryIO = open(self.path, "ab")
        self._lock = threading.Lock()

    def send(self, payload: bytes) -> bool:
        message = MessageToDict(ExportTraceServiceRequest.FromString(payload), use_integers_for_enums=True)
        for resource_spans in message.get("resourceSpans", ()):
            for scope_spans in resource_spans.get("scopeSpans", ()):
                for span in scope_spans.get("spans", ()):
                    _hex_ids(span)
                    for link in span.get("links", ()):
                        _hex_ids(link)
        lines = _lines(message, self.max_bytes)
        with self._lock:
            if self._file.closed:
                return False
            if not self.max_bytes:
                self._file.write(b"".join(lines))
                self._file.flush()
                return True
            self._lock_current()
            try:
                for line in lines:
                    size = os.fstat(self._file.fileno()).st_size
                    if size and size + len(line) > self.max_bytes:
                        self._rotate()
                    self._file.write(line)
                    self._file.flush()
            finally:
                fcntl.flock(self._file, fcntl.LOCK_UN)
        return True

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def _lock_current(self) -> None:
        """Hold the lock of the file now at `path` (another worker may have rotated ours away)."""
        while True:
            fcntl.flock(self._file, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_ino == os.fstat(self._file.fileno()).st_ino:
                    return
            except FileNotFoundError:
                pass  # rotated away, its successor not created yet
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = open(self.path, "ab")

    def _rotate(self) -> None:
        """FILE -> FILE.1 -> ... -> FILE.backups (the oldest deleted), then a new FILE, locked."""
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.backups:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink()
        old = self._file
        self._file = open(self.path, "ab")
        fcntl.flock(old, fcntl.LOCK_UN)
        old.close()
        self._lock_current()


def _lines(message: dict, max_bytes: int) -> list[bytes]:
    """`message` as OTLP-JSON lines, each within `max_bytes` when that is set (the spans split
    across several requests; a single span larger than the bound still gets its own line)."""
    line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
    if not max_bytes or len(line) <= max_bytes:
        return [line]
    spans = [(i, j, span) for i, rs in enumerate(message.get("resourceSpans", ()))
             for j, ss in enumerate(rs.get("scopeSpans", ())) for span in ss.get("spans", ())]
    if len(spans) < 2:
        return [line]
    half = len(spans) // 2
    return _lines(_with_spans(message, spans[:half]), max_bytes) + _lines(_with_spans(message, spans[half:]),
                                                                          max_bytes)


def _with_spans(message: dict, spans: list[tuple[int, int, dict]]) -> dict:
    """A copy of `message` holding only `spans` (resource and scope kept), each (resource, scope, span)."""
    kept: dict[int, dict[int, list[dict]]] = {}
    for i, j, span in spans:
        kept.setdefault(i, {}).setdefault(j, []).append(span)
    resource_spans = []
    for i, scopes in kept.items():
        rs = message["resourceSpans"][i]
        resource_spans.append({**rs, "scopeSpans": [{**rs["scopeSpans"][j], "spans": s} for j, s in scopes.items()]})
    return {"resourceSpans": resource_spans}


def _hex_ids(obj: dict) -> None:
    """Protobuf's JSON mapping writes bytes as base64; OTLP/JSON wants ids as hex."""
    for key in _ID_KEYS:
        if key in obj:
            obj[key] = base64.b64decode(obj[key]).hex()
