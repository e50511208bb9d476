"""Proxy overhead benchmark: pdproxy (tracing on and off) vs vllm-router vs vLLM's toy proxy vs direct.

One run, one machine, the same zero-delay upstreams and the same bounded load for every target,
one target at a time:

  direct        the load generator straight to the decode instance: the physical limit
  pdproxy       tracing on, exporting every span over OTLP/HTTP to a real receiver (benchmarks/otlp_sink.py)
  pdproxy-off   --no-tracing (metrics stay on)
  pdproxy-noattr  tracing on, --no-stall-attribution: the cost of the live stall attribution (per-instance
                record of KV arrivals / prefills, attribution of each stall) is pdproxy against this row
  vllm-router   PyPI vllm-router in P/D mode (round_robin), installed when missing
  toy-proxy     vLLM's toy_proxy_server.py, fetched from vLLM's sdist at run time (never committed)
  pdproxy-before, pdproxy-off-before
                the same two from another source tree (--baseline-path, e.g. a worktree of main), measured
                in the same run so that before/after ratios share one machine state
  pdproxy-2w    tracing on, --workers 2, on both CPUs (it shares CPU 0 with the load generator and the
                upstreams: only on a machine with cores to spare does this row show scaling)

Phases per target (`benchmarks/zero_upstream.py` upstreams, `benchmarks/loadgen.py` client):
  1. saturation, long streams: closed loop, zero-delay decode -> streamed chunks/s, CPU s per 1,000 chunks
  2. saturation, short streams: closed loop -> requests/s
  3. latency at concurrency 1, 64 and 256: the decode paces its tokens (one engine step every
     --itl-ms for all streams, as vLLM does) so the offered load is the same for every target and
     "added latency" means the proxy's own: TTFT and ITL percentiles at the client minus direct's
  4. hold: --hold-streams concurrent slow streams opened at once; errors and RSS growth per 1,000

CPU: on a 2-core machine the proxy under test is pinned to CPU 1 and everything else (load generator,
upstreams, OTLP receiver) to CPU 0, so each proxy gets one whole core (vllm-router's tokio runtime
sizes itself to that one core too). CPU seconds are read from /proc for the proxy's process tree.
The direct row shows the load generator's own ceiling against a trivial (zero-delay) endpoint.

Run (see README "Benchmarks"):  python benchmarks/overhead.py [--quick] [--targets ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import peers  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

HOST = "127.0.0.1"
TARGETS = ("direct", "pdproxy", "pdproxy-off", "vllm-router", "toy-proxy", "pdproxy-noattr", "pdproxy-before",
           "pdproxy-off-before", "pdproxy-2w")
DEFAULT_TARGETS = TARGETS[:6]
TRACED = ("pdproxy", "pdproxy-noattr", "pdproxy-before", "pdproxy-2w")
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# -- processes ---------------------------------------------------------------------------------


class Proc:
    """A child process in its own session (stopped with its whole group), optionally pinned to CPUs."""

    def __init__(self, name: str, args: list[str], cpus: str | None, log: Path, env: dict | None = None,
                 cwd: str | None = None) -> None:
        self.name = name
        args = _placed(args, cpus)
        self.log = log
        self._fh = open(log, "wb")
        self.popen = subprocess.Popen(args, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=cwd)

    def wait_http(self, url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.popen.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.1)
        raise TimeoutError(f"{self.name}: {url} not ready after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def pids(self) -> list[int]:
        """The process and all its descendants (workers, threads are inside)."""
        found, todo = [], [self.popen.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            todo += [int(c) for c in children]
        return found

    def cpu_seconds(self) -> float:
        """User + system CPU of the process tree so far (a `taskset` wrapper execs, so the pid is the proxy)."""
        total = 0
        for pid in self.pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / CLK_TCK

    def memory_mb(self, key: str) -> float:
        """VmRSS (now) or VmHWM (peak) summed over the tree, in MB."""
        total = 0
        for pid in self.pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith(key + ":"):
                        total += int(line.split()[1])
            except OSError:
                continue
        return total / 1024

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
            except ProcessLookupError:
                pass
        self._fh.close()


PRIORITY = -10  # niceness of every benchmark process when run as root (see _placed)


def _placed(args: list[str], cpus: str | None) -> list[str]:
    """Pin to `cpus`, and when root, run at a higher priority than the rest of the machine: on a shared
    machine another user's work would otherwise preempt the proxy under test between two token events,
    which shows up as milliseconds of "added latency" that belong to no proxy. Every target, the load
    generator and the upstreams get the same treatment."""
    if cpus is not None and shutil.which("taskset"):
        args = ["taskset", "-c", cpus, *args]
    if os.geteuid() == 0 and shutil.which("nice"):
        args = ["nice", "-n", str(PRIORITY), *args]
    return args


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, to report load from processes that are not ours."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


# -- one load phase ----------------------------------------------------------------------------


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


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs = self.work / "logs"
        self.logs.mkdir(exist_ok=True)
        pin = args.pin and (os.cpu_count() or 1) >= 2
        self.proxy_cpus = "1" if pin else None
        self.other_cpus = "0" if pin else None
        self.upstreams: list[Proc] = []
        self.wrap: list[str] = []  # a command the proxies run under (benchmarks/instructions.py: valgrind)
        self.receiver_url = ""
        self.prefill_port = self.decode_port = 0

    # upstreams shared by every target
    def start_upstreams(self) -> None:
        script = str(HERE / "zero_upstream.py")
        for role in ("prefill", "decode"):
            port = free_port()
            proc = Proc(f"upstream-{role}", [sys.executable, script, "--role", role, "--port", str(port)],
                        self.other_cpus, self.logs / f"upstream-{role}.log")
            proc.wait_http(f"http://{HOST}:{port}/health")
            self.upstreams.append(proc)
            setattr(self, f"{role}_port", port)

    def stop_all(self) -> None:
        for p in self.upstreams:
            p.stop()

    def load(self, url: str, proxy: Proc | None, *, concurrency: int, tokens: int, duration: float,
             warmup: float, itl_ms: float | None = None, timings: bool = False, once: bool = False,
             ramp: float = 0.0, sample_rss: bool = False, on_mark: Callable[[str], None] | None = None) -> PhaseResult:
        """Run the load generator once; sample the proxy's CPU over exactly the measured window (and call
        `on_mark` with "measure-start" and "measure-end" as the window opens and closes)."""
        out_file = self.work / "loadgen-result.json"
        out_file.unlink(missing_ok=True)
        cmd = [sys.executable, str(HERE / "loadgen.py"), "--out", str(out_file), "--url", url,
               "--concurrency", str(concurrency),
               "--tokens", str(tokens), "--duration", str(duration), "--warmup", str(warmup),
               "--prompt-words", str(self.args.prompt_words)]
        if itl_ms is not None:
            cmd += ["--itl-ms", str(itl_ms)]
        if timings:
            cmd.append("--timings")
        if once:
            cmd.append("--once")
        cmd += ["--ramp", str(ramp)]
        cmd = _placed(cmd, self.other_cpus)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        marks: dict[str, tuple[float, tuple[int, int]]] = {}
        rss = [0.0]

        def watch_marks() -> None:
            for line in proc.stderr:
                line = line.strip()
                if line in ("measure-start", "measure-end"):
                    marks[line] = (proxy.cpu_seconds() if proxy else 0.0, machine_busy())
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
            (c0, (b0, t0)), (c1, (b1, t1)) = marks["measure-start"], marks["measure-end"]
            r.proxy_cpu = c1 - c0
            cores = (os.cpu_count() or 1)
            machine = (b1 - b0) / CLK_TCK  # CPU-seconds used by the whole machine in the window
            r.background_cpu = max(0.0, machine - r.proxy_cpu - r.client_cpu) / r.seconds if r.seconds else 0.0
            r.background_cpu = min(r.background_cpu, cores)
        return r

    # the proxies
    def start_target(self, name: str) -> tuple[str, Proc | None, list[Proc]]:
        """Start `name`; returns its base URL, its process (None for direct) and helper processes."""
        prefill, decode = f"http://{HOST}:{self.prefill_port}", f"http://{HOST}:{self.decode_port}"
        if name == "direct":
            return decode, None, []
        port = free_port()
        url = f"http://{HOST}:{port}"
        helpers: list[Proc] = []
        log = self.logs / f"{name}.log"
        if name.startswith("pdproxy"):
            workers = 2 if name == "pdproxy-2w" else self.args.workers
            args = [*self.wrap, sys.executable, "-m", "pdproxy", "serve", "--host", HOST, "--port", str(port),
                    "--prefill", prefill, "--decode", decode, "--log-level", "warning", "--workers", str(workers)]
            if name in TRACED:
                tap_port = free_port()
                if self.args.otlp_receiver == "oteltap":
                    receiver = [shutil.which("oteltap") or "oteltap", "--port", str(tap_port)]
                else:
                    receiver = [sys.executable, str(HERE / "otlp_sink.py"), "--port", str(tap_port)]
                tap = Proc(self.args.otlp_receiver, receiver, self.other_cpus, self.logs / "otlp-receiver.log")
                helpers.append(tap)
                _wait_port(tap_port)
                self.receiver_url = f"http://{HOST}:{tap_port}"
                args += ["--otlp-endpoint", self.receiver_url, "--otlp-protocol", "http/protobuf"]
            else:
                args.append("--no-tracing")
            if name == "pdproxy-noattr":
                args.append("--no-stall-attribution")
            src = self.args.pdproxy_path or str(REPO)  # `python -m` looks in the working directory first
            if name.endswith("-before"):
                src = self.args.baseline_path
            cpus = "0,1" if name == "pdproxy-2w" and self.proxy_cpus else self.proxy_cpus
            proc = Proc(name, args, cpus, log, env={"PYTHONPATH": src}, cwd=src)
            proc.wait_http(url + "/health")
        elif name == "vllm-router":
            exe = peers.vllm_router()
            args = [*self.wrap, exe, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                    "--host", HOST, "--port", str(port), "--prometheus-host", HOST,
                    "--prometheus-port", str(free_port()), "--policy", "round_robin", "--log-level", "warning"]
            proc = Proc(name, args, self.proxy_cpus, log)
            proc.wait_http(url + "/health", timeout=120)
        elif name == "toy-proxy":
            script = peers.toy_proxy(self.work)
            args = [sys.executable, str(script), "--host", HOST, "--port", str(port), "--prefiller-host", HOST,
                    "--prefiller-port", str(self.prefill_port), "--decoder-host", HOST, "--decoder-port",
                    str(self.decode_port)]
            proc = Proc(name, args, self.proxy_cpus, log)
            proc.wait_http(url + "/healthcheck")
        else:
            raise ValueError(name)
        return url, proc, helpers

    def run_target(self, name: str) -> dict:
        a = self.args
        print(f"== {name}", flush=True)
        url, proxy, helpers = self.start_target(name)
        result: dict = {"name": name}
        try:
            # a short warm-up so connection pools and caches exist before anything is measured
            self.load(url, proxy, concurrency=16, tokens=16, duration=0.5, warmup=0.5)
            for key, tokens, label in (("sat_chunks", a.sat_tokens, "saturation (long streams)"),
                                       ("sat_requests", a.short_tokens, "saturation (short streams)")):
                for _ in range(a.rounds):  # best of N: other load on a shared machine only ever lowers it
                    wait_quiet(a.quiet_timeout)
                    r = self.load(url, proxy, concurrency=a.sat_concurrency, tokens=tokens, duration=a.duration,
                                  warmup=a.warmup)
                    _say(name, label, r)
                    if key not in result or r.events > result[key].events:
                        result[key] = r
            # TTFT of back-to-back single requests (zero-delay, 2 tokens): the proxy's own critical path,
            # without the wake-up cost of processes that sat idle between paced tokens (large on a VM)
            wait_quiet(a.quiet_timeout)
            result["ttft_warm"] = self.load(url, proxy, concurrency=1, tokens=2, duration=a.latency_duration,
                                            warmup=a.warmup, timings=True)
            _say(name, "TTFT back-to-back c=1", result["ttft_warm"])
            for c in a.concurrency:
                # users start spread over one answer's length, so arrivals are spread, not in lock-step
                spread = a.latency_tokens * a.itl_ms / 1000
                wait_quiet(a.quiet_timeout)
                r = self.load(url, proxy, concurrency=c, tokens=a.latency_tokens, duration=a.latency_duration,
                              warmup=max(a.warmup, spread + 0.5), itl_ms=a.itl_ms, timings=True, ramp=spread)
                result[f"lat_{c}"] = r
                _say(name, f"latency c={c}", r)
            if proxy is not None:
                result["peak_rss_mb"] = proxy.memory_mb("VmHWM")
            if a.hold_streams and proxy is not None and name in a.hold_targets:
                time.sleep(0.5)
                before = proxy.memory_mb("VmRSS")
                hold = self.load(url, proxy, concurrency=a.hold_streams, tokens=a.hold_tokens, duration=0,
                                 warmup=0, itl_ms=a.hold_itl_ms, once=True, ramp=a.hold_ramp, sample_rss=True)
                hold.rss_before_mb = before
                result["hold"] = hold
                _say(name, f"hold {a.hold_streams} streams", hold)
        finally:
            if proxy is not None:
                proxy.stop()  # SIGTERM: pdproxy flushes its span queue on the way out
            if name in TRACED and self.args.otlp_receiver == "sink":
                try:
                    with urllib.request.urlopen(self.receiver_url + "/count", timeout=5) as r:
                        result["spans_received"] = json.loads(r.read())
                except OSError:
                    pass
            for h in helpers:
                h.stop()
        return result


def recorder_cost(rounds: int, requests: int, stall_every: int, every_ms: float = 10.0,
                  inflight: int = 64) -> dict[str, float]:
    """CPU µs per request of the one recorder (pdproxy/telemetry/recorder.py) with the live stall attribution
    on and off, in this process, interleaved round by round so both see the same machine state.

    Each request goes the P/D way (admitted, prefill done, decode sent, 16 token events 5 ms apart,
    finished) on one decode, every `stall_every`-th with one 150 ms gap in the middle (0: none); a new one
    every `every_ms` of its own timeline (100 requests/s on the decode by default: a stall then coincides
    with ~15 other KV arrivals), `inflight` of them open at once. The attribution path (the record's query, the pd.stall event's cause, the links) runs once
    per request. Spans are built and encoded to OTLP, then dropped; metrics are recorded.
    """
    sys.path.insert(0, str(REPO))
    from pdproxy.telemetry.metrics import Metrics
    from pdproxy.telemetry.recorder import Recorder
    from pdproxy.telemetry.stalls import StallRecords
    from pdproxy.telemetry.tracing import Tracing

    class Drop:
        async def send(self, payload: bytes) -> bool:
            return True

        async def close(self) -> None:
            pass

    ms = 1_000_000

    async def one_round(attribution: bool) -> float:
        tracing = Tracing({"service.name": "bench"}, [Drop()], 1 << 17, on_drop=lambda reason, count: None)
        recorder = Recorder(Metrics(), tracing, stall_threshold=0.1,
                            stalls=StallRecords() if attribution else None)
        open_: list = []
        base = time.monotonic_ns()
        start = time.process_time()
        for i in range(requests):
            trace = recorder.begin(route="completions", operation="text_completion", chat=False, headers={},
                                   request_id=f"r{i}", pd_mode=True)
            at = base + int(i * every_ms * ms)  # this request's own timeline
            trace.admitted("127.0.0.1:8100", "127.0.0.1:8200")
            trace.prefill_done("127.0.0.1:8100", 200, 1, "{}")
            trace.t.prefill_done = at
            trace.decode_sent("127.0.0.1:8200")
            trace.decode_headers(200)
            first = at + 20 * ms  # its KV arrives in 20 ms
            gap = 150 * ms if stall_every and i % stall_every == 0 else 0
            trace.scan.chunk_times = [first + 5 * ms * k + (gap if k >= 8 else 0) for k in range(16)]
            trace.scan.chunk_tokens = [1] * 16
            trace.scan.usage = {"prompt_tokens": 200 + i % 7, "completion_tokens": 16}
            trace.scan.done = True
            open_.append(trace)
            if len(open_) > inflight:
                open_.pop(0).finish()
        for trace in open_:
            trace.finish()
        await tracing.shutdown()  # every span framed and handed over: its CPU is in the round's
        return (time.process_time() - start) / requests * 1e6

    on, off = [], []
    for r in range(rounds):  # alternate which goes first
        for attribution in ((True, False) if r % 2 == 0 else (False, True)):
            (on if attribution else off).append(asyncio.run(one_round(attribution)))
    return {"on_us": float(np.median(on)), "off_us": float(np.median(off)), "rounds": rounds, "requests": requests,
            "every_ms": every_ms, "stall_every": stall_every}


def wait_quiet(timeout: float, threshold: float = 0.25) -> float:
    """Wait (up to `timeout` s) until the rest of the machine uses under `threshold` cores for a second;
    between phases our own processes are idle, so what is busy then is someone else's. Returns the load."""
    deadline = time.monotonic() + timeout
    while True:
        (b0, t0), start = machine_busy(), time.monotonic()
        time.sleep(1.0)
        (b1, t1), elapsed = machine_busy(), time.monotonic() - start
        busy = (b1 - b0) / CLK_TCK / elapsed
        if busy < threshold or time.monotonic() > deadline:
            return busy


