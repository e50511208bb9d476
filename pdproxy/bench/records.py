"""The bench's record file: one JSON object per line.

```
{"type": "run", ...}        first line: run id, label, conditions, workload, target, versions
{"type": "request", ...}    one per request sent (failed and warm-up requests included)
{"type": "summary", ...}    last line: the statistics of the measured requests (stats.run_stats)
```

A request line has the client-side timings in seconds (`ttft`, `e2e`, `itl` = the gaps between
token-bearing chunks, `chunk_tokens` = tokens per chunk when the server streamed usage), the
status and the failure reason, the ids sent (`request_id` as `X-Request-Id`, `trace_id` in
`traceparent`), and never prompt or completion text unless the run was started with --save-text.
Reading is tolerant of a missing summary (a run cut short still has its request lines).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

FORMAT = "pdproxy-bench/1"


class RecordError(ValueError):
    """A file that is not a readable record file; the message names the file and line."""


@dataclass
class Run:
    """One bench run as read back: header, request records and the summary (if written)."""

    header: dict[str, Any]
    requests: list[dict[str, Any]]
    summary: dict[str, Any] | None = None
    source: str = ""
    traces: dict[str, Any] = field(default_factory=dict)  # request_id → trace info, after the join
    deployment: str = "primary"  # whose traces the records join to (`pd.deployment` of the root)

    @property
    def label(self) -> str:
        return str(self.header.get("label") or self.header.get("run_id") or self.source)

    @property
    def conditions(self) -> dict[str, Any]:
        return self.header.setdefault("conditions", {})


def request_record(
    *,
    run_id: str,
    request_id: str,
    trace_id: str,
    cls: str,
    index: int,
    seq: int,
    warmup: bool,
    start_wall: float,
    start_offset: float,
    prompt_words: int,
    prompt_tokens_requested: int | None,
    max_tokens: int,
    outcome: Any,
) -> dict[str, Any]:
    """Turn a client outcome into the record written to disk."""
    times = outcome.chunk_times
    rec: dict[str, Any] = {
        "type": "request",
        "run_id": run_id,
        "request_id": request_id,
        "trace_id": trace_id,
        "class": cls,
        "index": index,
        "seq": seq,
        "warmup": warmup,
        "start_time": round(start_wall, 6),
        "start_offset": round(start_offset, 6),
        "prompt_words": prompt_words,
        "prompt_tokens_requested": prompt_tokens_requested,  # what the workload asked (None: a corpus prompt)
        "max_tokens": max_tokens,  # the output asked for (min_tokens too, unless --no-min-tokens)
        "status": outcome.status,
        "ok": outcome.ok,
        "error": outcome.error,
        "error_detail": outcome.error_detail,
        "ttft": round(times[0], 7) if times else None,
        "e2e": round(times[-1], 7) if times else None,
        "end": round(outcome.end, 7) if outcome.end is not None else None,
        "itl": [round(b - a, 7) for a, b in zip(times, times[1:])],
        "chunk_tokens": outcome.chunk_tokens,
        "chunks": len(times),
        "output_tokens": outcome.output_tokens,
        "prompt_tokens": outcome.prompt_tokens,
        "finish_reason": outcome.finish_reason,
    }
    if outcome.text is not None:
        rec["text"] = outcome.text
    return rec


class RecordWriter:
    """Appends lines as they happen so a killed run still leaves its records behind."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh: TextIO = open(path, "w")

    def write(self, obj: dict[str, Any]) -> None:
        self._fh.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def open_text(path: str | Path) -> TextIO:
    """A text file, decompressed on the fly when it is gzipped (e.g. records kept as .jsonl.gz)."""
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt") if gzipped else open(path)


def read_run(path: str | Path) -> Run:
    """Read one record file written by `pdproxy bench` (gzipped or not)."""
    p = Path(path)
    if not p.is_file():
        raise RecordError(f"{p}: no such file")
    header: dict[str, Any] | None = None
    summary = None
    reqs: list[dict[str, Any]] = []
    with open_text(p) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise RecordError(f"{p}:{n}: not JSON") from None
            kind = obj.get("type") if isinstance(obj, dict) else None
            if kind == "run":
                _check(obj, _HEADER_FIELDS, p, n)
                _check_workload(obj.get("workload"), p, n)
                header = obj
            elif kind == "request":
                _check(obj, _REQUEST_FIELDS, p, n)
                reqs.append(obj)
            elif kind == "summary":
                summary = obj
            else:
                raise RecordError(f"{p}:{n}: not a pdproxy bench record (no type run/request/summary)")
    if header is None:
        raise RecordError(f"{p}: no run header line; is this a `pdproxy bench` record file?")
    return Run(header=header, requests=reqs, summary=summary, source=str(p))


