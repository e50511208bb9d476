"""A span sink writing OTLP-JSON lines: the format of the Collector's `file` exporter.

Each export call appends one line holding an `ExportTraceServiceRequest` in the OTLP/JSON
encoding (camelCase keys, hex trace and span ids, integer enums, 64-bit integers as strings),
so `pdproxy report` reads pdproxy's own files and a Collector's file exports the same way.

The file has a size bound (`--trace-file-max-bytes`): a line that would take it past the bound
first rotates it, as logging's RotatingFileHandler does (FILE -> FILE.1 -> ... -> FILE.N, the
oldest deleted), and a batch too big for one line is split across several. With `--workers N`
every worker appends to the same file, so a write and the rotation happen under an exclusive
`flock` of the file, and a worker whose file was rotated away reopens the new one before writing.

A write that fails (disk full, no permission, the file's directory gone) loses that batch only: what
it wrote of it is cut off again, so the file holds whole lines, `error` says why (the export's log
line and /status, telemetry/export.py), and the next batch tries again, reopening the file if need
be. `check_writable` is start-up's look at the file: refused when it cannot be opened, a warning
when its filesystem has less room than the file and its backups may take.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import json
import os
import shutil
import threading
from pathlib import Path
from typing import BinaryIO

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def describe_error(path: Path | str, exc: OSError) -> str:
    """"/data/traces.jsonl: No space left on device (ENOSPC)"."""
    name = errno.errorcode.get(exc.errno or 0)
    return f"{path}: {exc.strerror or exc}" + (f" ({name})" if name else "")


def check_writable(path: str | Path, max_bytes: int, backups: int) -> str | None:
    """Start-up's check of `--trace-file`: raises ValueError when it cannot be opened for appending (no
    permission, a directory in the way, a read-only filesystem); returns a warning when its filesystem
    has less free room than the file and its backups may grow to, else None."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise ValueError(f"cannot write the trace file {describe_error(path, exc)}") from None
    if not max_bytes or not path.parent.exists():
        return None
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return None
    need = max_bytes * (backups + 1)
    if free < need:
        return (f"trace file {path}: {free / 2**20:.0f} MiB free on its filesystem, but the file and its {backups} "
                f"backup(s) may take {need / 2**20:.0f} MiB (--trace-file-max-bytes x (--trace-file-backups + 1)); "
                "when the disk is full, spans are dropped and counted")
    return None


class TraceFileExporter:
    """Receives encoded `ExportTraceServiceRequest`s on its export thread (telemetry/export.py, `ThreadedSink`).

    `max_bytes` bounds each file (0: no bound); `backups` rotated files are kept beside it."""

    def __init__(self, path: str | Path, max_bytes: int = 0, backups: int = 0) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.error: str | None = None
        self._closed = False
        self._file: BinaryIO | None = None
        try:
            self._open()
        except OSError as exc:  # said by the first batch's failure; the next batches try again
            self.error = describe_error(self.path, exc)
        self._lock = threading.Lock()

    def _open(self) -> BinaryIO:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab", buffering=0)  # unbuffered: a failed write leaves nothing behind to retry
        return self._file

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
            if self._closed:
                self.error = f"{self.path}: closed"
                return False
            try:
                if self._file is None or self._file.closed:
                    self._open()
                self._lock_current()
                try:
                    if self.max_bytes:
                        for line in lines:
                            size = os.fstat(self._current.fileno()).st_size
                            if size and size + len(line) > self.max_bytes:
                                self._rotate()
                            self._append(line)
                    else:
                        self._append(b"".join(lines))
                finally:
                    fcntl.flock(self._current, fcntl.LOCK_UN)
            except OSError as exc:
                self.error = describe_error(self.path, exc)
                if self._file is not None:
                    self._file.close()  # reopened by the next batch: the path may point elsewhere by then
                    self._file = None
                return False
        return True

    @property
    def _current(self) -> BinaryIO:
        assert self._file is not None
        return self._file

    def _append(self, data: bytes) -> None:
        """All of `data` at the end of the file, or none of it: a write cut short (disk full) is undone."""
        fd = self._current.fileno()
        start = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # not a regular file (a pipe, /dev/full): nothing to undo
            raise

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()

    def _lock_current(self) -> None:
        """Hold the lock of the file now at `path` (another worker may have rotated ours away)."""
        while True:
            fcntl.flock(self._current, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_ino == os.fstat(self._current.fileno()).st_ino:
                    return
            except FileNotFoundError:
                pass  # rotated away, its successor not created yet
            fcntl.flock(self._current, fcntl.LOCK_UN)
            self._current.close()
            self._open()

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
        old = self._current
        self._open()
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
