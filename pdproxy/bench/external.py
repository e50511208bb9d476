"""Read per-request records of other benchmark clients, so users can keep their tool.

Supported: aiperf's `profile_export.jsonl` (one record per request: `metadata` with
`x_request_id`, `request_start_ns`, `request_end_ns`, `benchmark_phase`; `metrics` with
`{value, unit}` pairs such as `time_to_first_token`, `inter_chunk_latency` (a list),
`output_sequence_length`; `error` with `code`/`type`/`message` when the request failed). Shape
checked against files written by aiperf 0.13.0.

Mapping to pdproxy records: TTFT = `time_to_first_token`; chunk gaps = `inter_chunk_latency`;
E2E = TTFT + sum of the gaps (= the last token-bearing message, as pdproxy bench measures it);
`warmup` = `benchmark_phase == "warmup"`; failure reason = `http_<code>` when aiperf recorded an
HTTP status ≥ 400, else aiperf's error type. aiperf sends its `x_request_id` as `X-Request-ID`,
so its records join to pdproxy traces like pdproxy bench's own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pdproxy.bench.records import RecordError, Run, open_text

_UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}


def detect(path: str | Path) -> str:
    """`pdproxy`, `aiperf` or `unknown`, from the first non-empty line."""
    p = Path(path)
    if p.is_dir():
        return "aiperf" if (p / "profile_export.jsonl").is_file() else "unknown"
    try:
        with open_text(p) as fh:
            for line in fh:
                if line.strip():
                    obj = json.loads(line)
                    break
            else:
                return "unknown"
    except (OSError, EOFError, ValueError):
        return "unknown"
    if isinstance(obj, dict) and obj.get("type") in ("run", "request", "summary"):
        return "pdproxy"
    if isinstance(obj, dict) and "metadata" in obj and ("metrics" in obj or "error" in obj):
        return "aiperf"
    return "unknown"


def _seconds(metric: Any, name: str, where: str) -> Any:
    if metric is None:
        return None
    if not isinstance(metric, dict) or "value" not in metric:
        raise RecordError(f"{where}: metric {name!r} is not {{value, unit}}")
    unit = str(metric.get("unit", "ms"))
    if unit not in _UNIT:
        raise RecordError(f"{where}: metric {name!r} has unit {unit!r}, expected a time unit")
    f = _UNIT[unit]
    v = metric["value"]
    return [float(x) * f for x in v] if isinstance(v, list) else float(v) * f


def _count(metric: Any) -> int | None:
    if isinstance(metric, dict) and metric.get("value") is not None:
        return int(metric["value"])
    return None


def read_aiperf(path: str | Path, label: str | None = None) -> Run:
    """An aiperf `profile_export.jsonl` (or the artifact directory holding it) as a pdproxy Run."""
    p = Path(path)
    if p.is_dir():
        p = p / "profile_export.jsonl"
    if not p.is_file():
        raise RecordError(f"{path}: no aiperf profile_export.jsonl")
    requests: list[dict[str, Any]] = []
    start0: float | None = None
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except ValueError:
            raise RecordError(f"{where}: not JSON") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
            raise RecordError(f"{where}: not an aiperf record (no 'metadata')")
        rows.append((where, obj))
        s = obj["metadata"].get("request_start_ns")
        if s is not None:
            start0 = s / 1e9 if start0 is None else min(start0, s / 1e9)
    for seq, (where, obj) in enumerate(rows):
        md, m = obj["metadata"], obj.get("metrics") or {}
        err = obj.get("error")
        if md.get("request_start_ns") is None:
            raise RecordError(f"{where}: metadata.request_start_ns missing")
        start = md["request_start_ns"] / 1e9
        end = (md["request_end_ns"] / 1e9 - start) if md.get("request_end_ns") else None
        ttft = _seconds(m.get("time_to_first_token"), "time_to_first_token", where)
        gaps = _seconds(m.get("inter_chunk_latency"), "inter_chunk_latency", where) or []
        if isinstance(gaps, float):
            gaps = [gaps]
        ok = err is None and ttft is not None
        reason = None
        detail = None
        status = 200 if ok else None
        if err is not None:
            code = err.get("code") if isinstance(err, dict) else None
            if isinstance(code, int) and code >= 400:
                reason, status = f"http_{code}", code
            else:
                reason = re.sub(r"\W+", "_", str((err or {}).get("type") or "error")).strip("_").lower()
            detail = str((err or {}).get("message") or "")[:200]
        elif ttft is None:
            reason, detail = "no_token", "aiperf recorded no time_to_first_token"
        requests.append({
            "type": "request",
            "request_id": str(md.get("x_request_id") or f"aiperf-{seq}"),
            "trace_id": None,
            "class": "default",
            "index": int(md.get("session_num", seq)),
            "seq": seq,
            "warmup": str(md.get("benchmark_phase", "profiling")) == "warmup",
            "start_time": start,
            "start_offset": start - (start0 or start),
            "prompt_words": None,
            "max_tokens": None,
            "status": status,
            "ok": ok,
            "error": reason,
            "error_detail": detail,
            "ttft": ttft if ok else None,
            "e2e": (ttft + sum(gaps)) if ok else None,
            "end": end,
            "itl": gaps if ok else [],
            "chunk_tokens": None,
            "chunks": (len(gaps) + 1) if ok else 0,
            "output_tokens": _count(m.get("output_sequence_length")) if ok else None,
            "prompt_tokens": _count(m.get("input_sequence_length")),
        })
    if not requests:
        raise RecordError(f"{p}: no records")
    header = _aiperf_header(p, label)
    return Run(header=header, requests=requests, source=str(p))


def _aiperf_header(p: Path, label: str | None) -> dict[str, Any]:
    """Take what aiperf's aggregate file (next to the records) says about the run, if it is there."""
    agg_path = p.parent / "profile_export_aiperf.json"
    agg: dict[str, Any] = {}
    if agg_path.is_file():
        try:
            agg = json.loads(agg_path.read_text())
        except ValueError:
            agg = {}
    cfg = agg.get("input_config") or {}
    ep = cfg.get("endpoint") or {}
    urls = ep.get("urls") or ([ep["url"]] if ep.get("url") else [])
    conditions: dict[str, Any] = {}
    if ep.get("model_names"):
        conditions["vllm.model"] = ",".join(ep["model_names"])
    return {
        "type": "run",
        "run_id": agg.get("benchmark_id") or p.parent.name,
        "label": label or p.parent.name,
        "tool": f"aiperf {agg.get('aiperf_version', '')}".strip(),
        "target": ",".join(urls) or None,
        "conditions": conditions,
        "workload": None,
    }


def read_any(path: str, label: str | None = None) -> Run:
    """A record file in any supported format (pdproxy bench or aiperf), detected from its content."""
    from pdproxy.bench.records import read_run

    kind = detect(path)
    if kind == "pdproxy":
        run = read_run(path)
        if label:
            run.header["label"] = label
        return run
    if kind == "aiperf":
        return read_aiperf(path, label)
    if not Path(path).exists():
        raise RecordError(f"{path}: no such file")
    raise RecordError(f"{path}: not a pdproxy bench record file nor an aiperf profile_export.jsonl")
