"""Decoding OTLP-JSON values (the Collector file exporter's and trace stores' JSON encoding)."""

from __future__ import annotations

from typing import Any


def attr_value(v: dict[str, Any]) -> Any:
    """Decode one OTLP-JSON AnyValue (int64 arrives as a string in the JSON mapping)."""
    if not isinstance(v, dict) or not v:
        return None
    if "stringValue" in v:
        return v["stringValue"]
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "arrayValue" in v:
        return [attr_value(x) for x in (v["arrayValue"] or {}).get("values", [])]
    if "kvlistValue" in v:
        return attrs_of((v["kvlistValue"] or {}).get("values", []))
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def attrs_of(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {a["key"]: attr_value(a.get("value") or {}) for a in items or [] if isinstance(a, dict) and "key" in a}


def unix_s(nanos: Any) -> float:
    """An OTLP-JSON nanosecond timestamp (a string or number) as unix seconds."""
    return int(nanos or 0) / 1e9
