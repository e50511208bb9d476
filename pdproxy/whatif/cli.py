"""`pdproxy whatif`: predict the report of set-ups you have not run, from a workload you recorded.

Examples:

    pdproxy whatif --records bench/pd-88412b25.jsonl --max-model-len 8192 --num-gpu-blocks 4096
    pdproxy whatif --records pd.jsonl --records dp.jsonl --records 3p1d.jsonl --traces proxy.jsonl
    pdproxy whatif --traces pd-a.jsonl --gpus 4 --setup 2P2D --setup 4xchunked:1024 --html whatif.html
    pdproxy whatif --records run.jsonl --traces proxy.jsonl --traces vllm.jsonl --calibrate

The recorded workload (arrivals, prompt and output tokens, shared prefixes) is replayed on each
candidate set-up at the same GPU total (every P:D ratio, all single, all chunked at --chunk sizes, and
the set-up it was recorded on) by the simulator's engine in virtual time, and printed as `pdproxy
report` prints a real comparison: the same rows, verdicts against the recorded set-up, and the real
runs worth making next. With several --records (runs of one cluster), one parameter set is fitted to all
of them, each is replayed against its recording, and each is predicted by the model fitted to the others
(leave-one-out): that miss is the error the prediction states (docs/explanation/whatif.md).
"""

from __future__ import annotations

import argparse
import os
import re
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from pdproxy import policies
from pdproxy.bench import html, records, table, traces
from pdproxy.bench.report_cli import add_slo_arguments, slo_from, write_outputs
from pdproxy.config import Settings
from pdproxy.sim.presets import PRESETS
from pdproxy.whatif import fitrun, loo, predict, recordings, setups, unknowns
from pdproxy.whatif.model import Death, ModelParams
from pdproxy.whatif.recordings import Recording
from pdproxy.whatif.workload import Workload, WorkloadError

CALIBRATED_NOTE = ("calibrated on the given spans: the stated error is the shipped presets'; replaying a run's own "
                   "workload with the curves fitted to its spans, TTFT and KV wait landed within 21 % on vllm023 "
                   "P/D, but across set-ups calibration helped some figures and hurt others (docs/explanation/whatif.md)")
