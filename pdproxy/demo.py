"""`pdproxy demo`: single, chunked prefill, data parallel and P/D on simulated vLLM instances, end to end.

For each set-up, one after the other, it starts real processes on loopback — simulated vLLM
instances (`pdproxy sim`) and the proxy (`pdproxy serve --trace-file ...`) in front of them —
drives the same seeded load through the proxy with `pdproxy bench`, stops them, and finally
prints `pdproxy report`'s comparison (TTFT, ITL, tail ITL, KV transfer, throughput, error rate) with
the adopt / don't-adopt verdicts, plus where records, traces and the HTML page are. The verdict on
the same resources comes first: P/D against as many single instances behind the proxy as P/D has
GPUs (`dp`, data parallel); the one against the 1-GPU single and chunked set-ups is a capacity
comparison, and says so.

The load is the shape measured on real H200s (tests/fixtures/vllm023/real-vllm-h200.md): closed-loop streams
with short prompts plus one long prompt at a steady rate. Long prefills stall the streams'
decode steps on a single instance; chunked prefill bounds the stall; P/D moves prefill off the
decode instance but pays a KV transfer. The simulated instances run `--time-scale` times slower
than the preset's real timings so that two CPU cores keep up with the token stream; all numbers
printed are measured at that scale.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from pdproxy import __version__
from pdproxy.bench import attribution, html, report, runner, table, traces, waterfall
from pdproxy.bench.records import Run
from pdproxy.bench.report_cli import add_slo_arguments, slo_from
from pdproxy.bench.workload import TrafficClass, Workload
from pdproxy.children import Group

HOST = "127.0.0.1"
SETUPS = ("single", "chunked", "dp", "pd")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("Results (records, traces, report.json, report.html, process logs) go to a new directory\n"
                "./pdproxy-demo-YYYYmmdd-HHMMSS in the current directory, or to --output-dir DIR.\n"
                "Defaults finish in well under 2 minutes on 2 cores. Ctrl-C stops everything it started.")
    p.add_argument("--setups", default=",".join(SETUPS),
                   help="comma-separated subset of single (1 GPU), chunked (1 GPU, chunked prefill), dp (as many "
                        "single instances behind the proxy as P/D has GPUs: the same-resources baseline) and pd "
                        "(default: all four)")
    p.add_argument("--xpyd", default="1P1D", help="P/D topology, e.g. 1P1D, 2P1D, 1P2D (default 1P1D)")
    p.add_argument("--duration", type=float, default=16.0, help="seconds of load per set-up, warm-up included (16)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds excluded from statistics (3)")
    p.add_argument("--streams", type=int, default=8, help="closed-loop streams with short prompts (8)")
    p.add_argument("--stream-prompt", default="200", help="stream prompt length in tokens: N or LOW-HIGH (200)")
    p.add_argument("--stream-output", default="64", help="stream max_tokens: N or LOW-HIGH (64)")
    p.add_argument("--long-prompt", default="3000", help="long prompt length in tokens (3000)")
    p.add_argument("--long-output", default="16", help="long prompt max_tokens (16)")
    p.add_argument("--long-every", type=float, default=1.5, help="one long prompt every S seconds (1.5); 0 = none")
    p.add_argument("--chunk-tokens", type=int, default=2048, help="max-num-batched-tokens of the chunked set-up")
    stall = p.add_mutually_exclusive_group()
    stall.add_argument("--kv-pull-stalls-decode", dest="kv_pull_stalls_decode", action="store_true", default=None,
                       help="P/D decodes start no step for a KV pull's link time, as recorded on two real H200s "
                            "(tests/fixtures/vllm023): the decode's streams stall on other requests' KV arrivals "
                            "(the default preset h200-llama8b-2gpu does)")
    stall.add_argument("--no-kv-pull-stalls-decode", dest="kv_pull_stalls_decode", action="store_false",
                       help="P/D decodes keep stepping during KV pulls")
    p.add_argument("--batch-tokens", type=int, default=16384, help="max-num-batched-tokens of the other set-ups")
    p.add_argument("--preset", default="h200-llama8b-2gpu", help="simulator preset (default h200-llama8b-2gpu)")
    p.add_argument("--time-scale", type=float, default=4.0,
                   help="simulated instances run this many times slower than the preset (4)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the workload's random draws (prompt and output lengths): the same seed sends the same "
                        "requests (0)")
    p.add_argument("--all", action="store_true", dest="all_rows",
                   help="every row of the results table (default: the rows that decide; report.html has them all)")
    p.add_argument("--output-dir", "--out-dir", dest="out_dir", metavar="DIR",
                   help="where results go (default: a new ./pdproxy-demo-YYYYmmdd-HHMMSS)")
    add_slo_arguments(p.add_argument_group("verdict SLOs (as in pdproxy report)"))


class DemoError(RuntimeError):
    """Something the user can act on (a port, a process that would not start)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log: Path
    url: str


