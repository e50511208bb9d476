"""The report's terminal tables in an 80-column terminal: nothing cut, ids whole (issue 12)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from rich.console import Console

from pdproxy.bench import table
from test_report_verdict import CHUNKED, PD, SINGLE, write_run

WIDTH = 80


def traced_run(path: Path, label: str, ttft: float, max_gap: float, conditions: dict, failures: int = 0) -> Path:
    """A record file whose requests carry full-length request and trace ids, as the bench writes them."""
    write_run(path, label, [ttft + 0.013 * i for i in range(40)], max_gap, conditions=conditions, failures=failures)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for x in lines:
        if x["type"] == "request":
            x["request_id"] = f"{label}-{uuid.uuid4()}"
            x["trace_id"] = uuid.uuid4().hex
            if not x["ok"]:
                x["error_detail"] = "decode instance 10.0.0.4:8200 answered 500: KV cache load failed for block 17"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_tables_fit_80_columns_and_never_cut_an_id(tmp_path: Path) -> None:
    files = [traced_run(tmp_path / "single.jsonl", "single", 0.2, 0.150, {**SINGLE, "gpu.kind": "H200 141GB HBM3e"}),
             traced_run(tmp_path / "chunked.jsonl", "chunked", 0.18, 0.060, {**CHUNKED, "gpu.kind": "H200 141GB HBM3e",
                                                                            "vllm.max_num_batched_tokens": "2048"}),
             traced_run(tmp_path / "pd.jsonl", "pd", 0.1, 0.040, {**PD, "gpu.kind": "H200 141GB HBM3e",
                                                                  "pd.kv_connector": "NixlConnector (UCX, RDMA)"},
                       failures=2)]
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", "--no-table", "--json", "-", *map(str, files),
                        "--slo-ttft-ms", "300"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    console = Console(width=WIDTH, record=True, force_terminal=False, color_system=None)
    table.render(rep, console, drilldown=True, drilldown_rows=3)
    text = console.export_text()
    lines = text.splitlines()

    assert max(map(len, lines)) <= WIDTH
    for line in lines:  # a table wider than the console is cropped at its right edge, border and all
        if line[:1] in "│┃┏┡└":
            assert line.rstrip()[-1] in "│┃┓┩┘", line
    assert "…" not in text  # rich cuts a cell that does not fit with an ellipsis: nothing may be cut
    listed = [r for e in rep["runs"] for by in ("ttft", "tail_itl") for r in e["slowest"][by][:3]]
    listed += [r for e in rep["runs"] for r in e["failed"][:3]]
    assert len(listed) >= 15
    for r in listed:  # each id whole on one line: what the reader copies into the trace backend
        assert any(r["trace_id"] in line for line in lines), r["trace_id"]
        assert any(r["request_id"] in line for line in lines), r["request_id"]
    assert "KV cache load failed for block 17" in " ".join(" ".join(lines).split())
    # the side-by-side numbers are all there, each number whole
    for e in rep["runs"]:
        ttft = e["stats"]["ttft"]
        for q in ("p50", "p90", "p99"):
            assert f"{ttft[q] * 1e3:.1f}" in text
    # a condition every run shares is listed once, under the table
    assert text.count("H200 141GB HBM3e") == 1 and "Same in every run:" in text
    assert "Verdict:" in text and "Slowest requests" in text
