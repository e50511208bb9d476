"""`pdproxy whatif --fit-run`: the model's free parameters fitted so that the recorded set-ups reproduce their runs.

Span fits (`--calibrate`) give each curve from lone intervals; whole runs add what happens between them. One
parameter set is fitted to every recording given (`--records` repeated: runs of one cluster), each parameter on
the recordings that show its mechanism, by replaying every recorded set-up and correcting the parameter by the
ratio recorded / predicted of the figure it drives (geometric mean over its recordings), bisected once bracketed;
up to ROUNDS rounds, fewer once every recording is within GOOD_ENOUGH, the best round kept:

* `gpu_share` (instances on one GPU, preset `shared_gpu`: pdproxy/sim/timing.py `SharedGPU`): on TTFT p50, p99 and
  tail ITL p99 of the recordings of several single instances (a P/D run's gaps are its KV copies and hand-offs too);
* whether the KV copies take their share of the GPU (`kv_link_shares_gpu`: each prefill sending counts as one more
  instance busy) or run beside the compute: the recordings differ (run A's 2P2D decodes stepped at 1.4 lone steps,
  median gap, while KV moved; vllm023's 1-GPU 1P1D decode at one lone step though a copy ran most of the time), so
  where the fit with the copies sharing misses the goal on a P/D recording, it is fitted again with them beside
  the compute and the better kept;
* the link (one decode's KV reads from one prefill: `kv_pair_gbps` on one GPU, else `kv_bandwidth_gbps`): on the KV
  wait (the proxy's traces), else the TTFT, of
  the P/D recordings whose decode reads alone (one decode, or instances on GPUs of their own);
* `kv_together_gbps` (instances on one GPU: the rate all KV reads share while several decodes read, pdproxy/sim/kv.py
  `SharedKVPath`): on the KV wait of the P/D recordings with several decodes;
* `frontend_stream_ms` (vLLM's API server, `FrontEnd`): on what the GPU sharing leaves of the TTFT p50 miss of
  the single-instance recordings, spread over the streams an instance serves.

A parameter no recording shows (the shared rate, with recordings of one decode only; the link, with recordings of
single instances or of several decodes on one GPU only) stays the preset's and is named `unfitted`: predictions that depend on it are only as good as
the preset (the output says so, and `pdproxy whatif` predicts with it moved both ways to show how much it matters).
What is fitted is a mechanism, so it carries to set-ups with other P:D ratios; how far is what leave-one-out
measures (pdproxy/whatif/loo.py), not the in-sample fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pdproxy.sim.presets import Preset
from pdproxy.whatif import predict
from pdproxy.whatif.model import Death, ModelParams
from pdproxy.whatif.setups import Setup
from pdproxy.whatif.workload import Workload

ROUNDS = 8
MAX_STREAM_MS = 10.0  # per stream: beyond it the front end would be a model of something else
GOOD_ENOUGH = 0.05  # worst error on GOAL at which the fit stops early
MAX_SHARE = 4.0
GOAL = ("TTFT p50", "TTFT p99", "tail ITL p99")  # the figures the fit is judged on
SELF_REPLAY_GOAL = 0.25  # issue 56's bound on a replay's TTFT (tail ITL: TOLERANCE)
# issue 56's goal per figure: each recording within it after the fit (the objective's dead zone)
TOLERANCE = {"TTFT p50": 0.25, "TTFT p99": 0.25, "tail ITL p99": 0.35}

Mapper = Callable[[Callable[[Any], Any], list[Any]], list[Any]]


@dataclass(frozen=True)
class Target:
    """One recording the fit reproduces: its workload replayed on its set-up, against its figures."""

    name: str
    workload: Workload
    setup: Setup
    recorded: dict[str, float | None]  # predict.figures of the recording's report entry
    deaths: tuple[Death, ...] = ()
    routing: dict[str, Any] = field(default_factory=dict)  # its proxy's policies (ModelParams fields), as recorded

    @property
    def pd(self) -> bool:
        return self.setup.mode == "pd"


@dataclass
class RunFit:
    params: ModelParams
    rounds: list[dict[str, Any]] = field(default_factory=list)  # per round: parameters, figures, worst error
    best: int = 0
    targets: list[str] = field(default_factory=list)
    unfitted: list[str] = field(default_factory=list)  # parameters no recording shows: the preset's

    @property
    def worst(self) -> float:
        return float(self.rounds[self.best]["worst_error"]) if self.rounds else math.inf

    def figures(self, name: str) -> dict[str, float | None] | None:
        """The best round's predicted figures of recording `name`."""
        return (self.rounds[self.best]["figures"] if self.rounds else {}).get(name)

    def to_dict(self) -> dict[str, Any]:
        p = self.params.preset
        return {"gpu_share": p.gpu_share, "kv_link_shares_gpu": p.kv_link_shares_gpu,
                "kv_bandwidth_gbps": p.kv_bandwidth_gbps, "kv_pair_gbps": p.kv_pair_gbps,
                "kv_together_gbps": p.kv_together_gbps, "frontend_stream_ms": p.frontend_stream_ms,
                "recordings": self.targets, "unfitted": self.unfitted, "rounds": self.rounds,
                "best_round": self.best}


