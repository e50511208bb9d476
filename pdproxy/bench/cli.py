"""`pdproxy bench`: send a seeded workload to an OpenAI-compatible endpoint and record every request.

Examples:

    pdproxy bench --url http://127.0.0.1:8000 --model m --prompt-len medium --output-len 128 \\
        --concurrency 8 --requests 200 --warmup-requests 10 --label single --gpu-count 1
    pdproxy bench --url http://127.0.0.1:8000 --workload mixed.yaml --sweep concurrency=1,4,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from pdproxy.bench import report as report_mod
from pdproxy.bench import runner, table
from pdproxy.bench.records import Run
from pdproxy.bench.workload import (
    OUTPUT_PRESETS,
    PROMPT_PRESETS,
    TrafficClass,
    Workload,
    WorkloadError,
    apply_sweep,
    load_yaml,
    parse_sweep,
)

# Shorthand flags for the evaluation plan's fixed conditions (same keys as the proxy's resource attributes).
CONDITION_FLAGS = {
    "vllm_version": "vllm.version",
    "gpu_kind": "gpu.kind",
    "gpu_count": "gpu.count",
    "kv_connector": "pd.kv_connector",
    "prefill_count": "pd.prefill.count",
    "decode_count": "pd.decode.count",
    "mode": "pd.mode",
    "proxy_version": "service.version",
}
CLASS_FLAGS = ("prompt_len", "output_len", "concurrency", "rate", "arrival", "corpus", "shared_prefixes", "prefix_len",
               "sessions", "turns")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n", 2)[2]
    g = p.add_argument_group("target")
    g.add_argument("--url", help="base URL of the OpenAI-compatible server (pdproxy, vLLM, vllm-router)")
    g.add_argument("--endpoint", choices=["completions", "chat"], help="route to use (default completions)")
    g.add_argument("--model", help="model name sent in the body (default: the one the target's /v1/models lists "
                                   "first)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default $OPENAI_API_KEY)")
    g.add_argument("--timeout", type=float, default=None, help="per-request timeout in seconds (default 600)")
    g.add_argument("--engine-metrics", nargs="+", metavar="URL",
                   help="vLLM instances whose /metrics are read before and after each run: the report shows their "
                        "prefix-cache hit rate and computed prompt tokens (pdproxy/bench/engine_counters.py)")
    w = p.add_argument_group("workload (flags override the --workload file)")
    w.add_argument("--workload", metavar="FILE.yaml", help="YAML with workload/classes, url, label, conditions, sweep")
    w.add_argument("--prompt-len", help="prompt tokens of the server's tokenizer (as usage.prompt_tokens counts "
                                        f"them): N, LOW-HIGH or {'/'.join(PROMPT_PRESETS)}; sized with its "
                                        "/tokenize (docs/reference/report.md)")
    w.add_argument("--output-len", help=f"output tokens (max_tokens = min_tokens): N, LOW-HIGH or "
                                        f"{'/'.join(OUTPUT_PRESETS)}")
    w.add_argument("--corpus", help="fixed prompts: JSONL with 'prompt' (+ 'max_tokens') or a text file, one per line")
    w.add_argument("--shared-prefixes", type=int, metavar="N",
                   help="every prompt starts with one of N system prompts (prefix-cache reuse; default 0: none)")
    w.add_argument("--prefix-len", help="tokens of each shared system prompt (the target's tokens, like "
                   "--prompt-len, which is the part after it): N, LOW-HIGH or a preset (default medium)")
    w.add_argument("--sessions", type=int, metavar="S",
                   help="multi-turn: S conversations side by side, each turn's prompt repeating the turns before")
    w.add_argument("--turns", type=int, help="turns per conversation with --sessions (default 4)")
    w.add_argument("--concurrency", type=int, help="closed loop: this many requests in flight")
    w.add_argument("--rate", type=float, help="open loop: requests per second")
    w.add_argument("--arrival", choices=["constant", "poisson"], help="arrival process for --rate (default constant)")
    w.add_argument("--requests", type=int, help="stop after this many requests")
    w.add_argument("--duration", type=float, help="stop sending after this many seconds")
    w.add_argument("--warmup-requests", type=int, help="exclude the first N requests from statistics")
    w.add_argument("--warmup-seconds", type=float, help="exclude requests started in the first S seconds")
    w.add_argument("--seed", type=int, help="seed: same seed, same request bodies (default 0)")
    w.add_argument("--temperature", type=float, help="sampling temperature sent with every request (default 0)")
    w.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos=true")
    w.add_argument("--no-min-tokens", action="store_true",
                   help="do not send min_tokens = max_tokens (for servers that reject vLLM's extension; outputs "
                        "may then end early)")
    w.add_argument("--no-continuous-usage", action="store_true",
                   help="do not ask for usage on every chunk (then ITL is per chunk only)")
    w.add_argument("--sweep", metavar="AXIS=V1,V2,...",
                   help="one run per value of prompt, output, concurrency or rate")
    c = p.add_argument_group("fixed conditions (recorded in the summary and every report header)")
    c.add_argument("--label", help="run label (set-up name), e.g. single, chunked, pd")
    c.add_argument("--condition", action="append", default=[], metavar="KEY=VALUE",
                   help="any condition, e.g. vllm.dtype=bf16 (repeatable; keys as the proxy's resource attributes)")
    for flag, key in CONDITION_FLAGS.items():
        c.add_argument("--" + flag.replace("_", "-"), dest=flag, metavar="V", help=f"sets {key}")
    o = p.add_argument_group("output")
    o.add_argument("--out", help="record file for a single run (default OUT_DIR/LABEL-RUNID.jsonl)")
    o.add_argument("--out-dir", help="directory for record files (default bench-results)")
    o.add_argument("--save-text", action="store_true", help="also record completion text (off by default)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--quiet", action="store_true", help="print only the record file paths")


def _parse_kv(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise WorkloadError(f"{what} {item!r}: expected KEY=VALUE")
        out[k.strip()] = v.strip()
    return out


def build(args: argparse.Namespace) -> tuple[Workload, runner.Target, str, dict[str, Any], str | None, dict[str, Any]]:
    """Merge the YAML file and the flags into (workload, target, label, conditions, sweep, file options)."""
    data = load_yaml(args.workload) if args.workload else {}
    file_opts = {k: data.pop(k) for k in ("url", "label", "conditions", "sweep", "out_dir", "timeout", "api_key",
                                          "engine_metrics") if k in data}
    wl_data = data.pop("workload", None)
    if wl_data is None:
        wl_data = data
    elif data:
        raise WorkloadError(f"{args.workload}: unknown top-level keys {sorted(data)}")
    wl = Workload.from_dict(wl_data)
    for name in ("model", "endpoint", "temperature", "seed", "requests", "duration", "warmup_requests",
                 "warmup_seconds"):
        v = getattr(args, name)
        if v is not None:
            setattr(wl, name, v)
    if args.no_ignore_eos:
        wl.ignore_eos = False
    if args.no_min_tokens:
        wl.min_tokens = False
    if args.no_continuous_usage:
        wl.continuous_usage = False
    class_flags = {k: getattr(args, k) for k in CLASS_FLAGS if getattr(args, k) is not None}
    if class_flags:
        if wl_data.get("classes"):
            raise WorkloadError("--prompt-len/--output-len/--concurrency/--rate/--arrival/--corpus and the prefix "
                                "flags cannot be combined with classes from the workload file: edit the file or drop "
                                "the classes")
        c = wl.classes[0] if wl.classes else TrafficClass()
        mapping = {"prompt_len": "prompt", "output_len": "output"}
        for k, v in class_flags.items():
            setattr(c, mapping.get(k, k), v)
        if "rate" in class_flags and "concurrency" not in class_flags:
            c.concurrency = None
        if "concurrency" in class_flags and "rate" not in class_flags:
            c.rate = None
        wl.classes = [c]
    wl.validate()
    url = args.url or file_opts.get("url")
    if not url:
        raise WorkloadError("give --url (or url: in the workload file)")
    if not re.match(r"https?://", url):
        raise WorkloadError(f"--url {url!r}: expected http://HOST:PORT")
    timeout = args.timeout or float(file_opts.get("timeout") or 600)
    target = runner.Target(url=url, api_key=args.api_key or file_opts.get("api_key"), timeout=timeout,
                           engine_metrics=list(args.engine_metrics or file_opts.get("engine_metrics") or []))
    label = args.label or file_opts.get("label") or "run"
    conditions: dict[str, Any] = {str(k): v for k, v in (file_opts.get("conditions") or {}).items()}
    conditions.update(_parse_kv(args.condition, "--condition"))
    for flag, key in CONDITION_FLAGS.items():
        v = getattr(args, flag)
        if v is not None:
            conditions[key] = v
    conditions.setdefault("pd.run", label)
    return wl, target, label, conditions, args.sweep or file_opts.get("sweep"), file_opts


def _progress_bar(console: Console, wl: Workload, label: str) -> tuple[Progress, Any]:
    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console, transient=False)
    by_count = wl.requests is not None
    task = prog.add_task(label, total=float(wl.requests if by_count else wl.duration or 1), status="")

    def update(state: Any, counts: dict[str, int]) -> None:
        done = counts["ok"] + counts["failed"]
        completed = done if by_count else min(state.elapsed(), wl.duration or 0)
        prog.update(task, completed=completed,
                    status=f"sent {state.seq}  ok {counts['ok']}  failed {counts['failed']}")

    return prog, update


def say_prompts(console: Console) -> Any:
    """Tell the user once how prompts are sized when it is not exact (no /tokenize, no word boundaries)."""
    said: set[str] = set()

    def say(sized: Any) -> None:
        for note in sized.notes:
            if note not in said:
                said.add(note)
                console.print(f"[yellow]pdproxy bench: {note}[/]")

    return say


def from_status(url: str, conditions: dict[str, Any], timeout: float = 5.0) -> list[str]:
    """The set-up (pd.mode, pd.prefill.count, pd.decode.count) from pdproxy's /status where the run does not name it:
    a record without it is replayed by `pdproxy whatif` on the wrong baseline. Silent when the target is not a
    pdproxy (no /status of that shape): the conditions stay as given."""
    keys = ("pd.mode", "pd.prefill.count", "pd.decode.count")
    if all(k in conditions for k in keys):
        return []
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=timeout) as resp:
            status = json.loads(resp.read())
        mode = status["mode"]
        counts = {"pd.prefill.count": int(status["prefill_node_count"]),
                  "pd.decode.count": int(status["decode_node_count"])}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if mode not in ("pd", "single"):
        return []
    found = {"pd.mode": mode, **counts}
    added = {k: v for k, v in found.items() if k not in conditions}
    conditions.update(added)
    return [f"set-up from the proxy's /status: " + ", ".join(f"{k}={v}" for k, v in added.items())] if added else []


def run_many(wl: Workload, target: runner.Target, label: str, conditions: dict[str, Any], sweep: str | None,
             out: str | None, out_dir: str, save_text: bool, progress: bool, console: Console) -> list[runner.RunResult]:
    """One run, or one run per sweep value; returns results in order."""
    plans: list[tuple[str, Workload, dict[str, Any] | None]] = []
    if sweep:
        axis, values = parse_sweep(sweep)
        for v in values:
            plans.append((f"{label}-{axis}={v}", apply_sweep(wl, axis, v), {"axis": axis, "value": v}))
        if out:
            raise WorkloadError("--out names one file; with --sweep use --out-dir")
    else:
        plans.append((label, wl, None))
    results = []
    say = say_prompts(console)
    for run_label, w, sw in plans:
        cond = dict(conditions)
        cond["pd.run"] = run_label if sweep else cond.get("pd.run", run_label)
        header = runner.make_header(w, target, run_label, cond, sw)
        safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", run_label)
        path = Path(out) if out else Path(out_dir) / f"{safe}-{header['run_id']}.jsonl"
        if progress:
            prog, update = _progress_bar(console, w, run_label)
            with prog:
                res = asyncio.run(runner.run_async(w, target, path, header, save_text=save_text, progress=update,
                                                   on_prompts=say))
        else:
            res = asyncio.run(runner.run_async(w, target, path, header, save_text=save_text, on_prompts=say))
        results.append(res)
    return results


def run(args: argparse.Namespace) -> int:
    console = table.make_console()
    err = Console(stderr=True)
    try:
        wl, target, label, conditions, sweep, file_opts = build(args)
        for note in from_status(target.url, conditions):
            err.print(f"[yellow]pdproxy bench: {note}[/]")
        out_dir = args.out_dir or file_opts.get("out_dir") or "bench-results"
        show_progress = not (args.no_progress or args.quiet)
        results = run_many(wl, target, label, conditions, sweep, args.out, out_dir, args.save_text,
                           show_progress, err)
    except WorkloadError as e:
        err.print(f"[red]pdproxy bench: {e}[/]")
        return 2
    except KeyboardInterrupt:
        err.print("[yellow]interrupted: records written so far are kept (summary marked interrupted)[/]")
        return 130
    for res in results:
        print(res.path)
    if not args.quiet:
        runs = [Run(header=r.header, requests=r.records, summary=r.summary, source=str(r.path)) for r in results]
        rep = report_mod.build(runs, verdict=False)  # a sweep is a series, not a candidate and baselines
        table.render(rep, console, drilldown=False,
                     more=f"pdproxy report {' '.join(str(r.path) for r in results)} --all")
    failed_all = all(r.summary["stats"]["requests"]["ok"] == 0 for r in results)
    if failed_all:
        err.print("[red]every request failed: check --url, --model and the server's log[/]")
        return 1
    return 0

