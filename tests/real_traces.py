"""Where the recorded vLLM 0.23 traces are: shared/research/real-traces beside the clone (CI: ../shared).

A git worktree sits one level deeper than the main clone, so its parent's parent is looked at too.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CANDIDATES = [REPO.parent / "shared", REPO.parent.parent / "shared"]


def real_traces_dir() -> Path:
    for base in CANDIDATES:
        d = base / "research" / "real-traces"
        if (d / "vllm023-pd-2gpu.otlp.jsonl.gz").is_file():
            return d
    pytest.fail("the recorded traces are missing: expected shared/research/real-traces beside the clone ("
                + ", ".join(str(c) for c in CANDIDATES) + ")")


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