# What a record's fields must be where they are given (type, and whether they may be missing or null): the
# report and the what-if read them as numbers, lists and names, so a wrong one is named here (file, line, field)
# instead of failing deep inside with a traceback.
_INT, _NUM, _STR, _BOOL, _LIST, _DICT = "a whole number", "a number", "a string", "true or false", "a list", "an object"
_REQUEST_FIELDS: dict[str, tuple[str, bool]] = {  # field -> (kind, required)
    "request_id": (_STR, True), "start_offset": (_NUM, True), "class": (_STR, False), "index": (_INT, False),
    "seq": (_INT, False), "warmup": (_BOOL, False), "ok": (_BOOL, False), "status": (_INT, False),
    "start_time": (_NUM, True), "ttft": (_NUM, False), "e2e": (_NUM, False), "end": (_NUM, False),
    "itl": (_LIST, False), "chunk_tokens": (_LIST, False), "prompt_tokens": (_INT, False),
    "prompt_tokens_requested": (_INT, False), "output_tokens": (_INT, False), "max_tokens": (_INT, False),
    "prompt_words": (_INT, False), "chunks": (_INT, False),
}
_HEADER_FIELDS: dict[str, tuple[str, bool]] = {
    "conditions": (_DICT, False), "workload": (_DICT, False), "prompts": (_DICT, False), "label": (_STR, False),
    "run_id": (_STR, False),
}
_CLASS_FIELDS: dict[str, tuple[str, bool]] = {
    "name": (_STR, False), "concurrency": (_INT, False), "rate": (_NUM, False), "requests": (_INT, False),
    "shared_prefixes": (_INT, False), "sessions": (_INT, False), "turns": (_INT, False),
}
_WORKLOAD_FIELDS: dict[str, tuple[str, bool]] = {
    "duration": (_NUM, False), "warmup_seconds": (_NUM, False), "warmup_requests": (_INT, False),
    "requests": (_INT, False), "seed": (_INT, False), "classes": (_LIST, False),
}
_NON_NEGATIVE = {"start_offset", "index", "seq", "ttft", "e2e", "prompt_tokens", "prompt_tokens_requested",
                 "output_tokens", "max_tokens", "prompt_words", "chunks", "duration", "warmup_seconds",
                 "warmup_requests", "requests", "rate", "concurrency", "shared_prefixes", "sessions", "turns"}


def _is(kind: str, v: Any) -> bool:
    if kind == _INT:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == _NUM:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
    return isinstance(v, {_STR: str, _BOOL: bool, _LIST: list, _DICT: dict}[kind])


def _check(obj: dict[str, Any], fields: dict[str, tuple[str, bool]], p: Path, n: int, where: str = "") -> None:
    for name, (kind, required) in fields.items():
        if name not in obj or obj[name] is None:
            if required:
                raise RecordError(f"{p}:{n}: field {where}{name} is missing")
            continue
        v = obj[name]
        if name == "request_id" and _is(_INT, v):
            continue  # an id written as a number is still an id
        if not _is(kind, v):
            raise RecordError(f"{p}:{n}: field {where}{name} must be {kind}, not {json.dumps(v)[:60]}")
        if name in _NON_NEGATIVE and v < 0:
            raise RecordError(f"{p}:{n}: field {where}{name} must not be negative ({v})")
    if fields is _REQUEST_FIELDS and obj.get("ok") is True and obj.get("ttft") is None:
        raise RecordError(f"{p}:{n}: field ttft is missing (the request is ok: its first token came)")
    if where == "" and "itl" in fields and isinstance(obj.get("itl"), list) and \
            not all(_is(_NUM, g) and g >= 0 for g in obj["itl"]):
        raise RecordError(f"{p}:{n}: field itl must be a list of non-negative numbers (seconds)")


def _check_workload(wl: Any, p: Path, n: int) -> None:
    if not isinstance(wl, dict):
        return  # missing or null: _check named anything else
    _check(wl, _WORKLOAD_FIELDS, p, n, "workload.")
    for i, c in enumerate(wl.get("classes") or []):
        if not isinstance(c, dict):
            raise RecordError(f"{p}:{n}: field workload.classes[{i}] must be an object, not {json.dumps(c)[:60]}")
        _check(c, _CLASS_FIELDS, p, n, f"workload.classes[{i}].")