def _wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {port}")


def _say(name: str, what: str, r: PhaseResult) -> None:
    extra = f" open={r.max_open_streams}" if r.max_open_streams else ""
    print(f"   {what:28s} {r.rps:9.0f} req/s {r.cps:10.0f} chunks/s  errors={r.errors}{extra}"
          f"  proxy_cpu={r.proxy_cpu:.2f}s client_cpu={r.client_cpu:.2f}s bg={r.background_cpu:.2f}", flush=True)


# -- report ------------------------------------------------------------------------------------


def pct(values: list, q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def report(results: dict[str, dict], args: argparse.Namespace, started: datetime.datetime) -> str:
    lines: list[str] = []
    out = lines.append
    direct = results.get("direct")
    out(f"pdproxy overhead benchmark  {started:%Y-%m-%d %H:%M} UTC  on {_machine()}")
    out(f"upstreams: benchmarks/zero_upstream.py (zero delay; latency phases paced at {args.itl_ms:g} ms/token); "
        f"prompt {args.prompt_words} words; pinning: {'proxy CPU 1, rest CPU 0' if args.pin else 'none'}")
    out(f"saturation: concurrency {args.sat_concurrency}, {args.sat_tokens} tokens (chunks/s) and "
        f"{args.short_tokens} tokens (req/s), {args.duration:g} s each, best of {args.rounds}; latency: {args.latency_tokens} tokens, "
        f"{args.latency_duration:g} s per concurrency")
    out("")
    out("| target | req/s | chunks/s | CPU s / 1k chunks | CPU ms / req | peak RSS MB | client CPU % | other CPU "
        "| errors |")
    out("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        sc, sr = r["sat_chunks"], r["sat_requests"]
        cpu = f"{sc.proxy_cpu / sc.events * 1000:.4f}" if sc.events and name != "direct" else "-"
        per_req = f"{sr.proxy_cpu / sr.requests * 1000:.3f}" if sr.requests and name != "direct" else "-"
        rss = f"{r['peak_rss_mb']:.0f}" if "peak_rss_mb" in r else "-"
        errors = sum(v.errors for k, v in r.items() if isinstance(v, PhaseResult))
        out(f"| {name} | {sr.rps:.0f} | {sc.cps:.0f} | {cpu} | {per_req} | {rss} | {sc.client_cpu / sc.seconds * 100:.0f} | "
            f"{sc.background_cpu:.2f} | {errors} |")
    out("")
    out("Latency at the client, added to direct's (ms; difference of percentiles; paced decode; TTFT warm: "
        "back-to-back single requests of 2 zero-delay tokens):")
    head = "| target | +TTFT p50/p99 warm c=1 | " + " | ".join(f"+TTFT p50/p99 c={c}" for c in args.concurrency) + " | " + \
        " | ".join(f"+ITL p50/p99 c={c}" for c in args.concurrency) + " |"
    out(head)
    out("|---|" + "---:|" * (2 * len(args.concurrency) + 1))
    for name, r in results.items():
        cells = []
        values, base = r["ttft_warm"].ttft_us, direct["ttft_warm"].ttft_us if direct else []
        if name == "direct":
            cells.append(f"({pct(values, 50) / 1000:.3f} / {pct(values, 99) / 1000:.3f})" if values else "-")
        elif values and base:
            cells.append(f"{(pct(values, 50) - pct(base, 50)) / 1000:+.3f} / {(pct(values, 99) - pct(base, 99)) / 1000:+.3f}")
        else:
            cells.append("-")
        for metric in ("ttft_us", "gaps_us"):
            for c in args.concurrency:
                values, base = getattr(r[f"lat_{c}"], metric), getattr(direct[f"lat_{c}"], metric) if direct else []
                if name == "direct":
                    cells.append(f"({pct(values, 50) / 1000:.3f} / {pct(values, 99) / 1000:.3f})" if values else "-")
                elif values and base:
                    cells.append(f"{(pct(values, 50) - pct(base, 50)) / 1000:+.3f} / "
                                 f"{(pct(values, 99) - pct(base, 99)) / 1000:+.3f}")
                else:
                    cells.append("-")
        out(f"| {name} | " + " | ".join(cells) + " |")
    out("(direct row: absolute values in parentheses)")
    out("client CPU %: the load generator's share of its core in the chunks/s phase; other CPU: cores used by "
        "everything else (upstreams, OTLP receiver, other users of the machine) during it.")
    holds = {n: r["hold"] for n, r in results.items() if "hold" in r}
    if holds:
        out("")
        out(f"Hold: {args.hold_streams} concurrent streams ({args.hold_tokens} tokens at {args.hold_itl_ms:g} ms, "
            f"opened over {args.hold_ramp:g} s):")
        out("| target | streams open at once | completed | errors | RSS before MB | RSS peak MB | MB per 1,000 streams |")
        out("|---|---:|---:|---:|---:|---:|---:|")
        for name, h in holds.items():
            before = h.rss_before_mb
            per = (h.peak_rss_mb - before) / (args.hold_streams / 1000)
            kinds = f" {h.error_kinds}" if h.errors else ""
            out(f"| {name} | {h.max_open_streams} | {h.requests} | {h.errors}{kinds} | {before:.0f} | "
                f"{h.peak_rss_mb:.0f} | {per:.1f} |")
    pd = results.get("pdproxy")
    if pd and "spans_received" in pd:
        requests = sum(v.requests for v in pd.values() if isinstance(v, PhaseResult))
        out("")
        out(f"Tracing on: the OTLP receiver got {pd['spans_received']['spans']} spans in "
            f"{pd['spans_received']['requests']} export requests ({pd['spans_received']['bad']} undecodable) for "
            f"at least {requests} measured requests (5 spans each; warm-up and drain requests are traced too).")
    out("")
    out(ratios(results, args))
    return "\n".join(lines)


def ratios(results: dict[str, dict], args: argparse.Namespace) -> str:
    lines = ["Ratios and targets:"]
    pd, off = results.get("pdproxy"), results.get("pdproxy-off")

    def cps(name: str) -> float | None:
        r = results.get(name)
        return r["sat_chunks"].cps if r else None

    def per_cpu(name: str) -> float:
        """Chunks per CPU-second of the proxy: what it would do with its core to itself."""
        r = results[name]["sat_chunks"]
        return r.events / r.proxy_cpu

    def check(label: str, value: float | None, ok: bool | None, target: str) -> None:
        shown = "n/a" if value is None else f"{value:.2f}"
        verdict = "n/a" if ok is None else ("MET" if ok else "NOT MET")
        lines.append(f"  {label:48s} {shown:>10s}   target {target:10s} {verdict}")

    if pd:
        for peer, need in (("vllm-router", 1.0), ("direct", 0.8), ("toy-proxy", 3.0)):
            if cps(peer):
                v = cps("pdproxy") / cps(peer)
                check(f"chunks/s pdproxy / {peer}", v, v >= need, f">= {need:g}")
        for peer, need in (("vllm-router", 0.6), ("toy-proxy", None)):
            r = results.get(peer)
            if r:
                v = pd["sat_requests"].rps / r["sat_requests"].rps
                check(f"req/s pdproxy / {peer}", v, None if need is None else v >= need,
                      "(info)" if need is None else f">= {need:g}")
        sr = pd["sat_requests"]
        if sr.requests:
            v = sr.proxy_cpu / sr.requests * 1000
            check("CPU ms per request (8-token streams)", v, v <= 0.25, "<= 0.25")
        for peer in ("vllm-router", "pdproxy-off"):
            if results.get(peer) and results[peer]["sat_chunks"].proxy_cpu:
                v = per_cpu("pdproxy") / per_cpu(peer)
                check(f"chunks per CPU-second pdproxy / {peer}", v, None, "(info)")
        for cost in getattr(args, "recorder_cost", None) or ():
            added = cost["on_us"] - cost["off_us"]
            which = f"1 in {cost['stall_every']} stalls" if cost["stall_every"] else "no stalls"
            check(f"recorder µs/req on/off, {which} ({cost['on_us']:.0f} / {cost['off_us']:.0f})",
                  cost["on_us"] / cost["off_us"], None, "(info)")
            if sr.requests:  # the attribution's added µs against the whole proxy's CPU per request
                v = 1 + added / (sr.proxy_cpu / sr.requests * 1e6)
                check(f"CPU per request with attribution / without, {which}", v,
                      v <= 1.03 if not cost["stall_every"] else None, "<= 1.03" if not cost["stall_every"] else "(info)")
        noattr = results.get("pdproxy-noattr")
        if noattr and sr.requests and noattr["sat_requests"].requests:
            na = noattr["sat_requests"]
            v = (sr.proxy_cpu / sr.requests) / (na.proxy_cpu / na.requests)
            check("CPU per request, stall attribution on / off", v, v <= 1.03, "<= 1.03")
            sc, nc = pd["sat_chunks"], noattr["sat_chunks"]
            if sc.events and nc.events:
                v = (sc.proxy_cpu / sc.events) / (nc.proxy_cpu / nc.events)
                check("CPU per chunk, stall attribution on / off", v, None, "(info)")
        if off:
            v = cps("pdproxy") / cps("pdproxy-off")
            check("chunks/s tracing on / off", v, v >= 0.9, ">= 0.9")
            v = pd["sat_requests"].rps / off["sat_requests"].rps
            check("req/s tracing on / off", v, v >= 0.9, ">= 0.9")
        direct, router = results.get("direct"), results.get("vllm-router")
        if direct:
            for key, label in (("ttft_warm", "warm"), ("lat_1", "paced")):
                if key not in pd:
                    continue
                added = (pct(pd[key].ttft_us, 50) - pct(direct[key].ttft_us, 50)) / 1000
                if router:
                    peer = (pct(router[key].ttft_us, 50) - pct(direct[key].ttft_us, 50)) / 1000
                    check(f"added TTFT p50 c=1 {label} ms (vllm-router {peer:.3f})", added, added <= peer, "<= router")
                else:
                    check(f"added TTFT p50 c=1 {label} ms", added, None, "<= router")
        if direct and 256 in args.concurrency:
            added = (pct(pd["lat_256"].ttft_us, 50) - pct(direct["lat_256"].ttft_us, 50)) / 1000
            check("added TTFT p50 c=256 ms", added, added <= 5.0, "<= 5")
        if direct and 64 in args.concurrency:
            added = (pct(pd["lat_64"].gaps_us, 99) - pct(direct["lat_64"].gaps_us, 99)) / 1000
            check("added ITL p99 c=64 ms", added, added < 1.0, "< 1")
        if "hold" in pd:
            h = pd["hold"]
            per = (h.peak_rss_mb - h.rss_before_mb) / (args.hold_streams / 1000)
            check("MB per 1,000 concurrent streams", per, per < 100, "< 100")
            check(f"{args.hold_streams} streams held, errors", h.errors,
                  h.errors == 0 and h.max_open_streams >= args.hold_streams, "0")
    two = results.get("pdproxy-2w")
    if pd and two:
        check("req/s pdproxy-2w / pdproxy", two["sat_requests"].rps / pd["sat_requests"].rps, None, "(info)")
        check("chunks/s pdproxy-2w / pdproxy", cps("pdproxy-2w") / cps("pdproxy"), None, "(info)")
    lines += before_after(results)
    return "\n".join(lines)


def before_after(results: dict[str, dict]) -> list[str]:
    """pdproxy against the --baseline-path tree, both measured in this run (after / before)."""
    lines = []
    direct = results.get("direct")
    for after, before in (("pdproxy", "pdproxy-before"), ("pdproxy-off", "pdproxy-off-before")):
        a, b = results.get(after), results.get(before)
        if not (a and b):
            continue
        if not lines:
            lines += ["", "Before / after (--baseline-path tree vs this tree, same run):",
                      f"  {'':24s} {'req/s':>8s} {'chunks/s':>9s} {'CPU ms/req':>11s} {'CPU s/1k ch':>12s} "
                      f"{'+TTFT warm':>11s} {'+TTFT c=256':>12s}"]
        for name, r in ((before, b), (after, a)):
            sc, sr = r["sat_chunks"], r["sat_requests"]
            cells = [f"{sr.rps:8.0f}", f"{sc.cps:9.0f}",
                     f"{sr.proxy_cpu / sr.requests * 1000:11.3f}" if sr.requests else f"{'-':>11s}",
                     f"{sc.proxy_cpu / sc.events * 1000:12.4f}" if sc.events else f"{'-':>12s}"]
            for key, width in (("ttft_warm", 11), ("lat_256", 12)):
                if direct and key in r and r[key].ttft_us and direct[key].ttft_us:
                    cells.append(f"{(pct(r[key].ttft_us, 50) - pct(direct[key].ttft_us, 50)) / 1000:+{width}.3f}")
                else:
                    cells.append(f"{'-':>{width}s}")
            lines.append(f"  {name:24s} " + " ".join(cells))
    return lines


def _machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PHYS_PAGES") * PAGE / 2 ** 30
    return (f"{os.cpu_count()} x {model}, {mem:.0f} GiB, Linux {platform.release()}, Python {platform.python_version()}, "
            f"{socket.gethostname()}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", choices=TARGETS,
                   help=f"default: {' '.join(DEFAULT_TARGETS)}, and the two -before targets with --baseline-path")
    p.add_argument("--quick", action="store_true", help="short phases, concurrency 1 and 64, small hold (a smoke run)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured per saturation phase")
    p.add_argument("--latency-duration", type=float, default=4.0, help="seconds measured per latency phase")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--sat-concurrency", type=int, default=128)
    p.add_argument("--sat-tokens", type=int, default=256, help="tokens per request in the chunks/s phase")
    p.add_argument("--short-tokens", type=int, default=8, help="tokens per request in the requests/s phase")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--latency-tokens", type=int, default=32)
    p.add_argument("--itl-ms", type=float, default=10.0, help="decode token period in the latency phases")
    p.add_argument("--prompt-words", type=int, default=256)
    p.add_argument("--hold-streams", type=int, help="concurrent streams of the hold phase (default 5000, --quick 500; "
                                                    "0 skips it)")
    p.add_argument("--hold-tokens", type=int, default=20)
    p.add_argument("--hold-itl-ms", type=float, default=1000.0)
    p.add_argument("--hold-ramp", type=float, default=4.0)
    p.add_argument("--hold-targets", nargs="+", choices=TARGETS, default=["pdproxy", "vllm-router"],
                   help="targets that get the hold phase (the toy proxy takes minutes to open 5,000 streams)")
    p.add_argument("--rounds", type=int, default=2, help="saturation runs per target; the best is kept")
    p.add_argument("--quiet-timeout", type=float, default=8.0,
                   help="seconds to wait before a phase for other processes on the machine to go quiet")
    p.add_argument("--workers", default="1", help="pdproxy --workers (a number, or auto: one per CPU it may use)")
    p.add_argument("--pdproxy-path", help="run pdproxy from this source tree instead (e.g. a git worktree of an "
                                          "older commit, for before/after figures)")
    p.add_argument("--baseline-path", help="also measure pdproxy from this source tree (targets pdproxy-before, "
                                           "pdproxy-off-before), for before/after ratios from one run")
    p.add_argument("--otlp-receiver", choices=("sink", "oteltap"), default="sink",
                   help="where pdproxy exports spans with tracing on (benchmarks/otlp_sink.py, or oteltap, whose "
                        "JSON printing costs the shared CPU more than the proxy's tracing)")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin processes to CPUs")
    p.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "pdproxy-bench"),
                   help="logs and the fetched toy proxy (outside the repository)")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--markdown", help="also write the report here")
    p.add_argument("--report-only", metavar="JSON", help="print the report of an earlier run's --json file")
    return p


