"""`pdproxy demo` with its default settings (the README's main-job command), and Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from waits import scaled, wait_until

ROWS = ("TTFT", "ITL pooled", "tail ITL: per-request p99", "tail ITL: per-request max", "KV transfer, upper bound",
        "throughput, output tokens/s", "throughput, requests/s", "error rate", "Verdict:")


def children_of(pid: int) -> set[int]:
    """Direct children of a process, from /proc (the demo starts its children in their own sessions)."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.add(int(d.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return stat[0] != "Z"


def test_demo_defaults_finish_in_two_minutes_with_the_comparison(tmp_path: Path) -> None:
    out = tmp_path / "run"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pdproxy", "demo", "--out-dir", str(out)], capture_output=True,
                       text=True, timeout=scaled(180))
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    assert wall < scaled(120), f"demo took {wall:.0f}s"
    text = p.stdout
    for row in ROWS:
        assert row in text, row
    assert re.search(r"single\s+.*chunked\s+.*dp\s+.*pd", text)  # side by side
    assert f"Run directory: {out}" in text and "traces-pd.jsonl" in text
    for printed in (" ".join(text.split()), " ".join(p.stderr.split())):  # the header says the time scale
        assert "Time scale: the simulated instances run preset h200-llama8b-2gpu at --time-scale 4" in printed
    for name in ("records-single.jsonl", "records-chunked.jsonl", "records-dp.jsonl", "records-pd.jsonl",
                 "traces-single.jsonl", "traces-chunked.jsonl", "traces-dp.jsonl", "traces-pd.jsonl", "report.json",
                 "report.html"):
        assert (out / name).stat().st_size > 0, name
    rep = json.loads((out / "report.json").read_text())
    by = {e["label"]: e for e in rep["runs"]}
    assert set(by) == {"single", "chunked", "dp", "pd"}
    for label, e in by.items():
        lines = [json.loads(x) for x in (out / f"records-{label}.jsonl").read_text().splitlines()]
        ok = [x for x in lines if x["type"] == "request" and not x["warmup"] and x["ok"]]
        assert len(ok) > 30 and e["traces"]["records_without_trace"] == 0
        assert e["stats"]["ttft"]["p90"] == pytest.approx(np.percentile([x["ttft"] for x in ok], 90))
        printed = f"{e['stats']['ttft']['p50'] * 1e3:.1f} / {e['stats']['ttft']['p90'] * 1e3:.1f}"
        assert printed in text  # the table shows the report's numbers
    # the workload shows the phenomena: a long prefill stalls streams on a single instance, chunking
    # bounds the stall, P/D moves it off the decode but pays a KV transfer on long prompts, whose arrival
    # stalls the decode's streams in turn (as on two real H200s, where P/D's tail came out near chunked's)
    mx = {k: by[k]["stats"]["classes"]["stream"]["tail_itl"]["per_request_max"]["p90"] for k in by if k != "dp"}
    assert mx["chunked"] < mx["single"] and mx["pd"] < mx["single"]
    share = {k: by[k]["stall_attribution"]["by_cause"] for k in by}
    assert share["single"]["prefill"]["share"] > 0.8 and share["pd"]["kv_arrival"]["share"] > 0.8
    assert by["pd"]["kv_transfer"]["upper_bound"]["count"] > 0 and by["single"]["kv_transfer"] is None
    long_ttft = {k: by[k]["stats"]["classes"]["long"]["ttft"]["p50"] for k in by}
    assert long_ttft["pd"] > long_ttft["single"]
    # prompts and outputs are the server's tokens, exactly as asked
    for e in by.values():
        for cls, asked in (("stream", 200), ("long", 3000)):
            assert e["stats"]["lengths"][cls]["prompt"] == {"requested": asked, "actual": asked, "off": 0.0,
                                                            "flagged": False}
    # the same-resources verdict first (pd vs dp on the same 2 GPUs), the capacity one separately, each named
    same, capacity = rep["verdicts"]
    assert rep["verdict"] == same and same["candidate"] == "pd" and same["baselines"] == ["dp"]
    assert same["resources"] == "same resources" and same["decision"] in ("adopt", "don't adopt")
    assert capacity["resources"] == "capacity" and capacity["baselines"] == ["single", "chunked"]
    verdicts = [x for x in text.splitlines() if x.startswith("Verdict:")]
    assert len(verdicts) == 2 and "same resources" in verdicts[0] and "capacity comparison" in verdicts[1]
    assert same["decided_by"] in text


def request_records(path: Path) -> int:
    """Request records in a bench file being written (a partial last line is not one yet)."""
    n = 0
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            n += json.loads(line).get("type") == "request"
        except ValueError:
            pass
    return n


def test_demo_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    """Ctrl-C in the middle of the first set-up's 60 s: the demo ends at once (not after its three
    set-ups), marks the records interrupted, and leaves no process behind."""
    out = tmp_path / "run"
    demo = subprocess.Popen([sys.executable, "-m", "pdproxy", "demo", "--out-dir", str(out), "--duration", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # under load: its instance and proxy run and the bench has written a request's record
        def under_load() -> set[int] | None:
            assert demo.poll() is None, f"the demo exited {demo.returncode}"
            kids = children_of(demo.pid)
            return kids if len(kids) >= 2 and request_records(out / "records-single.jsonl") >= 1 else None

        kids = wait_until(under_load, "the single set-up to run under load (instance, proxy, a request recorded)",
                          timeout=60, interval=0.1)
        interrupted_at = time.monotonic()
        demo.send_signal(signal.SIGINT)
        try:
            stdout, stderr = demo.communicate(timeout=scaled(20))  # the set-ups left would take minutes
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the demo still runs {scaled(20):.0f} s after Ctrl-C") from None
        took = time.monotonic() - interrupted_at
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    print(f"demo ended {took:.2f} s after Ctrl-C")
    assert demo.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    # the demo waited for its children: none may be left, not even as a zombie it did not reap
    assert not [k for k in kids if alive(k)], "children left running"
    lines = (out / "records-single.jsonl").read_text().splitlines()
    summary = json.loads(lines[-1])
    assert summary["type"] == "summary" and summary["interrupted"] is True
    assert not (out / "records-chunked.jsonl").exists(), "the next set-up started after Ctrl-C"


@pytest.mark.parametrize("args, msg", [(["--setups", "single,warp"], "unknown"), (["--xpyd", "1P"], "1P1D")])
def test_demo_bad_flags(args: list[str], msg: str, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "pdproxy", "demo", "--out-dir", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=60, env={**os.environ})
    assert p.returncode == 1 and msg in p.stderr and "Traceback" not in p.stderr
