"""`pdproxy whatif`: predict the report of set-ups you have not run, from a workload you recorded.

Examples:

    pdproxy whatif --records bench/pd-88412b25.jsonl --max-model-len 8192 --num-gpu-blocks 4096
    pdproxy whatif --traces pd-a.jsonl --gpus 4 --setup 2P2D --setup 4xchunked:1024 --html whatif.html
    pdproxy whatif --records run.jsonl --traces proxy.jsonl --traces vllm.jsonl --calibrate

The recorded workload (arrivals, prompt and output tokens, shared prefixes) is replayed on each
candidate set-up at the same GPU total (every P:D ratio, all single, all chunked at --chunk sizes, and
the set-up it was recorded on) by the simulator's engine in virtual time, and printed as `pdproxy
report` prints a real comparison: the same rows, verdicts against the recorded set-up, and the real
runs worth making next. Every figure is a prediction with the expected error stated (docs/explanation/whatif.md).
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.text import Text

from pdproxy import policies
from pdproxy.bench import html, records, table, traces
from pdproxy.bench.report_cli import add_slo_arguments, slo_from, write_outputs
from pdproxy.sim.presets import DEFAULT_PRESET, PRESETS
from pdproxy.config import Settings
from pdproxy.whatif import failures, predict, recorded as recorded_run, setups
from pdproxy.whatif.model import Death, ModelParams
from pdproxy.whatif.workload import Workload, WorkloadError, from_index, load, one_run, warm_from

CALIBRATED_NOTE = ("calibrated on the given spans: the stated error is the shipped presets'; replaying a run's own "
                   "workload with the curves fitted to its spans, TTFT and KV wait landed within 21 % on vllm023 "
                   "P/D, but across set-ups calibration helped some figures and hurt others (docs/explanation/whatif.md)")
PRESET_ATTR = "pdproxy.sim.preset"  # the simulator names its preset on its spans (and a bench may as a condition)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n", 2)[2]
    i = p.add_argument_group("recorded workload")
    i.add_argument("--records", action="append", default=[], metavar="FILE",
                   help="a `pdproxy bench` record file: arrivals, tokens, closed-loop concurrency, shared prefixes")
    i.add_argument("--traces", action="append", default=[], metavar="FILE",
                   help="pdproxy trace file(s) (OTLP-JSON lines): the workload when no records are given; with "
                        "--calibrate also the spans to fit")
    i.add_argument("--run", metavar="NAME",
                   help="the run to replay when the trace files hold several proxies' runs: its proxy's run label "
                        "(pd.run) or instance id; the error lists them")
    i.add_argument("--warm-from", metavar="FILE",
                   help="the bench record of a run just before this one on the same instances with the same seeded "
                        "prompts: the replay starts with its prompts in the prefix caches")
    i.add_argument("--prefixes-as-counted", action="store_true",
                   help="replay a shared prefix at the size the server counted (what it counted beyond the tokens "
                        "a request asked for, where more than the re-drawn prefix); not the default: "
                        "docs/explanation/whatif.md, \"Spread\"")
    s = p.add_argument_group("candidate set-ups")
    s.add_argument("--gpus", type=int, help="GPU total (default: the recording's gpu.count)")
    s.add_argument("--setup", action="append", default=[], metavar="SPEC",
                   help="a set-up to predict: 2P2D, 4xsingle, 4xchunked:2048 (repeatable; default: every P:D "
                        "ratio, all single, all chunked, and the recorded one)")
    s.add_argument("--chunk", action="append", type=int, default=[], metavar="TOKENS",
                   help=f"chunk sizes for the default chunked set-ups (default {setups.DEFAULT_CHUNKS[0]})")
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=sorted(n for n, p in PRESETS.items() if not p.instant), default=None,
                   help=f"timing preset of every instance (default: the one the recording names, as `pdproxy sim` "
                        f"instances do on their spans ({PRESET_ATTR}), else the simulator's default, {DEFAULT_PRESET})")
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
                   help="fit the model's free parameters (GPU time-sharing between instances, the KV link's "
                        "bandwidth) so that the recorded set-up reproduces the recording, print the fit, and predict "
                        "every set-up with it (default: on whenever the recorded set-up is among the candidates, unless "
                        "the recording names the simulator's preset)")
    m.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="set-ups simulated in parallel")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the report as JSON ('-' for stdout)")
    o.add_argument("--html", metavar="PATH", help="write the HTML page `pdproxy report` writes, marked as a prediction")
    o.add_argument("--no-table", action="store_true", help="do not print the terminal table")
    v = p.add_argument_group("verdict (each set-up vs the recorded one)")
    add_slo_arguments(v)


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
                            "run finds (unfitted, each has a GPU's compute to itself; pass --gpus for another "
                            "instance total)")
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


def recorded_preset(wl: Workload, idx: traces.TraceIndex | None) -> str | None:
    """The preset the recording says served it: a condition of the run, else the simulator's spans."""
    named = wl.conditions.get(PRESET_ATTR)
    if named is None and idx is not None:
        named = next((e.attrs[PRESET_ATTR] for i in idx.by_request.values() for e in i.engine.values()
                      if PRESET_ATTR in e.attrs), None)
    return str(named) if named is not None else None