@dataclass
class Bracket:
    """The search for a parameter whose figure moves one way with it: each replay proposes a value; once one
    value is known to be too low and another too high, the next is the middle of the two instead."""

    geometric: bool = False  # the middle of a rate spanning decades is its geometric mean
    low: float | None = None  # the largest value known to be too low
    high: float | None = None  # the smallest value known to be too high

    def next(self, current: float, proposed: float) -> float:
        if proposed > current:
            self.low = current if self.low is None else max(self.low, current)
        elif proposed < current:
            self.high = current if self.high is None else min(self.high, current)
        if self.low is None or self.high is None:
            return proposed
        return math.sqrt(self.low * self.high) if self.geometric and self.low > 0 else (self.low + self.high) / 2


def replay(job: tuple[Target, ModelParams]) -> dict[str, float | None]:
    """The figures of one target replayed with `params`, routed as its run was (a module-level function: process
    pools map it)."""
    target, params = job
    params = replace(params, **target.routing) if target.routing else params
    return predict.prediction_figures(predict.run_setup(target.workload, target.setup, params, target.deaths))


def serial_map(fn: Callable[[Any], Any], jobs: list[Any]) -> list[Any]:
    return [fn(j) for j in jobs]


def _ratio(rec: dict[str, float | None], pred: dict[str, float | None], names: tuple[str, ...]) -> float | None:
    logs = [math.log(r / p) for n in names if (r := rec.get(n)) and (p := pred.get(n))]
    return math.exp(sum(logs) / len(logs)) if logs else None


