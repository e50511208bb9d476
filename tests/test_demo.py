"""`pdproxy demo` with its default settings (the README's main-job command), and Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import procs
from waits import scaled, wait_until

# the rows that decide (their labels' first words: a label wraps in its column at 100 columns); the others
# (ITL pooled, TPOT, per class, ...) come with --all
ROWS = ("TTFT", "tail ITL:", "KV transfer,", "throughput,", "error rate", "Verdict:")


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


def descendants_of(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        kids = children_of(todo.pop()) - found
        found |= kids
        todo += kids
    return found


def kill_sessions(pids: set[int]) -> None:
    """The test's own clean-up of the demo's children (each leads its own session), should the demo not have."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def cpu_load(seconds: float) -> Iterator[None]:
    """Twice as many busy-looping processes as cores, for at most `seconds` (and stopped on leaving): a busy machine."""
    spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    spinners = [procs.Proc([sys.executable, "-c", spin], name="spin") for _ in range(2 * (os.cpu_count() or 1))]
    try:
        yield
    finally:
        procs.kill_groups([s.popen for s in spinners])


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
    assert "ITL pooled" not in text and re.search(r"\d+ more rows .*add --all", " ".join(text.split()))
    # each role's own columns: the dp run's instances are single ones, P/D's prefill has no decode-side stalls
    assert "Per single instance, dp" in text and "Per decode instance, dp" not in text
    prefill = text.split("Per prefill instance, pd", 1)[1].split("Per decode instance, pd", 1)[0]
    assert "stalls" not in prefill and "KV wait" not in prefill
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
        assert printed in text or printed.replace(" / ", "/") in text  # the table shows the report's numbers
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
    assert same["resources"] == "same resources" and same["decision"] in (
        "adopt", "don't adopt", "trade-off", "no measurable difference")
    assert capacity["resources"] == "capacity" and capacity["baselines"] == ["single", "chunked"]
    verdicts = [x for x in text.splitlines() if x.startswith("Verdict:")]
    assert len(verdicts) == 2 and "same resources" in verdicts[0] and "capacity comparison" in verdicts[1]
    assert same["decided_by"] is None or same["decided_by"] in text


def request_records(path: Path) -> int:
    """Request records in a bench file being written (a partial last line is not one yet)."""
    n = 0
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            n += json.loads(line).get("type") == "request"
        except ValueError:
            pass
    return n


def start_demo_under_load(out: Path) -> tuple[procs.Proc, set[int]]:
    """The demo with a 60 s first set-up, once its instance and proxy run and the bench has recorded a request;
    the demo and its processes."""
    demo = procs.pdproxy("demo", "--out-dir", str(out), "--duration", "60", "--setups", "single,pd", name="demo")

    def under_load() -> set[int] | None:
        assert demo.popen.poll() is None, f"the demo exited {demo.popen.returncode}:\n{demo.output()}"
        kids = descendants_of(demo.popen.pid)
        return kids if len(kids) >= 2 and request_records(out / "records-single.jsonl") >= 1 else None

    try:
        return demo, wait_until(under_load, "the single set-up to run under load (instance, proxy, a request "
                                            "recorded)", timeout=60, interval=0.1)
    except BaseException:
        demo.stop()
        raise


def test_demo_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    """Ctrl-C in the middle of the first set-up's 60 s on a busy machine (more busy loops than cores): the demo
    ends within a bound (not after its set-ups left), marks the records interrupted, and has stopped and reaped
    every process it started."""
    out = tmp_path / "run"
    kids: set[int] = set()
    with cpu_load(scaled(120)):
        demo, kids = start_demo_under_load(out)
        try:
            interrupted_at = time.monotonic()
            demo.popen.send_signal(signal.SIGINT)
            try:
                demo.popen.wait(scaled(20))  # the set-ups left would take minutes
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the demo still runs {scaled(20):.0f} s after Ctrl-C") from None
            took = time.monotonic() - interrupted_at
            # the demo waited for its children: none may be left, not even as a zombie it did not reap
            left = [k for k in kids if procs.running(k)]
        finally:
            demo.stop()
            kill_sessions(kids)
    print(f"demo ended {took:.2f} s after Ctrl-C")
    output = demo.output()
    assert not left, f"children left running after the demo ended: {left}"
    assert demo.popen.returncode == 130, output
    assert "interrupted" in output and "Traceback" not in output, output
    lines = (out / "records-single.jsonl").read_text().splitlines()
    summary = json.loads(lines[-1])
    assert summary["type"] == "summary" and summary["interrupted"] is True
    assert not (out / "records-pd.jsonl").exists(), "the next set-up started after Ctrl-C"


def test_demo_killed_takes_its_processes_along(tmp_path: Path) -> None:
    """SIGKILL leaves the demo no say: the kernel stops its instance and proxy (they die with their parent)."""
    demo, kids = start_demo_under_load(tmp_path / "run")
    try:
        demo.popen.kill()
        demo.popen.wait()
        wait_until(lambda: not [k for k in kids if procs.running(k)], f"the demo's processes {sorted(kids)} to end", timeout=5)
    finally:
        demo.stop()
        kill_sessions(kids)


@pytest.mark.parametrize("args, msg", [(["--setups", "single,warp"], "unknown"), (["--xpyd", "1P"], "1P1D")])
def test_demo_bad_flags(args: list[str], msg: str, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "pdproxy", "demo", "--out-dir", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=60, env={**os.environ})
    assert p.returncode == 1 and msg in p.stderr and "Traceback" not in p.stderr