def choose_preset(args: argparse.Namespace, wl: Workload, idx: traces.TraceIndex | None) -> str:
    if args.preset:
        return str(args.preset)
    named = recorded_preset(wl, idx)
    if named in PRESETS and not PRESETS[named].instant:
        wl.notes.append(f"preset {named}: the one the recording names")
        return named
    if named is not None:
        wl.notes.append(f"the recording names preset {named!r}, which the model does not have: the simulator's "
                        f"default {DEFAULT_PRESET} instead")
    else:
        wl.notes.append(f"preset {DEFAULT_PRESET}: the simulator's default (the recording does not name one; pass "
                        "--preset for other hardware)")
    return DEFAULT_PRESET


def model_params(args: argparse.Namespace, wl: Workload, preset_name: str,
                 routing: dict[str, str] | None = None) -> ModelParams:
    """`routing`: the recorded proxy's policies per leg (recorded.routing), the defaults the flags override."""
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
    rec = setups.recorded(wl.conditions)
    found = recorded_run.policies(routing or {}, rec.mode) if rec is not None else {}
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
    return ModelParams(preset, **chosen, proxy=Settings(migrate_mid_stream=args.migrate_mid_stream))


Job = tuple[Workload, setups.Setup, ModelParams, tuple[Death, ...], bool]


def _one(job: Job) -> Any:
    wl, setup, params, deaths, figures_only = job
    pred = predict.run_setup(wl, setup, params, deaths)
    return predict.prediction_figures(pred) if figures_only else pred


def predictions(wl: Workload, chosen: list[setups.Setup], params: ModelParams, jobs: int,
                spread_of: setups.Setup | None = None, deaths: tuple[Death, ...] = ()
                ) -> tuple[list[predict.Prediction], dict[str, tuple[float, float]] | None]:
    """Every chosen set-up predicted, and with `spread_of` the model's own spread there (`predict.spread`, its
    replays in the same pool of `jobs` processes)."""
    work: list[Job] = [(wl, s, params, (), False) for s in chosen]
    if spread_of is not None:
        work += [(wl, spread_of, p, deaths, True) for p in predict.jittered(params)]
    if jobs <= 1 or len(work) == 1:
        done = [_one(w) for w in work]
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(work))) as pool:
            done = list(pool.map(_one, work))
    n = len(chosen)
    return done[:n], predict.spread_of(done[n:]) if spread_of is not None else None


def print_prediction(rep: dict[str, Any], console: Console) -> None:
    w = rep["whatif"]
    console.print(Text(w["prediction"], style="bold yellow"))
    for n in w["workload"]["notes"]:
        console.print(Text(f"assumed: {n}", style="yellow"))
    for n in w.get("calibration_notes") or []:
        console.print(Text(n, style="yellow"))
    if w.get("self_replay"):
        for line in predict.self_replay_lines(w["self_replay"]):
            console.print(Text(line, style="bold red" if "not fit" in line or "NOT FIT" in line else ""))
    for line in w["suggested_runs"]:
        console.print(Text(line, style="bold" if line.startswith("Real runs") else ""))


