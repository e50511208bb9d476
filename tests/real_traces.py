"""The recorded vLLM 0.23 traces and bench records: a fixture in the repository (tests/fixtures/vllm023).

Their provenance (vLLM 0.23.0, NIXL, one and two H200s, pdproxy 0.1.0 in front) is in that folder's README.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

REAL_TRACES = Path(__file__).resolve().parent / "fixtures" / "vllm023"


def bench_records(path: Path) -> list[dict]:
    """Every request record of a bench file (warm-up included)."""
    with gzip.open(path, "rt") as f:
        return [r for r in map(json.loads, f) if r.get("type") == "request"]


def otlp_spans(path: Path) -> list[tuple[dict, dict, dict]]:
    """(resource attributes, scope, span) of every span in an OTLP-JSON lines file (gzipped or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            for rs in json.loads(line)["resourceSpans"]:
                res = {a["key"]: a["value"] for a in rs["resource"].get("attributes", [])}
                for ss in rs.get("scopeSpans", []):
                    for sp in ss.get("spans", []):
                        out.append((res, ss.get("scope", {}), sp))
    return out