PRESET_ATTR = "pdproxy.sim.preset"  # the simulator names its preset on its spans (and a bench may as a condition)
SCALE_ATTR = "pdproxy.sim.time_scale"  # ... and its --time-scale
SIMULATED = re.compile(r"simulated \(([\w.+-]+), time scale ([0-9.]+)\)")  # `pdproxy demo`'s gpu.kind
# the cards the presets were measured on (pdproxy/sim/presets.py), by what gpu.kind says: instances sharing one GPU,
# and one GPU each
CARDS = {"H200": ("h200-llama8b", "h200-llama8b-2gpu")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n", 2)[2]
    i = p.add_argument_group("recorded workload")
    i.add_argument("--records", action="append", default=[], metavar="FILE",
                   help="a `pdproxy bench` record file: arrivals, tokens, closed-loop concurrency, shared prefixes; "
                        "repeat it for every recorded run of the same cluster (one model is fitted to all, each "
                        "predicted from the others; the first is the workload predicted)")
    i.add_argument("--traces", action="append", default=[], metavar="FILE",
                   help="pdproxy trace file(s) (OTLP-JSON lines): the workload when no records are given; beside "
                        "records, each record's run in them (KV wait, routing, lost instances); with --calibrate also "
                        "the spans to fit")
    i.add_argument("--run", metavar="NAME",
                   help="the run to replay when the trace files hold several proxies' runs: its proxy's run label "
                        "(pd.run) or instance id; the error lists them")
    i.add_argument("--warm-from", action="append", default=[], metavar="[RECORD=]FILE",
                   help="the bench record of a run just before this one on the same instances with the same seeded "
                        "prompts: the replay starts with its prompts in the prefix caches (RECORD=: for that one of "
                        "the --records, else the first; repeatable)")
    i.add_argument("--prefixes-as-counted", action=argparse.BooleanOptionalAction, default=True,
                   help="replay a shared prefix at the size the server counted (what it counted beyond the tokens "
                        "a request asked for, where more than the re-drawn prefix; default), or at its draw's "
                        "size (--no-prefixes-as-counted); docs/explanation/whatif.md, \"Input\"")
    i.add_argument("--recorded-gpus", type=int, metavar="N",
                   help="the GPUs the recorded instances ran on, where the records' gpu.count says otherwise (run A's "
                        "bench named 4 for four instances on one H200)")
    s = p.add_argument_group("candidate set-ups")
    s.add_argument("--gpus", type=int, help="GPU total (default: the recording's gpu.count)")
    s.add_argument("--setup", action="append", default=[], metavar="SPEC",
                   help="a set-up to predict: 2P2D, 4xsingle, 4xchunked:2048 (repeatable; default: every P:D "
                        "ratio, all single, all chunked, and the recorded one)")
    s.add_argument("--chunk", action="append", type=int, default=[], metavar="TOKENS",
                   help=f"chunk sizes for the default chunked set-ups (default {setups.DEFAULT_CHUNKS[0]})")
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=sorted(n for n, p in PRESETS.items() if not p.instant), default=None,
                   help="timing preset of every instance (default: the one the recording names, as `pdproxy sim` "
                        f"instances do on their spans ({PRESET_ATTR}), else the one measured on the recording's "
                        "card (gpu.kind) with its instances on one GPU or one each; a card without a preset is fitted "
                        "from the vLLM spans given, or refused)")
    m.add_argument("--max-model-len", type=int, help="as the recorded instances had it (default: the recording's, "
                                                     "else the preset's)")
    m.add_argument("--num-gpu-blocks", type=int, help="KV blocks per instance (default: the preset's)")
    m.add_argument("--policy", default=None, help="single set-ups' routing policy (default: as a recording of single "
                                                  "instances names it on its spans, else cache_aware)")
    m.add_argument("--prefill-policy", default=None, help="P/D prefill routing policy (default: as a P/D recording "
                                                          "names it, else cache_aware)")
    m.add_argument("--decode-policy", default=None, help="P/D decode routing policy (default: as a P/D recording "
                                                         "names it, else load_aware)")
    m.add_argument("--migrate-mid-stream", action="store_true",
                   help="the proxy continues a stream whose decode dies on another decode (pdproxy's flag; matters "
                        "only when the recording shows an instance dying)")
    m.add_argument("--calibrate", action="store_true",
                   help="fit prefill, decode and KV-transfer curves from the --traces' vLLM spans, print the fit "
                        "and its residuals, and predict with it (default: the preset)")
    m.add_argument("--fit-run", action=argparse.BooleanOptionalAction, default=None,
                   help="fit the model's free parameters (GPU time-sharing between instances, the KV path) so that "
                        "the recorded set-ups reproduce their recordings, print the fit, and predict every set-up with "
                        "it (default: on whenever a recorded set-up is known, unless the recording names the "
                        "simulator's preset)")
    m.add_argument("--leave-one-out", action=argparse.BooleanOptionalAction, default=True,
                   help="with several --records, predict each from the model fitted to the others and state that "
                        "miss as the prediction's error (default)")
    m.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes simulating in parallel")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the report as JSON ('-' for stdout)")
    o.add_argument("--html", metavar="PATH", help="write the HTML page `pdproxy report` writes, marked as a prediction")
    o.add_argument("--no-table", action="store_true", help="do not print the terminal table")
    v = p.add_argument_group("verdict (each set-up vs the recorded one)")
    add_slo_arguments(v)


def check_flags(args: argparse.Namespace) -> None:
    """Numbers a prediction cannot be made with, named (exit 2) rather than failing deep inside."""
    for flag, value in (("--gpus", args.gpus), ("--num-gpu-blocks", args.num_gpu_blocks),
                        ("--max-model-len", args.max_model_len), ("--jobs", args.jobs),
                        ("--recorded-gpus", args.recorded_gpus), *(("--chunk", c) for c in args.chunk)):
        if value is not None and value < 1:
            raise setups.SetupError(f"{flag} {value}: must be at least 1")