def html_page(rep: dict[str, Any]) -> str:
    """`pdproxy report`'s page with the prediction banner and the suggested runs on top."""
    w = rep["whatif"]
    esc = html._e
    banner = (f"<div class=flag><b>{esc(w['prediction'])}</b></div>"
              + "".join(f"<div class=flag>assumed: {esc(n)}</div>" for n in w["workload"]["notes"])
              + ("<h2>Self-replay</h2><ul>" + "".join(f"<li>{esc(s)}</li>" for s in
                                                       predict.self_replay_lines(w["self_replay"])) + "</ul>"
                 if w.get("self_replay") else "")
              + "<h2>Suggested real runs</h2><ul>" + "".join(f"<li>{esc(s)}</li>" for s in w["suggested_runs"])
              + "</ul>")
    page = html.render(rep)
    page = page.replace("<h1>pdproxy report:", "<h1>pdproxy whatif (prediction):", 1)
    return page.replace("<body>\n", "<body>\n" + banner + "\n", 1)


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        # the trace files read once, narrowed to one proxy's run: the one named, else the one the record's requests
        # join; without a record they are the workload
        idx = traces.read_traces(args.traces) if args.traces else None
        if idx is not None and not args.records:
            idx = one_run(idx, args.run)
            wl = from_index(idx, args.traces)
        else:
            wl = load(args.records, [], args.prefixes_as_counted)
            if idx is not None:
                idx = one_run(idx, args.run, [r.request_id for r in wl.requests])
        if args.warm_from:
            warm_from(wl, args.warm_from)
        if args.records and args.traces and not args.calibrate:
            wl.notes.append("the workload is the bench record's; the trace files given beside it give the recorded "
                            "KV wait (self-replay) and the preset, and serve --calibrate")
        chosen = choose_setups(args, wl)
        params = model_params(args, wl, choose_preset(args, wl, idx), recorded_run.routing(idx) if idx else None)
        recorded = recorded_run.entry(args.records[0] if args.records else None, idx)
        rec_setup = next((s for s in chosen if s.recorded), None)
        deaths: tuple[Death, ...] = ()
        if idx is not None and rec_setup is not None:
            found, notes = failures.read(idx, wl, rec_setup.mode)
            deaths = tuple(found)
            wl.notes.extend(notes)
            if deaths:
                wl.notes.append("an instance failure is the run's, not its set-up's: the set-ups compared, the "
                                "recorded one included, are predicted without it; the self-replay (and the fit) "
                                "replay it")
        if not args.records:
            wl.notes.append("self-replay against the proxy's traces: TTFT (time to first chunk), per-request max ITL "
                            "(pd.itl.max) and the KV wait as the proxy saw them")
        calibration = None
        if args.calibrate:
            from pdproxy.whatif import calibrate

            calibration = calibrate.fit_files(args.traces, params.preset)
            err.print(calibrate.render(calibration))
            params = replace(params, preset=calibration.preset)
        wl.check(params.preset.max_model_len)
        fitted = None
        if args.fit_run is None and args.preset is None and recorded_preset(wl, idx) == params.preset.name:
            args.fit_run = False  # simulated instances: their timings are the preset's, what misses is the host's
            wl.notes.append("not fitted to the run: the recording names the simulator's preset, whose timings the "
                            "model replays as they are (--fit-run to fit anyway)")
        if args.fit_run is not False and (recorded is None or rec_setup is None):
            if args.fit_run:
                raise setups.SetupError("--fit-run replays the recorded set-up against its recording: keep the "
                                        "recorded set-up among the candidates")
            wl.notes.append("not fitted to the run (its set-up is not among the candidates): the preset's figures")
        elif args.fit_run is not False and rec_setup is not None and recorded is not None:
            from pdproxy.whatif import fitrun

            fitted = fitrun.fit_run(wl, rec_setup, params, recorded, deaths=deaths)
            err.print(fitrun.render(fitted, rec_setup.name))
            params = fitted.params
        # the model's own spread where the self-replay checks it: the recorded set-up, its failures replayed
        preds, spreads = predictions(wl, chosen, params, args.jobs, rec_setup if recorded is not None else None,
                                     deaths)
        replayed = predict.run_setup(wl, rec_setup, params, deaths) if deaths and rec_setup is not None else None
        rep = predict.build_report(wl, preds, slo=slo_from(args), recorded=recorded, replayed=replayed,
                                   spreads=spreads)
        if calibration is not None:
            rep["whatif"]["calibration"] = calibration.to_dict()
            rep["whatif"]["calibration_notes"] = [CALIBRATED_NOTE]
        if fitted is not None:
            rep["whatif"]["fit_run"] = fitted.to_dict()
    except (WorkloadError, setups.SetupError, records.RecordError, traces.TraceError, OSError, ValueError) as e:
        err.print(f"[red]pdproxy whatif: {e}[/]")
        return 2
    out = table.make_console(stderr=args.json == "-")
    if not args.no_table:
        table.render(rep, out, drilldown=False, more="every row in the page --html FILE writes")
    print_prediction(rep, out)
    write_outputs(rep, args.json, (args.html, html_page(rep)) if args.html else None, err)
    return 0
