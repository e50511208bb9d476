"""The conditions of a prediction come from the recording (issue 56): the card and how many instances shared a GPU
choose the preset (a card without one is fitted from its vLLM spans or refused, never the 1-GPU preset for a 2-GPU
recording); a simulated recording replays at its preset and time scale; a record without its set-up gets it from
the proxy's spans, and `pdproxy bench` from the proxy's /status."""

from __future__ import annotations

import gzip
import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pdproxy.bench.cli import from_status

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
V, A, P = FIX / "vllm023", FIX / "real-xpyd-2026-12-01b", FIX / "real-repeats-2026-12-07"


def whatif(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdproxy", "whatif", "--no-fit-run", "--jobs", "1", "--no-table",
                           *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "COLUMNS": "300"})


@pytest.fixture()
def inproc(capsys, monkeypatch):  # type: ignore[no-untyped-def]
    """`pdproxy whatif` through its own entry point in this process (what `python -m pdproxy` runs): no interpreter
    start-up per call."""
    from pdproxy.cli import main

    monkeypatch.setenv("COLUMNS", "300")

    def call(*args: str) -> subprocess.CompletedProcess:
        code = main(["whatif", "--no-fit-run", "--jobs", "1", "--no-table", *args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return call


def test_a_two_gpu_recording_gets_the_two_gpu_preset(inproc):
    """vllm023's 1P1D on two H200s (gpu.count 2, its traces say H200): the preset measured with a GPU per instance,
    never the one of two instances sharing one GPU (whose 0.34 GB/s link put its TTFT p50 off by +176-386 %)."""
    r = inproc("--records", str(V / "bench-2gpu-pd.jsonl.gz"), "--traces", str(V / "vllm023-pd-2gpu.otlp.jsonl.gz"),
               "--setup", "1P1D")
    assert r.returncode == 0, r.stderr
    assert "preset h200-llama8b-2gpu: measured on the recording's card (H200), one GPU per instance" in r.stdout
    r = inproc("--records", str(V / "bench-1gpu-pd.jsonl.gz"), "--traces", str(V / "vllm023-pd-1gpu.otlp.jsonl.gz"),
               "--setup", "1P1D")
    assert r.returncode == 0, r.stderr
    assert "preset h200-llama8b: measured on the recording's card (H200), instances sharing one GPU" in r.stdout


def test_a_card_without_a_preset_is_fitted_from_its_spans_or_refused():
    pd = next(P.glob("pd-r1-*.jsonl.gz"))
    r = whatif("--records", str(pd), "--traces", str(P / "tr-pd-r1.jsonl.gz"), "--setup", "1P1D")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no preset for the recording's hardware (gpu.kind NVIDIA_H100_80GB_HBM3" in r.stderr
    r = whatif("--records", str(pd), "--traces", str(P / "tr-pd-r1.jsonl.gz"), "--traces",
               str(P / "vllm-spans.otlp.jsonl.gz"), "--setup", "1P1D", "--json", "-")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout[r.stdout.index("{"):])
    assert any("fitted from its vLLM spans" in n for n in rep["whatif"]["workload"]["notes"])
    assert rep["whatif"]["calibration"]["fits"]


def _record(tmp_path: Path, name: str, kind: str | None, keep: tuple[str, ...] = ()) -> Path:
    """vllm023's 1-GPU 1P1D record with its gpu.kind set to `kind` and its set-up keys other than `keep` removed."""
    with gzip.open(V / "bench-1gpu-pd.jsonl.gz", "rt") as f:
        lines = [json.loads(x) for x in f]
    cond = lines[0]["conditions"]
    for k in ("pd.mode", "pd.prefill.count", "pd.decode.count"):
        if k not in keep:
            cond.pop(k, None)
    if kind is not None:
        cond["gpu.kind"] = kind
    out = tmp_path / name
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return out


def _lone_requests(path: Path, kind: str) -> Path:
    """Ten requests one at a time (2 s apart, open loop) on a single instance: their TTFT is the engine's alone."""
    head = {"type": "run", "run_id": "lone", "label": "lone", "conditions": {
        "pd.mode": "single", "gpu.count": "1", "pd.decode.count": "1", "gpu.kind": kind},
        "workload": {"duration": 20, "classes": [{"name": "c", "prompt": 2000, "output": 16, "rate": 0.5}]}}
    reqs = [{"type": "request", "request_id": f"r{i}", "class": "c", "index": i, "start_offset": 2.0 * i,
             "start_time": 1000.0 + 2.0 * i, "ok": True, "ttft": 0.1, "e2e": 0.25, "end": 0.25, "itl": [0.01] * 15,
             "prompt_tokens": 2000, "output_tokens": 16} for i in range(10)]
    path.write_text("".join(json.dumps(x) + "\n" for x in [head, *reqs]))
    return path


def test_a_simulated_recording_replays_at_its_time_scale(tmp_path, inproc):
    """`pdproxy demo` names its instances' preset and time scale in gpu.kind: lone requests replayed at scale 4
    take about four times as long as at scale 1 (the HTTP hops are real time either way)."""
    ttft = {}
    for scale in (1, 4):
        rec = _lone_requests(tmp_path / f"s{scale}.jsonl", f"simulated (h200-llama8b, time scale {scale})")
        r = inproc("--records", str(rec), "--setup", "1xsingle", "--json", "-")
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout[r.stdout.index("{"):])
        ttft[scale] = rep["runs"][0]["stats"]["ttft"]["p50"]
        notes = " ".join(rep["whatif"]["workload"]["notes"])
        assert "preset h200-llama8b: the one the recording names" in notes
        assert ("replayed at time scale 4" in notes) == (scale == 4)
    assert 3.3 < ttft[4] / ttft[1] < 4.0, ttft


def test_a_record_without_its_set_up_gets_it_from_the_proxys_spans(tmp_path, inproc):
    rec = _record(tmp_path, "nomode.jsonl", None)
    r = inproc("--records", str(rec), "--traces", str(V / "vllm023-pd-1gpu.otlp.jsonl.gz"), "--json", "-")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout[r.stdout.index("{"):])
    assert rep["whatif"]["self_replay"]["setup"] == "1P1D (recorded)"  # not "not among the candidates"
    assert any("the record does not say its set-up; the proxy's traces do: pd.mode=pd" in n
               for n in rep["whatif"]["workload"]["notes"])


class _Status(http.server.BaseHTTPRequestHandler):
    body: bytes = b"{}"

    def do_GET(self) -> None:  # noqa: N802
        ok = self.path == "/status"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body if ok else b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("status, expected", [
    ({"mode": "pd", "prefill_node_count": 3, "decode_node_count": 1},
     {"pd.mode": "pd", "pd.prefill.count": 3, "pd.decode.count": 1}),
    ({"status": "ok"}, {}),  # not pdproxy's /status (vLLM answers 404 or another shape): nothing assumed
])
def test_bench_reads_the_set_up_from_the_proxys_status(status, expected):
    handler = type("H", (_Status,), {"body": json.dumps(status).encode()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        conditions: dict = {"gpu.count": "4"}
        notes = from_status(url, conditions)
        assert conditions == {"gpu.count": "4", **expected}
        assert bool(notes) == bool(expected)
        given = {"pd.mode": "single", "pd.prefill.count": 0, "pd.decode.count": 4}
        assert from_status(url, dict(given)) == []  # what the run names is kept
    finally:
        server.shutdown()
        server.server_close()