def choose_setups(args: argparse.Namespace, wl: Workload) -> list[setups.Setup]:
    """The set-ups to predict, at the recording's GPU total; where the recording's instances shared GPUs, each
    candidate has as many instances as the recording, time-sharing its GPUs (`Setup.on_gpus`)."""
    rec = setups.recorded(wl.conditions)
    gpus = args.gpus
    shared: int | None = None  # the recording's GPU total, where its instances shared them
    if gpus is None:
        try:
            gpus = int(wl.conditions["gpu.count"])
            if gpus < 1:
                raise ValueError(gpus)
        except (KeyError, TypeError, ValueError):
            if rec is None:
                raise setups.SetupError("the recording says neither its GPU total (gpu.count) nor its instances "
                                        "(pd.mode, pd.prefill.count, pd.decode.count): pass --gpus") from None
            gpus = rec.gpus
            wl.notes.append(f"no usable gpu.count in the recording: GPU total {gpus}, one per recorded instance "
                            f"({rec.name})")
        if rec is not None and rec.gpus > gpus:
            # instances sharing GPUs (vllm023's 1P1D on one H200): the recorded set-up is replayed first, so the
            # candidates get as many instances, on the GPUs the recording had, time-shared as the fit finds
            wl.notes.append(f"the recorded set-up {rec.name} ran {rec.gpus} instances on {gpus} GPU(s): every "
                            f"candidate has {rec.gpus} instances on those GPU(s), time-sharing them as the fit to the "
                            "run finds (pass --gpus for another instance total)")
            shared, gpus = gpus, rec.gpus
    chosen = [setups.parse_setup(s) for s in args.setup] if args.setup else \
        setups.candidates(gpus, tuple(args.chunk) or setups.DEFAULT_CHUNKS)
    for s in chosen:
        setups.check_fits(s, gpus)
    if rec is not None and rec.gpus == gpus:
        chosen = [rec if s.name == rec.name else s for s in chosen]
        if not any(s.recorded for s in chosen):
            chosen.insert(0, rec)
    elif rec is not None:
        wl.notes.append(f"the recorded set-up {rec.name} has {rec.gpus} instances on {gpus} GPU(s); the model gives "
                        f"each instance a GPU, so it is not among the candidates (pass --gpus {rec.gpus} to add it)")
    names = [s.name for s in chosen]
    if len(set(names)) != len(names):
        raise setups.SetupError(f"a set-up is given twice: {', '.join(names)}")
    return [replace(s, on_gpus=shared) for s in chosen] if shared else chosen


def _engine_attr(recs: list[Recording], key: str) -> Any:
    return next((e.attrs[key] for r in recs if r.idx is not None for i in r.idx.by_request.values()
                 for e in i.engine.values() if key in e.attrs), None)


def recorded_sim(recs: list[Recording]) -> tuple[str, float] | None:
    """The simulator's preset and time scale that served the recording, where it says: a condition of the run, the
    sims' own spans, or `pdproxy demo`'s gpu.kind ("simulated (NAME, time scale S)")."""
    wl = recs[0].workload
    named = wl.conditions.get(PRESET_ATTR) or _engine_attr(recs, PRESET_ATTR)
    scale = wl.conditions.get(SCALE_ATTR) or _engine_attr(recs, SCALE_ATTR)
    m = SIMULATED.search(str(wl.conditions.get("gpu.kind") or ""))
    if m:
        named, scale = named or m.group(1), scale or m.group(2)
    if named is None:
        return None
    try:
        return str(named), float(scale) if scale is not None else 1.0
    except ValueError:
        raise setups.SetupError(f"the recording's time scale {scale!r} is not a number") from None


def instances_per_gpu(recs: list[Recording]) -> float:
    """The most instances any recording ran on one GPU (gpu.count; without it, one GPU per instance)."""
    most = 1.0
    for r in recs:
        try:
            gpus = int(r.workload.conditions["gpu.count"])
        except (KeyError, TypeError, ValueError):
            continue
        if r.setup is not None and gpus > 0:
            most = max(most, r.setup.gpus / gpus)
    return most