def _geomean(values: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def worst(rec: dict[str, float | None], pred: dict[str, float | None]) -> float:
    errs = [abs(p - r) / r for n in GOAL if (r := rec.get(n)) and (p := pred.get(n)) is not None]
    return max(errs) if errs else math.inf


def score(targets: Sequence[Target], figures: Sequence[dict[str, float | None]]) -> tuple[float, float]:
    """(the sum of the misses beyond TOLERANCE or vLLM's spread, the sum of squared errors; both in log terms) over
    every recording's GOAL figures: the fit keeps the round with the smallest, the first breaking ties. A sum, not the
    worst, and of the misses, not their squares: a figure no parameter moves (3P1D's tail ITL p99: three streams held
    by two long prefills at one moment) must not outweigh the others."""
    excess, squares = 0.0, 0.0
    for t, pred in zip(targets, figures):
        for n in GOAL:
            r, p = t.recorded.get(n), pred.get(n)
            if not r or not p:
                continue
            e = abs(math.log(p / r))
            squares += e * e
            # the goal, or vLLM's own run-to-run spread where wider (a P/D run's tail ITL p99 is its few streams' luck)
            excess += max(e - math.log1p(max(TOLERANCE[n], predict.VLLM_SPREAD.get(n, 0.0))), 0.0)
    return excess, squares


def _instances(setup: Setup) -> int:
    return setup.gpus  # the model's instances (one per GPU unless they share the recorded ones)


def _several_decodes(t: Target) -> bool:
    return t.pd and t.setup.decodes >= 2


def link_field(preset: Preset) -> str:
    """The preset field one decode's reads from one prefill go at: on one GPU the running cluster's pair rate (where
    the preset has one), else the prefill's link."""
    return "kv_pair_gbps" if preset.shared_gpu and preset.kv_pair_gbps > 0 else "kv_bandwidth_gbps"


def active_knobs(targets: Sequence[Target], preset: Preset) -> tuple[list[str], list[str]]:
    """(the parameters the recordings fit, the ones no recording shows) for `preset`."""
    pd = [t for t in targets if t.pd]
    singles = [t for t in targets if not t.pd]
    fitted, unfitted = [], []
    if preset.shared_gpu:
        # single instances' TTFT and token gaps are the GPU's sharing and little else; a P/D run's gaps are also its
        # KV copies, its hand-offs and its few streams' luck, and fitted on them the sharing misfits the singles
        # (run A's singles predicted from the 2P2D, 1P3D and 3P1D: TTFT p50 +136 %, tail ITL p99 +267 %)
        (fitted if any(not t.pd and _instances(t.setup) > 1 for t in targets) else unfitted).append("gpu_share")
    # one decode's reads meet no other decode's (the link); several decodes' reads on one GPU share a rate: each
    # is fitted on the recordings that show it, and only there
    several = [t for t in pd if preset.shared_gpu and _several_decodes(t)]
    (fitted if len(several) < len(pd) else unfitted).append(link_field(preset))
    if preset.shared_gpu:
        (fitted if several else unfitted).append("kv_together_gbps")
    if singles:
        fitted.append("frontend_stream_ms")
    return fitted, unfitted


def fit(targets: Sequence[Target], params: ModelParams, rounds: int = ROUNDS,
        mapper: Mapper = serial_map) -> RunFit:
    """One parameter set for every target; `mapper` replays a round's targets (a process pool's map). Where KV copies
    share a GPU with the compute and the fit misses a P/D recording's goal (`misses`), the copies beside the compute
    are fitted too, and the better of the two kept."""
    first = _fit(list(targets), params, rounds, mapper)
    p = params.preset
    if not (p.shared_gpu and p.kv_link_shares_gpu and any(t.pd for t in targets) and misses(first, targets)):
        return first
    apart = _fit(list(targets), replace(params, preset=replace(p, kv_link_shares_gpu=False)), rounds, mapper)
    best, other = (apart, first) if apart.rounds[apart.best]["score"] < first.rounds[first.best]["score"] else \
        (first, apart)
    best.rounds = (first.rounds + apart.rounds) if best is first else (first.rounds + apart.rounds)
    best.best += len(first.rounds) if best is apart else 0
    return best


def misses(fit_: RunFit, targets: Sequence[Target]) -> bool:
    """Whether the fit's best round leaves a P/D recording outside TOLERANCE on a GOAL figure."""
    figs = fit_.rounds[fit_.best]["figures"] if fit_.rounds else {}
    for t in targets:
        f = figs.get(t.name) or {}
        if t.pd and any((r := t.recorded.get(n)) and (p := f.get(n)) is not None and abs(p - r) / r > TOLERANCE[n]
                        for n in GOAL):
            return True
    return False


def _fit(targets: list[Target], params: ModelParams, rounds: int, mapper: Mapper) -> RunFit:
    knobs, unfitted = active_knobs(targets, params.preset)
    preset = params.preset
    out = RunFit(params, targets=[t.name for t in targets], unfitted=unfitted)
    best: tuple[float, float] = (math.inf, math.inf)
    brackets = {"kv_bandwidth_gbps": Bracket(geometric=True), "kv_pair_gbps": Bracket(geometric=True),
                "kv_together_gbps": Bracket(geometric=True),
                "frontend_stream_ms": Bracket()}
    tried: list[tuple[Preset, list[dict[str, float | None]]]] = []
    for n in range(rounds):
        trial = replace(params, preset=preset)
        figs = mapper(replay, [(t, trial) for t in targets])
        tried.append((preset, figs))
        sc = score(targets, figs)
        out.rounds.append(_round(preset, targets, figs, sc))
        if sc < best:
            best, out.params, out.best = sc, trial, n
        if max(worst(t.recorded, f) for t, f in zip(targets, figs)) <= GOOD_ENOUGH:
            break
        changes = _propose(knobs, targets, figs, preset, brackets)
        changes = {k: v for k, v in changes.items()
                   if getattr(preset, k) is None or not math.isclose(v, getattr(preset, k), rel_tol=1e-3)}
        if not changes:
            break
        preset = replace(preset, **changes)
    # each parameter drives its own recordings: the round best for those may not be the round best for all, so each
    # takes its value from the round that reproduced its recordings best, and the combination is replayed once
    combined = _per_knob_best(knobs, targets, tried, out.params.preset)
    if len(tried) > 1 and combined is not None:
        trial = replace(params, preset=combined)
        figs = mapper(replay, [(t, trial) for t in targets])
        sc = score(targets, figs)
        out.rounds.append(_round(combined, targets, figs, sc))
        if sc < best:
            best, out.params, out.best = sc, trial, len(out.rounds) - 1
    out.params = replace(out.params, preset=replace(out.params.preset, name=f"{params.preset.name}+fitted"))
    return out


def _knob_targets(knob: str, targets: list[Target], preset: Preset) -> list[int]:
    """The indices of the recordings a parameter is fitted on (as `_propose` reads them)."""
    if knob == "gpu_share":
        return [i for i, t in enumerate(targets) if not t.pd and _instances(t.setup) > 1]
    if knob in ("kv_bandwidth_gbps", "kv_pair_gbps"):
        return [i for i, t in enumerate(targets) if t.pd and not (preset.shared_gpu and _several_decodes(t))]
    if knob == "kv_together_gbps":
        return [i for i, t in enumerate(targets) if _several_decodes(t)]
    if knob == "frontend_stream_ms":
        return [i for i, t in enumerate(targets) if not t.pd]
    return []


def _per_knob_best(knobs: list[str], targets: list[Target], tried: list[tuple[Preset, list[dict[str, float | None]]]],
                   best: Preset) -> Preset | None:
    """The best round's preset with each parameter taken from the round that scored best on that parameter's own
    recordings; None when that is the best round's already."""
    changes: dict[str, Any] = {}
    for knob in knobs:
        idx = _knob_targets(knob, targets, best)
        if not idx:
            continue
        own = min(tried, key=lambda tf: score([targets[i] for i in idx], [tf[1][i] for i in idx]))
        if getattr(own[0], knob) != getattr(best, knob):
            changes[knob] = getattr(own[0], knob)
    return replace(best, **changes) if changes else None


def _propose(knobs: list[str], targets: list[Target], figs: list[dict[str, float | None]], preset: Preset,
             brackets: dict[str, Bracket]) -> dict[str, float]:
    pairs = list(zip(targets, figs))
    changes: dict[str, float] = {}
    share = preset.gpu_share
    if "gpu_share" in knobs:
        proposals = []
        for t, f in [(t, f) for t, f in pairs if not t.pd and _instances(t.setup) > 1]:
            others = _instances(t.setup) - 1
            r = _ratio(t.recorded, f, GOAL)
            if r is not None:
                proposals.append(((1.0 + share * others) * r - 1.0) / others)
        if proposals:
            share = min(max(sum(proposals) / len(proposals), 0.0), MAX_SHARE)
            changes["gpu_share"] = share
    field_ = link_field(preset)
    link = getattr(preset, field_)
    if field_ in knobs and link > 0:
        # the reads of one decode meet no other decode's: those recordings size the link (all P/D ones when the
        # contention is not fitted)
        alone = [(t, f) for t, f in pairs if t.pd and not (preset.shared_gpu and _several_decodes(t))]
        r = _geomean([x for t, f in alone if (x := _kv_ratio(t, f)) is not None])
        if r is not None:
            link = brackets[field_].next(link, link / r)
            changes[field_] = link
    if "kv_together_gbps" in knobs and preset.kv_together_gbps > 0:
        r = _geomean([x for t, f in pairs if _several_decodes(t) and (x := _kv_ratio(t, f)) is not None])
        if r is not None:
            together = preset.kv_together_gbps
            changes["kv_together_gbps"] = brackets["kv_together_gbps"].next(together, together / r)
    if "frontend_stream_ms" in knobs:
        proposals = []
        for t, f in pairs:
            if t.pd:
                continue
            others = _instances(t.setup) - 1
            compute = 1.0
            if "gpu_share" in knobs and others > 0 and (r := _ratio(t.recorded, f, GOAL)) is not None:
                compute = r
            v = _front_stream_ms(preset.frontend_stream_ms, t.recorded, f, compute, _streams_per_instance(t))
            if v is not None:
                proposals.append(v)
        if proposals:
            changes["frontend_stream_ms"] = brackets["frontend_stream_ms"].next(
                preset.frontend_stream_ms, sum(proposals) / len(proposals))
    return changes


def _kv_ratio(t: Target, f: dict[str, float | None]) -> float | None:
    return _ratio(t.recorded, f, ("KV wait p50", "KV wait p99")) or _ratio(t.recorded, f, ("TTFT p50", "TTFT p99"))


def fit_run(workload: Workload, setup: Setup, params: ModelParams, recorded: dict[str, Any],
            rounds: int = ROUNDS, deaths: tuple[Death, ...] = ()) -> RunFit:
    """One recording (its report entry `recorded`): `deaths`, the instances the recorded run lost
    (pdproxy/whatif/failures.py), are replayed in every round so that the capacity they took with them is not
    fitted into the parameters."""
    return fit([Target("recorded", workload, setup, predict.figures(recorded), deaths)], params, rounds)


def _round(preset: Preset, targets: list[Target], figs: list[dict[str, float | None]],
           sc: tuple[float, float]) -> dict[str, Any]:
    return {"gpu_share": round(preset.gpu_share, 4), "kv_link_shares_gpu": preset.kv_link_shares_gpu,
            "kv_bandwidth_gbps": preset.kv_bandwidth_gbps, "kv_pair_gbps": preset.kv_pair_gbps,
            "kv_together_gbps": preset.kv_together_gbps,
            "frontend_stream_ms": round(preset.frontend_stream_ms, 3),
            "figures": {t.name: f for t, f in zip(targets, figs)},
            "errors": {t.name: worst(t.recorded, f) for t, f in zip(targets, figs)},
            "worst_error": max(worst(t.recorded, f) for t, f in zip(targets, figs)), "score": list(sc)}


def _streams_per_instance(t: Target) -> float:
    """The streams one instance serves in the recorded run: its closed-loop clients, spread over the instances."""
    clients = sum(c.concurrency or 0 for c in t.workload.classes)
    return clients / max(t.setup.singles or t.setup.decodes, 1)


def _front_stream_ms(current: float, rec: dict[str, float | None], pred: dict[str, float | None], compute: float,
                     streams: float) -> float | None:
    """The front end's time per stream that closes what is left of the TTFT p50 miss once the compute is
    stretched by `compute` (the GPU sharing's correction of the same round); None: nothing to fit it on."""
    r, p = rec.get("TTFT p50"), pred.get("TTFT p50")
    if not r or p is None or streams < 1:
        return None
    return min(max(current + (r - p * compute) * 1e3 / streams, 0.0), MAX_STREAM_MS)


def render(fit_: RunFit, setup: str) -> str:
    p = fit_.params.preset
    what = (f"the whole recorded run ({setup}" if len(fit_.targets) <= 1 else
            f"{len(fit_.targets)} recordings of the cluster ({', '.join(fit_.targets)}")
    gpu = (f"GPU time-sharing {p.gpu_share:.2f} per other busy instance (the KV copies "
           f"{'one more while a prefill sends' if p.kv_link_shares_gpu else 'beside the compute'}), "
           if p.shared_gpu else "")
    kv = f"KV link {getattr(p, link_field(p)):.3g} GB/s per prefill-decode pair"
    if p.shared_gpu and p.kv_together_gbps > 0:
        kv += f", {p.kv_together_gbps:.3g} GB/s in all while several decodes read"
    unfitted = (f"; not fitted (no recording shows it, the preset's): {', '.join(_KNOB_TEXT[k] for k in fit_.unfitted)}"
                if fit_.unfitted else "")
    return (f"Fitted to {what}, {len(fit_.rounds)} replays, best round {fit_.best + 1}): {gpu}{kv}, "
            f"front end {p.frontend_stream_ms:.2f} ms per stream served; worst in-sample error on "
            f"{', '.join(GOAL)} {fit_.worst:.0%}{unfitted}")


_KNOB_TEXT = {"gpu_share": "GPU sharing (no recording of several single instances)",
              "kv_bandwidth_gbps": "KV link (no recording of one decode reading)",
              "kv_pair_gbps": "KV link (no recording of one decode reading)",
              "kv_together_gbps": "the rate several decodes' KV reads share (no recording of several decodes)",
              "frontend_stream_ms": "front end per stream"}
