"""One trace from a trace store's HTTP query API, as OTLP-JSON documents `bench/traces.py` indexes.

* Jaeger (v2, and v1's query service): `GET /api/v3/traces/{id}` answers OTLP JSON under
  `result`; the older `GET /api/traces/{id}` answers Jaeger's own JSON (`data[].spans` with
  `operationName`, `references`, microsecond times, `tags`, `logs`, `processes`), converted here.
  A request id is looked up with `GET /api/traces?service=...&tags={"pd.request_id": ...}`, the
  other requests on an instance around a time with `tags={"pd.decode.instance": ...}&start&end`.
* Tempo: `GET /api/traces/{id}` answers OTLP JSON under `batches` (ids in base64, the protobuf JSON
  mapping); `/api/v2/traces/{id}` under `trace`. A request id is looked up with TraceQL
  `GET /api/search?q={ span.pd.request_id = "..." }`, the other requests on an instance with
  `{ span.pd.decode.instance = "..." }` and `start`/`end` (unix seconds), then fetched one by one.

A window of traffic (`search`: `pdproxy report --jaeger URL --since 15m`) is every trace with a span
of the proxy's service that started in it: Jaeger's `GET /api/v3/traces?query.service_name=...&
query.start_time_min=...&query.start_time_max=...&query.num_traces=N` (OTLP JSON, as stored:
`query.raw_traces`), else api/traces with `start`/`end`/`limit`; Tempo's TraceQL
`{ resource.service.name = "..." }` with `start`/`end`/`limit`, each trace then fetched.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from pdproxy.bench.traces import TraceError

KINDS = {"internal": 1, "server": 2, "client": 3, "producer": 4, "consumer": 5}
TIMEOUT = 10.0


def _get(url: str) -> Any | None:
    """The JSON at `url`; None when the store says 404 (no such trace)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "application/json"}),
                                    timeout=TIMEOUT) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise TraceError(f"{url}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise TraceError(f"{url}: {getattr(e, 'reason', e)}") from None
    except ValueError:
        raise TraceError(f"{url}: the answer is not JSON") from None


def hex_id(value: Any, size: int) -> str:
    """An id as lower-case hex whether it came as hex (OTLP/JSON, Jaeger) or base64 (protobuf JSON, Tempo)."""
    s = str(value or "")
    if len(s) == 2 * size:
        try:
            bytes.fromhex(s)
            return s.lower()
        except ValueError:
            pass
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        return s.lower()
    return raw.hex() if len(raw) == size else s.lower()


def _normalise(doc: dict[str, Any]) -> dict[str, Any]:
    """OTLP JSON with hex ids (Tempo's base64 ones rewritten) under `resourceSpans`."""
    rs_list = doc.get("resourceSpans", doc.get("batches")) or []
    for rs in rs_list:
        for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []:
            for sp in ss.get("spans") or []:
                sp["traceId"] = hex_id(sp.get("traceId"), 16)
                sp["spanId"] = hex_id(sp.get("spanId"), 8)
                if sp.get("parentSpanId"):
                    sp["parentSpanId"] = hex_id(sp["parentSpanId"], 8)
                if isinstance(sp.get("kind"), str):  # protobuf JSON may name the enum
                    sp["kind"] = KINDS.get(sp["kind"].replace("SPAN_KIND_", "").lower(), 0)
    return {"resourceSpans": rs_list}


def _value(tag: dict[str, Any]) -> dict[str, Any]:
    t, v = str(tag.get("type", "string")).lower(), tag.get("value")
    if t == "bool":
        return {"boolValue": bool(v)}
    if t == "int64":
        return {"intValue": str(v)}
    if t == "float64":
        return {"doubleValue": float(v)}
    return {"stringValue": str(v)}


def _kv(tags: list[dict[str, Any]], skip: set[str] = frozenset()) -> list[dict[str, Any]]:
    return [{"key": t["key"], "value": _value(t)} for t in tags or [] if t.get("key") not in skip]


def from_jaeger(trace: dict[str, Any]) -> dict[str, Any]:
    """Jaeger's JSON trace (query API v1) as one OTLP-JSON document."""
    processes = trace.get("processes") or {}
    by_process: dict[str, list[dict[str, Any]]] = {}
    for sp in trace.get("spans") or []:
        tags = {t.get("key"): t.get("value") for t in sp.get("tags") or []}
        parent = next((r.get("spanID") for r in sp.get("references") or []
                       if r.get("refType") == "CHILD_OF"), None)
        start_us, dur_us = int(sp.get("startTime") or 0), int(sp.get("duration") or 0)
        status = {"code": 2, "message": str(tags.get("otel.status_description", ""))} \
            if str(tags.get("otel.status_code", "")).upper() == "ERROR" or tags.get("error") is True else {}
        events = []
        for log in sp.get("logs") or []:
            fields = log.get("fields") or []
            name = next((f.get("value") for f in fields if f.get("key") == "event"), "")
            events.append({"timeUnixNano": str(int(log.get("timestamp") or 0) * 1000), "name": str(name),
                           "attributes": _kv(fields, {"event"})})
        out = {"traceId": hex_id(sp.get("traceID"), 16), "spanId": hex_id(sp.get("spanID"), 8),
               "name": sp.get("operationName", ""), "kind": KINDS.get(str(tags.get("span.kind", "")).lower(), 1),
               "startTimeUnixNano": str(start_us * 1000), "endTimeUnixNano": str((start_us + dur_us) * 1000),
               "attributes": _kv(sp.get("tags") or [], {"span.kind", "otel.status_code", "otel.status_description",
                                                        "error", "otel.scope.name", "otel.scope.version"}),
               "events": events, "status": status}
        if parent:
            out["parentSpanId"] = hex_id(parent, 8)
        by_process.setdefault(str(sp.get("processID", "")), []).append(out)
    rs_list = []
    for pid, spans in by_process.items():
        proc = processes.get(pid) or {}
        res = [{"key": "service.name", "value": {"stringValue": proc.get("serviceName", "")}}]
        res += _kv(proc.get("tags") or [])
        rs_list.append({"resource": {"attributes": res}, "scopeSpans": [{"scope": {}, "spans": spans}]})
    return {"resourceSpans": rs_list}


class TraceStore:
    """A Jaeger or Tempo query endpoint (`kind` is "jaeger" or "tempo")."""

    def __init__(self, kind: str, url: str, service: str = "pdproxy") -> None:
        self.kind, self.url, self.service = kind, url.rstrip("/"), service

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        """The trace's OTLP-JSON documents; [] when the store does not have it."""
        tid = urllib.parse.quote(trace_id)
        if self.kind == "tempo":
            doc = _get(f"{self.url}/api/traces/{tid}")
            if doc is None:
                return []
            return [_normalise(doc.get("trace", doc))]
        doc = _get(f"{self.url}/api/v3/traces/{tid}")
        if doc is not None and isinstance(doc.get("result"), dict):
            return [_normalise(doc["result"])]
        doc = _get(f"{self.url}/api/traces/{tid}")
        return [from_jaeger(t) for t in (doc or {}).get("data") or []]

    def find_request(self, request_id: str, start: float | None = None, end: float | None = None) -> list[str]:
        """Trace ids whose root names this request id (pd.request_id), started in [start, end] (unix seconds;
        without them, the store's default look-back: Jaeger's is an hour)."""
        window = ""
        if self.kind == "tempo":
            if start is not None and end is not None:
                window = f"&start={int(start)}&end={int(end) + 1}"
            q = urllib.parse.quote(f'{{ span.pd.request_id = "{request_id}" }}')
            doc = _get(f"{self.url}/api/search?q={q}&limit=5{window}") or {}
            return [hex_id(t.get("traceID"), 16) for t in doc.get("traces") or [] if t.get("traceID")]
        if start is not None and end is not None:
            window = f"&start={int(start * 1e6)}&end={int(end * 1e6)}"
        tags = urllib.parse.quote(json.dumps({"pd.request_id": request_id}))
        doc = _get(f"{self.url}/api/traces?service={urllib.parse.quote(self.service)}&tags={tags}&limit=5"
                   f"{window}") or {}
        return [hex_id(t.get("traceID"), 16) for t in doc.get("data") or [] if t.get("traceID")]

    def around(self, instance: str, start: float, end: float, limit: int = 200) -> list[dict[str, Any]]:
        """OTLP-JSON documents of the requests served by `instance` whose traces started in [start, end]."""
        if self.kind == "tempo":
            q = urllib.parse.quote(f'{{ span.pd.decode.instance = "{instance}" }}')
            doc = _get(f"{self.url}/api/search?q={q}&start={int(start)}&end={int(end) + 1}&limit={limit}") or {}
            docs = []
            for t in (doc.get("traces") or [])[:limit]:
                if t.get("traceID"):
                    docs += self.trace(hex_id(t["traceID"], 16))
            return docs
        tags = urllib.parse.quote(json.dumps({"pd.decode.instance": instance}))
        doc = _get(f"{self.url}/api/traces?service={urllib.parse.quote(self.service)}&tags={tags}"
                   f"&start={int(start * 1e6)}&end={int(end * 1e6)}&limit={limit}") or {}
        return [from_jaeger(t) for t in (doc.get("data") or [])[:limit]]

    def search(self, start: float, end: float, limit: int) -> tuple[list[dict[str, Any]], int]:
        """(OTLP-JSON documents, traces found) of up to `limit` traces with a span of the proxy's service
        that started in [start, end] (unix seconds)."""
        service = urllib.parse.quote(self.service)
        if self.kind == "tempo":
            q = urllib.parse.quote(f'{{ resource.service.name = "{self.service}" }}')
            doc = _get(f"{self.url}/api/search?q={q}&start={int(start)}&end={int(end) + 1}&limit={limit}") or {}
            ids = [hex_id(t["traceID"], 16) for t in (doc.get("traces") or [])[:limit] if t.get("traceID")]
            return [d for tid in ids for d in self.trace(tid)], len(ids)
        doc = _get(f"{self.url}/api/v3/traces?query.service_name={service}"
                   f"&query.start_time_min={_rfc3339(start)}&query.start_time_max={_rfc3339(end)}"
                   f"&query.num_traces={limit}&query.raw_traces=true")
        if doc is not None and isinstance(doc.get("result"), dict):
            out = _normalise(doc["result"])
            return [out], len(_trace_ids(out))
        doc = _get(f"{self.url}/api/traces?service={service}&start={int(start * 1e6)}&end={int(end * 1e6)}"
                   f"&limit={limit}") or {}
        data = (doc.get("data") or [])[:limit]
        return [from_jaeger(t) for t in data], len(data)


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _trace_ids(doc: dict[str, Any]) -> set[str]:
    return {str(sp.get("traceId", "")).lower() for rs in doc.get("resourceSpans") or []
            for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or [] for sp in ss.get("spans") or []}