def choose_preset(args: argparse.Namespace, recs: list[Recording]) -> tuple[str, float, bool]:
    """(preset, time scale, whether its curves must be fitted from the spans) for the recordings' hardware."""
    wl = recs[0].workload
    sim = recorded_sim(recs)
    scale = sim[1] if sim else 1.0
    if scale != 1.0:
        wl.notes.append(f"replayed at time scale {scale:g}: the simulated instances that made the recording ran "
                        f"{scale:g} times slower than their preset (pdproxy sim --time-scale)")
    if args.preset:
        return str(args.preset), scale, False
    if sim is not None:
        if sim[0] not in PRESETS or PRESETS[sim[0]].instant:
            raise setups.SetupError(f"the recording names the simulator's preset {sim[0]!r}, which the model does not "
                                    f"have: pass --preset ({', '.join(n for n, p in PRESETS.items() if not p.instant)})")
        wl.notes.append(f"preset {sim[0]}: the one the recording names")
        return sim[0], scale, False
    kinds = {str(k) for r in recs if (k := r.workload.conditions.get("gpu.kind"))}
    shared = instances_per_gpu(recs) > 1
    where = "instances sharing one GPU" if shared else "one GPU per instance"
    card = next((c for c in CARDS for k in kinds if c in k.upper().replace(" ", "")), None)
    if card is not None:
        name = CARDS[card][0 if shared else 1]
        wl.notes.append(f"preset {name}: measured on the recording's card ({', '.join(sorted(kinds))}), {where} "
                        "(gpu.count and the recorded instances)")
        return name, scale, False
    spans = any(i.engine for r in recs if r.idx is not None for i in r.idx.by_request.values())
    what = f"gpu.kind {', '.join(sorted(kinds))}" if kinds else "no gpu.kind"
    if spans:
        name = CARDS["H200"][0 if shared else 1]
        wl.notes.append(f"no preset for the recording's hardware ({what}): prefill, decode and KV curves fitted from "
                        f"its vLLM spans (--calibrate) on the structure of {name} ({where})")
        return name, scale, True
    raise setups.SetupError(
        f"no preset for the recording's hardware ({what}; the presets were measured on "
        f"{', '.join(CARDS)}): give its vLLM llm_request spans with --traces to fit the curves from them, or name a "
        "preset with --preset to model it as that card")