def bench_from(work_dir: str, baseline_path: str | None = None, pdproxy_path: str | None = None,
               pin: bool = True) -> Bench:
    """A Bench with this benchmark's defaults, for the interleaved benchmarks that drive its targets."""
    return Bench(parser().parse_args(
        ["--work-dir", work_dir, *(["--baseline-path", baseline_path] if baseline_path else []),
         *(["--pdproxy-path", pdproxy_path] if pdproxy_path else []), *([] if pin else ["--no-pin"])]))


def main() -> int:
    p = parser()
    args = p.parse_args()
    if args.report_only:
        raw = json.loads(Path(args.report_only).read_text())
        args.__dict__.update(raw.pop("_args", {}))
        results = {n: {k: (PhaseResult(**v) if isinstance(v, dict) and "events" in v else v) for k, v in r.items()}
                   for n, r in raw.items()}
        started = datetime.datetime.fromisoformat(raw_started) if (raw_started := args.__dict__.get("started")) \
            else datetime.datetime.now(datetime.timezone.utc)
        print(report(results, args, started))
        return 0
    if args.quick:
        args.duration, args.latency_duration, args.warmup, args.rounds, args.quiet_timeout = 1.5, 1.5, 0.5, 1, 0
        args.concurrency = [1, 64]
        args.hold_ramp, args.hold_tokens, args.hold_itl_ms = 0.5, 4, 200.0
    if args.targets is None:
        args.targets = list(DEFAULT_TARGETS) + (["pdproxy-before", "pdproxy-off-before"] if args.baseline_path else [])
    if any(t.endswith("-before") for t in args.targets) and not args.baseline_path:
        p.error("the -before targets need --baseline-path")
    if args.hold_streams is None:
        args.hold_streams = 500 if args.quick else 5000
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    bench = Bench(args)
    results: dict[str, dict] = {}
    try:
        bench.start_upstreams()
        for name in args.targets:
            results[name] = bench.run_target(name)
    finally:
        bench.stop_all()
    if "pdproxy-noattr" in args.targets:
        # in-process, interleaved: zero-delay streams never stall (what the phases above measured), and a
        # worst case where every 10th request stalls on a decode taking 100 requests/s
        n = 2000 if args.quick else 5000
        args.recorder_cost = [recorder_cost(rounds=3 if args.quick else 9, requests=n, stall_every=k) for k in (0, 10)]
    text = report(results, args, started)
    text += f"\n\n(total wall time {time.monotonic() - t0:.0f} s)"
    print()
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        raw = {n: {k: (v.__dict__ if isinstance(v, PhaseResult) else v) for k, v in r.items()}
               for n, r in results.items()}
        keep = ("itl_ms", "prompt_words", "pin", "sat_concurrency", "sat_tokens", "short_tokens", "duration", "rounds",
                "latency_tokens", "latency_duration", "concurrency", "hold_streams", "hold_tokens", "hold_itl_ms",
                "hold_ramp", "recorder_cost")
        raw["_args"] = {k: getattr(args, k, None) for k in keep} | {"started": started.isoformat()}
        Path(args.json).write_text(json.dumps(raw))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