@dataclass
class Processes:
    """Every child process of one set-up (pdproxy/children.py: own sessions, dead with the demo), stopped
    together whatever happens."""

    logs: Path
    children: list[Child] = field(default_factory=list)
    group: Group = field(default_factory=Group)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        port = free_port()
        log = self.logs / f"{name}.log"
        fh = open(log, "wb")
        cmd = [sys.executable, "-m", "pdproxy", *args, "--host", HOST, "--port", str(port)]
        try:
            popen = self.group.spawn(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        finally:
            fh.close()
        child = Child(name, popen, log, f"http://{HOST}:{port}")
        self.children.append(child)
        return child

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for c in self.children:
            while True:
                if c.popen.poll() is not None:
                    tail = c.log.read_text(errors="replace")[-1500:]
                    raise DemoError(f"{c.name} exited with {c.popen.returncode}; its log ({c.log}):\n{tail}")
                try:
                    with urllib.request.urlopen(c.url + "/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise DemoError(f"{c.name} not healthy after {timeout:g}s; see {c.log}")
                time.sleep(0.05)

    def stop_all(self, timeout: float = 8.0) -> None:
        """SIGTERM every child at once (each flushes its trace file), SIGKILL what is left after `timeout`,
        reap them all; an interruption meanwhile only skips the rest of the wait."""
        self.group.stop(timeout)
        self.children.clear()


class Stopper:
    """What SIGINT and SIGTERM do while the demo runs.

    The first one tells the running set-up's children to stop at once (SIGTERM), and a watchdog thread
    SIGKILLs and reaps whichever still run INTERRUPT_GRACE seconds later: however slowly the demo itself
    unwinds on a busy machine, its children are gone by then. The demo then unwinds: the bench's task is
    cancelled (it writes its summary, marked interrupted) or KeyboardInterrupt is raised. Later signals
    are ignored, the stop being under way; if unwinding still has not ended the demo EXIT_BOUND seconds
    after the signal, the watchdog ends the process."""

    INTERRUPT_GRACE = 3.0
    EXIT_BOUND = 12.0

    def __init__(self) -> None:
        self.procs: Processes | None = None
        self.signalled = False
        self._cancel: Any = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signalled:
            return
        self.signalled = True
        procs = self.procs
        if procs is not None:
            procs.group.signal(signal.SIGTERM)
        threading.Thread(target=self._watchdog, args=(procs,), name="pdproxy-demo-stop", daemon=True).start()
        if self._cancel is not None:
            self._cancel()
        else:
            raise KeyboardInterrupt

    def _watchdog(self, procs: Processes | None) -> None:
        t0 = time.monotonic()
        if procs is not None:
            procs.group.kill_after(self.INTERRUPT_GRACE)
        time.sleep(max(0.0, self.EXIT_BOUND - (time.monotonic() - t0)))
        sys.stderr.write(f"pdproxy demo: still unwinding {self.EXIT_BOUND:g}s after the interrupt; exiting "
                         "(its processes are stopped)\n")
        sys.stderr.flush()
        os._exit(130)

    def run(self, coro: Any) -> Any:
        """asyncio.run(coro), where an interrupt cancels coro's task (as asyncio's own Ctrl-C handling does)."""

        async def main() -> Any:
            loop, task = asyncio.get_running_loop(), asyncio.current_task()
            self._cancel = lambda: loop.call_soon_threadsafe(task.cancel)
            try:
                return await coro
            finally:
                self._cancel = None

        try:
            result = asyncio.run(main())
        except asyncio.CancelledError:
            if self.signalled:
                raise KeyboardInterrupt from None
            raise
        if self.signalled:  # the signal came as the bench ended
            raise KeyboardInterrupt
        return result


def parse_xpyd(spec: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)[pP](\d+)[dD]", spec.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise DemoError(f"--xpyd {spec!r}: expected like 1P1D or 2P1D")
    return int(m.group(1)), int(m.group(2))


def workload(args: argparse.Namespace) -> Workload:
    classes = [TrafficClass(name="stream", prompt=args.stream_prompt, output=args.stream_output,
                            concurrency=args.streams)]
    if args.long_every > 0:
        classes.append(TrafficClass(name="long", prompt=args.long_prompt, output=args.long_output,
                                    rate=1.0 / args.long_every))
    wl = Workload(model="sim-model", seed=args.seed, duration=args.duration, warmup_seconds=args.warmup,
                  classes=classes)
    wl.validate()
    return wl


def setup_plan(name: str, args: argparse.Namespace, xpyd: tuple[int, int]) -> dict[str, Any]:
    """The processes and fixed conditions of one set-up."""
    common = ["--preset", args.preset, "--time-scale", f"{args.time_scale:g}", "--model", "sim-model"]
    batch = ["--max-num-batched-tokens", str(args.batch_tokens)]
    cond: dict[str, Any] = {
        "vllm.version": f"pdproxy sim {__version__}",
        "vllm.model": "sim-model",
        "gpu.kind": f"simulated ({args.preset}, time scale {args.time_scale:g})",
        "service.version": __version__,
        "pd.run": name,
    }
    if name == "pd":
        x, y = xpyd
        sims = [(f"prefill{i}", ["sim", "--role", "prefill", *common, *batch]) for i in range(x)]
        stall = {True: ["--kv-pull-stalls-decode"], False: ["--no-kv-pull-stalls-decode"]}.get(
            args.kv_pull_stalls_decode, [])  # unset: the preset's
        sims += [(f"decode{i}", ["sim", "--role", "decode", *common, *batch, *stall]) for i in range(y)]
        cond.update({"pd.mode": "pd", "gpu.count": x + y, "pd.prefill.count": x, "pd.decode.count": y,
                     "pd.kv_connector": "simulated NIXL pull", "vllm.enable_chunked_prefill": "false",
                     "vllm.max_num_batched_tokens": args.batch_tokens})
    elif name == "dp":  # data parallel: P/D's GPUs as two whole instances behind the proxy, for "same resources"
        n = sum(xpyd)
        sims = [(f"single{i}", ["sim", "--role", "single", *common, *batch]) for i in range(n)]
        cond.update({"pd.mode": "single", "gpu.count": n, "pd.prefill.count": 0, "pd.decode.count": n,
                     "vllm.enable_chunked_prefill": "false", "vllm.max_num_batched_tokens": args.batch_tokens})
    else:
        chunked = name == "chunked"
        tokens = args.chunk_tokens if chunked else args.batch_tokens
        flags = ["--max-num-batched-tokens", str(tokens)] + (["--enable-chunked-prefill"] if chunked else [])
        sims = [("single", ["sim", "--role", "single", *common, *flags])]
        cond.update({"pd.mode": "single", "gpu.count": 1, "pd.prefill.count": 0, "pd.decode.count": 1,
                     "vllm.enable_chunked_prefill": str(chunked).lower(), "vllm.max_num_batched_tokens": tokens})
    return {"sims": sims, "conditions": cond}


def run_setup(name: str, plan: dict[str, Any], wl: Workload, out: Path, console: Console,
              stopper: Stopper) -> tuple[Run, Path, list[Path]]:
    """One set-up's run, the proxy's trace file and the instances' (vLLM-shaped llm_request spans)."""
    procs = Processes(out / "logs")
    stopper.procs = procs
    trace_file = out / f"traces-{name}.jsonl"
    records = out / f"records-{name}.jsonl"
    sim_traces = [out / f"vllm-{name}-{n}.jsonl" for n, _ in plan["sims"]]
    try:
        sims = [procs.start(f"{name}-{n}", [*a, "--otlp-traces-file", str(f)], {"OTEL_SERVICE_NAME": f"vllm-{n}"})
                for (n, a), f in zip(plan["sims"], sim_traces)]
        procs.wait_ready()
        serve = ["serve", "--trace-file", str(trace_file), "--run-label", name]
        for k, v in plan["conditions"].items():
            if k not in ("pd.run", "service.version", "pd.mode", "pd.prefill.count", "pd.decode.count"):
                serve += ["--resource-attr", f"{k}={v}"]
        prefill = [c.url for c in sims if "prefill" in c.name]
        decode = [c.url for c in sims if "prefill" not in c.name]
        if prefill:
            serve += ["--prefill", *prefill]
        serve += ["--decode", *decode]
        proxy = procs.start(f"{name}-proxy", serve)
        procs.wait_ready()
        parts = ", ".join(f"{c.name.split('-', 1)[1]} {c.url}" for c in sims)
        console.print(f"[bold]{name}[/]: {parts}; proxy {proxy.url}")
        target = runner.Target(url=proxy.url, timeout=120)
        header = runner.make_header(wl, target, name, plan["conditions"])
        from pdproxy.bench.cli import _progress_bar

        prog, update = _progress_bar(console, wl, name)
        with prog:
            res = stopper.run(runner.run_async(wl, target, records, header, progress=update))
    finally:
        procs.stop_all()  # the proxy flushes its trace file on SIGTERM
        stopper.procs = None
    return (Run(header=res.header, requests=res.records, summary=res.summary, source=str(records)), trace_file,
            sim_traces)


def _waterfall(rep: dict[str, Any], runs: list[Run], idx: traces.TraceIndex | None, console: Console) -> str | None:
    """Print the waterfall of the candidate run's request with the longest gap the proxy saw; returns its id."""
    if idx is None:
        return None
    label = (rep.get("verdict") or {}).get("candidate") or rep["runs"][-1]["label"]
    infos = [i for i in idx.by_request.values()
             if i.attrs.get("pd.run") == label and isinstance(i.attrs.get("pd.itl.max"), (int, float))]
    if not infos:
        return None
    info = max(infos, key=lambda i: i.attrs["pd.itl.max"])
    timeline = attribution.Timeline([*idx.by_request.values(), *idx.shadow.values()])
    console.print(Text(f"\nWaterfall of {label}'s request with the longest gap at the proxy (pdproxy trace):",
                       style="bold"))
    record = next((r for run_ in runs if run_.label == label for r in run_.requests
                   if r["request_id"] == info.request_id), None)
    for line in waterfall.render(info, idx.spans_of.get(info.trace_id), timeline, record=record):
        console.print(Text(line))
    return info.request_id


def time_scale_note(args: argparse.Namespace) -> str:
    """The scale every printed time is measured at, said up front rather than inside one table cell."""
    return (f"Time scale: the simulated instances run preset {args.preset} at --time-scale {args.time_scale:g}, "
            f"{args.time_scale:g}x slower than its real timings so that the CPU keeps up; every time below is "
            "measured at that scale.")


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    out_console = table.make_console()
    err = table.make_console(stderr=True)
    stopper = Stopper()
    stopper.install()
    try:
        setups = [s.strip() for s in args.setups.split(",") if s.strip()]
        bad = [s for s in setups if s not in SETUPS]
        if bad or not setups:
            raise DemoError(f"--setups: unknown {bad}; choose from {', '.join(SETUPS)}")
        xpyd = parse_xpyd(args.xpyd)
        wl = workload(args)
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path(args.out_dir or f"pdproxy-demo-{stamp}").resolve()
        (out / "logs").mkdir(parents=True, exist_ok=True)
        err.print(f"pdproxy demo: {', '.join(setups)}; {args.streams} streams (prompt {args.stream_prompt}, "
                  f"out {args.stream_output})"
                  + (f" + one {args.long_prompt}-token prompt every {args.long_every:g}s" if args.long_every > 0 else "")
                  + f"; {args.duration:g}s per set-up, first {args.warmup:g}s warm-up; run directory {out}")
        err.print(time_scale_note(args))
        runs: list[Run] = []
        trace_files: list[Path] = []
        instance_files: list[Path] = []
        for name in setups:
            run_, tf, sim_tf = run_setup(name, setup_plan(name, args, xpyd), wl, out, err, stopper)
            runs.append(run_)
            trace_files.append(tf)
            instance_files += sim_tf
        existing = [str(t) for t in trace_files + instance_files if t.exists()]
        idx = traces.read_traces(existing, keep_spans=True) if existing else None
        rep = report.build(runs, idx, slo=slo_from(args), candidate="pd" if "pd" in setups else None)
        (out / "report.json").write_text(json.dumps(rep, indent=1))
        (out / "report.html").write_text(html.render(rep))
        out_console.print(time_scale_note(args))
        table.render(rep, out_console, drilldown=True, drilldown_rows=2, all_rows=args.all_rows,
                     more="add --all to the report command below, or open report.html")
        slowest = _waterfall(rep, runs, idx, out_console)
        wall = time.monotonic() - t0
        # paths and commands whole on their lines, to be copied (never wrapped at the width)
        out_console.print(f"\nRun directory: {out}", soft_wrap=True)
        for r, tf in zip(runs, trace_files):
            out_console.print(f"  {r.label:8s} records {Path(r.source).name}, traces {tf.name}"
                              + ("" if tf.exists() else " (missing: the proxy wrote no trace file)"), soft_wrap=True)
        all_traces = " ".join(f"--traces {t.name}" for t in trace_files + instance_files if t.exists())
        out_console.print(f"  instances' llm_request spans: {', '.join(t.name for t in instance_files)}\n"
                          f"  report   report.html (plots), report.json; process logs in logs/\n"
                          f"Re-run the report: pdproxy report {' '.join(Path(r.source).name for r in runs)} "
                          f"{all_traces} --html report.html  (in {out})"
                          + (f"\nOne request's waterfall: pdproxy trace {slowest} {all_traces} --records "
                             f"{' --records '.join(Path(r.source).name for r in runs)}" if slowest else "")
                          + f"\nWall time: {wall:.1f}s", soft_wrap=True)
        return 0
    except DemoError as e:
        err.print(f"[red]pdproxy demo: {e}[/]")
        return 1
    except KeyboardInterrupt:
        err.print("[yellow]pdproxy demo: interrupted; every process it started has been stopped[/]")
        return 130
    finally:
        stopper.restore()