def model_params(args: argparse.Namespace, wl: Workload, preset_name: str, scale: float,
                 found: dict[str, Any]) -> ModelParams:
    """`found`: the recorded proxy's policies (`Recording.routing`), the defaults the flags override."""
    preset = PRESETS[preset_name]
    over: dict[str, Any] = {}
    mml = args.max_model_len or wl.max_model_len
    if mml:
        over["max_model_len"] = mml
    if args.num_gpu_blocks:
        over["num_gpu_blocks"] = args.num_gpu_blocks
    if over:
        preset = replace(preset, **over)
        if preset.num_gpu_blocks and -(-preset.max_model_len // preset.block_size) > preset.num_gpu_blocks:
            raise setups.SetupError(f"max-model-len {preset.max_model_len} does not fit in {preset.num_gpu_blocks} "
                                    "KV blocks: raise --num-gpu-blocks (vLLM refuses to start in this case too)")
    chosen: dict[str, Any] = {"single_policy": "cache_aware", "prefill_policy": "cache_aware",
                              "decode_policy": "load_aware", **found}
    if found:
        wl.notes.append("routing as the recorded proxy's spans name it (pd.route.policy): "
                        + ", ".join(f"{k.removesuffix('_policy')} {v}" for k, v in found.items()))
    flags = {"single_policy": args.policy, "prefill_policy": args.prefill_policy, "decode_policy": args.decode_policy}
    chosen.update({k: v for k, v in flags.items() if v})
    for name in chosen.values():
        if name not in policies.POLICIES:
            raise setups.SetupError(f"unknown routing policy {name!r}; choose one of {', '.join(policies.POLICIES)}")
    return ModelParams(preset, **chosen, proxy=Settings(migrate_mid_stream=args.migrate_mid_stream),
                       time_scale=scale)


Job = tuple[Workload, setups.Setup, ModelParams, tuple[Death, ...], bool]


def _one(job: Job) -> Any:
    wl, setup, params, deaths, figures_only = job
    pred = predict.run_setup(wl, setup, params, deaths)
    return predict.prediction_figures(pred) if figures_only else pred


def predictions(wl: Workload, chosen: list[setups.Setup], params: ModelParams, pool: Executor | None,
                spread_of: setups.Setup | None = None, deaths: tuple[Death, ...] = ()
                ) -> tuple[list[predict.Prediction], dict[str, tuple[float, float]] | None]:
    """Every chosen set-up predicted, and with `spread_of` the model's own spread there (`predict.spread`, its
    replays in the same pool)."""
    work: list[Job] = [(wl, s, params, (), False) for s in chosen]
    if spread_of is not None:
        work += [(wl, spread_of, p, deaths, True) for p in predict.jittered(params)]
    done = list(pool.map(_one, work)) if pool is not None and len(work) > 1 else [_one(w) for w in work]
    n = len(chosen)
    return done[:n], predict.spread_of(done[n:]) if spread_of is not None else None


def print_prediction(rep: dict[str, Any], console: Console) -> None:
    w = rep["whatif"]
    console.print(Text(w["prediction"], style="bold yellow"), soft_wrap=True)
    for n in w["workload"]["notes"]:
        console.print(Text(f"assumed: {n}", style="yellow"), soft_wrap=True)
    for n in w.get("calibration_notes") or []:
        console.print(Text(n, style="yellow"), soft_wrap=True)
    for replay in [r for r in [w.get("self_replay"), *(w.get("self_replays") or [])] if r]:
        for line in predict.self_replay_lines(replay):
            red = "not fit" in line or "NOT FIT" in line
            console.print(Text(line, style="bold red" if red else ""), soft_wrap=True)
    if w.get("leave_one_out"):
        for line in w["leave_one_out"]["lines"]:
            console.print(Text(line), soft_wrap=True)
    if w.get("unknowns"):
        for line in unknown_lines(w["unknowns"]):
            console.print(Text(line, style="yellow"), soft_wrap=True)
    for line in w["suggested_runs"]:
        console.print(Text(line, style="bold" if line.startswith("Real runs") else ""), soft_wrap=True)


def unknown_lines(u: dict[str, Any]) -> list[str]:
    """What one recording cannot tell, and the range it opens per set-up (TTFT and tail ITL p50 / p99)."""
    names = ", ".join(fitrun._KNOB_TEXT.get(k, k) for k in u["parameters"])
    lines = [f"This recording cannot tell {names}: predicted again with each halved and doubled, the set-ups range "
             f"over (ms) — {u['next_run']} to narrow it:"]
    for setup, figs in u["ranges"].items():
        parts = [f"{n} {lo * 1e3:,.0f}-{hi * 1e3:,.0f}" for n in ("TTFT p50", "TTFT p99", "tail ITL p50", "tail ITL p99")
                 if (lo_hi := figs.get(n)) is not None for lo, hi in [lo_hi]]
        lines.append(f"  {setup}: " + ", ".join(parts))
    return lines


def html_page(rep: dict[str, Any]) -> str:
    """`pdproxy report`'s page with the prediction banner and the suggested runs on top."""
    w = rep["whatif"]
    esc = html._e
    replays = [r for r in [w.get("self_replay"), *(w.get("self_replays") or [])] if r]
    banner = (f"<div class=flag><b>{esc(w['prediction'])}</b></div>"
              + "".join(f"<div class=flag>assumed: {esc(n)}</div>" for n in w["workload"]["notes"])
              + ("<h2>Self-replay</h2><ul>" + "".join(f"<li>{esc(s)}</li>" for r in replays
                                                       for s in predict.self_replay_lines(r)) + "</ul>"
                 if replays else "")
              + ("<h2>Leave-one-out</h2><pre>" + esc("\n".join(w["leave_one_out"]["lines"])) + "</pre>"
                 if w.get("leave_one_out") else "")
              + "<h2>Suggested real runs</h2><ul>" + "".join(f"<li>{esc(s)}</li>" for s in w["suggested_runs"])
              + "</ul>")
    page = html.render(rep)
    page = page.replace("<h1>pdproxy report:", "<h1>pdproxy whatif (prediction):", 1)
    return page.replace("<body>\n", "<body>\n" + banner + "\n", 1)


def _targets(recs: list[Recording], first: setups.Setup | None) -> list[fitrun.Target]:
    """The recordings the fit reproduces: each with its set-up as recorded (the first as chosen for the candidates)
    and its own figures."""
    out = []
    for n, r in enumerate(recs):
        setup = first if n == 0 else r.setup
        if setup is None or r.entry is None:
            continue
        out.append(fitrun.Target(r.name, r.workload, setup, predict.figures(r.entry), r.deaths, r.routing))
    return out


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    pool: ProcessPoolExecutor | None = None
    try:
        check_flags(args)
        slo = slo_from(args)
        recs = recordings.load(args.records, args.traces, args.warm_from, args.prefixes_as_counted, args.run)
        if args.recorded_gpus:
            for r in recs:
                r.workload.conditions["gpu.count"] = str(args.recorded_gpus)
                r.setup = setups.recorded(r.workload.conditions)
            recs[0].workload.notes.append(f"the recorded instances ran on {args.recorded_gpus} GPU(s) "
                                          "(--recorded-gpus), whatever the records' gpu.count says")
        recordings.check_cluster(recs)
        first = recs[0]
        wl = first.workload
        if len(recs) > 1:
            wl.notes.append(f"{len(recs)} recordings of the cluster: {', '.join(r.name for r in recs)}; the first "
                            "is the workload predicted, one model is fitted to all of them")
        if args.records and args.traces and not args.calibrate:
            wl.notes.append("the workload is the bench record's; the trace files given beside it give the recorded "
                            "KV wait (self-replay), the routing and the instances lost, and serve --calibrate")
        if not args.records:
            wl.notes.append("self-replay against the proxy's traces: TTFT (time to first chunk), per-request max ITL "
                            "(pd.itl.max) and the KV wait as the proxy saw them")
        chosen = choose_setups(args, wl)
        preset_name, scale, from_spans = choose_preset(args, recs)
        params = model_params(args, wl, preset_name, scale, first.routing)
        rec_setup = next((s for s in chosen if s.recorded), None)
        deaths = first.deaths if rec_setup is not None else ()
        if deaths:
            wl.notes.append("an instance failure is the run's, not its set-up's: the set-ups compared, the recorded "
                            "one included, are predicted without it; the self-replay (and the fit) replay it")
        calibration = None
        if args.calibrate or from_spans:
            from pdproxy.whatif import calibrate

            calibration = calibrate.fit_files(args.traces, params.preset)
            err.print(calibrate.render(calibration))
            params = replace(params, preset=calibration.preset)
        for r in recs:
            r.workload.check(params.preset.max_model_len)
        if args.fit_run is None and args.preset is None and recorded_sim(recs) is not None:
            args.fit_run = False  # simulated instances: their timings are the preset's, what misses is the host's
            wl.notes.append("not fitted to the run: the recording names the simulator's preset, whose timings the "
                            "model replays as they are (--fit-run to fit anyway)")
            # the sims shared no GPU (no --gpu-share-file): neither do their replays
            params = replace(params, preset=replace(params.preset, shared_gpu=False))
        targets = _targets(recs, rec_setup)
        if args.fit_run and (first.entry is None or rec_setup is None):
            raise setups.SetupError("--fit-run replays the recorded set-up against its recording: keep the "
                                    "recorded set-up among the candidates")
        fitting = args.fit_run is not False and bool(targets) and rec_setup is not None and first.entry is not None
        if args.fit_run is not False and not fitting:
            wl.notes.append("not fitted to the run (its set-up is not among the candidates): the preset's figures")
        base = params
        jobs = args.jobs
        pool = ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else None
        fitted: fitrun.RunFit | None = None
        loo_rows: list[loo.Row] = []
        loo_fits: dict[str, Any] = {}
        if fitting:
            loo_jobs = loo.jobs(targets, base) if args.leave_one_out else []
            if pool is not None:
                joint: Future[Any] = pool.submit(loo.fit_job, (targets, base, None))
                pending = [pool.submit(loo.fit_job, j) for j in loo_jobs]
                fitted = joint.result()[0]
            else:
                fitted = loo.fit_job((targets, base, None))[0]
                pending = []
            err.print(fitrun.render(fitted, rec_setup.name if rec_setup else ""))
            params = replace(params, preset=fitted.params.preset)
        # the model's own spread where the self-replay checks it: the recorded set-up, its failures replayed
        preds, spreads = predictions(wl, chosen, params, pool, rec_setup if first.entry is not None else None,
                                     deaths)
        replayed = predict.run_setup(wl, rec_setup, params, deaths) if deaths and rec_setup is not None else None
        # one recording: what it cannot tell (a parameter no mechanism in it shows), moved both ways
        alternatives = unknowns.moved(fitted, chosen, params) if fitted is not None and len(targets) == 1 else []
        spans: dict[str, dict[str, list[float]]] = {}
        if alternatives:
            work = [(wl, s, p, (), True) for _, p in alternatives for s in chosen]
            done_alt = list(pool.map(_one, work)) if pool is not None else [_one(j) for j in work]
            labels = [p.run.header["label"] for p in preds]
            main = {lab: predict.prediction_figures(p) for lab, p in zip(labels, preds)}
            others = [dict(zip(labels, done_alt[i * len(chosen):(i + 1) * len(chosen)]))
                      for i in range(len(alternatives))]
            # only what still fits the recording as well: a value its own replay would tell wrong is no unknown
            rec_label = next((lab for lab, p in zip(labels, preds) if p.setup.recorded), None)
            if rec_label is not None and first.entry is not None:
                want = predict.figures(first.entry)
                bound = max(fitrun.worst(want, main[rec_label]), fitrun.SELF_REPLAY_GOAL)
                others = [o for o in others if fitrun.worst(want, o[rec_label]) <= bound]
            spans = unknowns.ranges(main, others) if others else {}
        if fitting and fitted is not None:
            done = [f.result() for f in pending] if pool is not None else \
                [loo.fit_job(j) for j in (loo.jobs(targets, base) if args.leave_one_out else [])]
            left = [d[1] for d in done]
            loo_fits = {t.name: {k: v for k, v in d[0].to_dict().items() if k != "rounds"}
                        for t, d in zip(targets, done)}
            if left:
                bands = {r.name: r.entry.get("bands") or {} for r in recs if r.entry}
                loo_rows = loo.rows(targets, left, fitted, bands)
        errors = loo.stated_errors(loo_rows) if loo_rows else predict.EXPECTED_ERROR
        rep = predict.build_report(wl, preds, slo=slo, recorded=first.entry, replayed=replayed, spreads=spreads,
                                   errors=errors, error_source="leave-one-out" if loo_rows else "validation")
        w = rep["whatif"]
        if calibration is not None:
            w["calibration"] = calibration.to_dict()
            w["calibration_notes"] = [CALIBRATED_NOTE]
        if fitted is not None:
            w["fit_run"] = fitted.to_dict()
            others = [t for t in targets[1:]]
            w["self_replays"] = [predict.self_replay_of(r.entry, fitted.figures(t.name) or {}, f"{t.setup.name} "
                                                        f"({t.name}, recorded)", predict.REPLAY_TOLERANCE)
                                 for t in others for r in recs if r.name == t.name and r.entry is not None]
        if spans and fitted is not None:
            knobs = unknowns.knobs(fitted, chosen, params)
            advice = unknowns.next_run(knobs, chosen)
            w["unknowns"] = {"parameters": knobs, "factor": unknowns.FACTOR, "ranges": spans, "next_run": advice}
            unknowns.cannot_tell(rep.get("verdicts") or [], spans, slo, advice)
        if loo_rows:
            w["leave_one_out"] = {"rows": [r.to_dict() for r in loo_rows], "stated_error": errors,
                                  "lines": loo.table_lines(loo_rows), "fits": loo_fits}
            w["error_source"] = "leave-one-out"
        else:
            w["error_source"] = "validation"
    except (WorkloadError, setups.SetupError, records.RecordError, traces.TraceError, OSError, ValueError) as e:
        err.print(f"[red]pdproxy whatif: {escape(str(e))}[/]", soft_wrap=True)
        return 2
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    out = table.make_console(stderr=args.json == "-")
    if not args.no_table:
        table.render(rep, out, drilldown=False, more="every row in the page --html FILE writes")
    print_prediction(rep, out)
    try:
        write_outputs(rep, args.json, (args.html, html_page(rep)) if args.html else None, err)
    except OSError as e:
        err.print(f"[red]pdproxy whatif: cannot write the report: {escape(str(e))}[/]", soft_wrap=True)
        return 2
    return 0
