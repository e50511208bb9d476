"""One bounded load phase: benchmarks/loadgen.py run once against a URL, with the proxy's CPU counted
over exactly the measured window (the load generator marks it on its stderr)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import stats
from .procs import HERE, Proc, placed


@dataclass
class PhaseResult:
    requests: int = 0
    errors: int = 0
    error_kinds: dict = field(default_factory=dict)
    events: int = 0
    seconds: float = 0.0
    client_cpu: float = 0.0
    proxy_cpu: float = 0.0
    background_cpu: float = 0.0  # CPU-seconds/second used by everything else on the machine
    max_open_streams: int = 0
    ttft_us: list = field(default_factory=list)
    gaps_us: list = field(default_factory=list)
    peak_rss_mb: float = 0.0
    rss_before_mb: float = 0.0  # hold phase: the proxy's RSS just before the streams opened

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def cps(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


def pct(values: list, q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def run_load(work: Path, url: str, proxy: Proc | None, *, concurrency: int, tokens: int, duration: float,
             warmup: float, prompt_words: int = 256, cpus: str | None = None, itl_ms: float | None = None,
             timings: bool = False, once: bool = False, ramp: float = 0.0, sample_rss: bool = False,
             on_mark: Callable[[str], None] | None = None) -> PhaseResult:
    """Run the load generator once (pinned to `cpus`); sample the proxy's CPU over exactly the measured
    window (and call `on_mark` with "measure-start" and "measure-end" as the window opens and closes)."""
    out_file = work / "loadgen-result.json"
    out_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "loadgen.py"), "--out", str(out_file), "--url", url,
           "--concurrency", str(concurrency), "--tokens", str(tokens), "--duration", str(duration),
           "--warmup", str(warmup), "--prompt-words", str(prompt_words)]
    if itl_ms is not None:
        cmd += ["--itl-ms", str(itl_ms)]
    if timings:
        cmd.append("--timings")
    if once:
        cmd.append("--once")
    cmd += ["--ramp", str(ramp)]
    proc = subprocess.Popen(placed(cmd, cpus), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marks: dict[str, tuple[float, tuple[int, int]]] = {}
    rss = [0.0]

    def watch_marks() -> None:
        for line in proc.stderr:
            line = line.strip()
            if line in ("measure-start", "measure-end"):
                marks[line] = (proxy.cpu_seconds() if proxy else 0.0, stats.machine_busy())
                if on_mark is not None:
                    on_mark(line)

    def watch_rss() -> None:
        while proc.poll() is None:
            rss[0] = max(rss[0], proxy.memory_mb("VmRSS"))
            time.sleep(0.2)

    threads = [threading.Thread(target=watch_marks, daemon=True)]
    if sample_rss and proxy is not None:
        threads.append(threading.Thread(target=watch_rss, daemon=True))
    for t in threads:
        t.start()
    proc.wait(timeout=duration + warmup + 120 + (60 if once else 0))
    for t in threads:
        t.join(5)
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"load generator failed ({proc.returncode}): {proc.stdout.read()[-2000:]}")
    raw = json.loads(out_file.read_text())
    r = PhaseResult(requests=raw["requests"], errors=raw["errors"], error_kinds=raw["error_kinds"],
                    events=raw["events"], seconds=raw["seconds"], client_cpu=raw.get("client_cpu", 0.0),
                    max_open_streams=raw["max_open_streams"], ttft_us=raw.get("ttft_us", []),
                    gaps_us=raw.get("gaps_us", []), peak_rss_mb=rss[0])
    if "measure-start" in marks and "measure-end" in marks:
        (c0, (b0, _)), (c1, (b1, _)) = marks["measure-start"], marks["measure-end"]
        r.proxy_cpu = c1 - c0
        machine = (b1 - b0) / stats.CLK_TCK  # CPU-seconds used by the whole machine in the window
        background = max(0.0, machine - r.proxy_cpu - r.client_cpu) / r.seconds if r.seconds else 0.0
        r.background_cpu = min(background, os.cpu_count() or 1)
    return r
