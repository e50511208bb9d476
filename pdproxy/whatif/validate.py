"""How far a prediction lands from a real run: replay run X's workload, predict set-up Y, compare with run Y.

A case names two recorded runs on the same instances (bench records + the proxy's trace files, which
give the KV wait): the workload of `source` is replayed on the set-up `target` was recorded on, and
each figure of the prediction is compared with the same figure of `target`'s report. Used by
benchmarks/whatif_validation.py (the docs' error table) and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pdproxy.bench import records, stats, traces
from pdproxy.sim.presets import PRESETS
from pdproxy.whatif import failures, predict, recorded as recorded_run, setups, workload
from pdproxy.whatif.model import Death, ModelParams

FIGURES = predict.FIGURES


@dataclass(frozen=True)
class Case:
    name: str
    source: str  # bench records whose workload is replayed
    target: str  # bench records of the set-up predicted
    target_traces: tuple[str, ...]  # the proxy's traces of the target run (KV wait)
    preset: str
    overrides: tuple[tuple[str, Any], ...] = ()  # preset fields as the recorded instances had them
    setup: str | None = None  # the target's set-up (default: from its conditions)
    source_traces: tuple[str, ...] = ()  # the source run's traces with vLLM's spans (for --calibrate)
    warm_from: str = ""  # bench records of a run before the source's on the same instances (warm prefix caches)
    outside: str = ""  # why the case is outside what the model claims (left out of the stated error), if it is
    prefixes_as_counted: bool = False  # the source's shared prefixes at the server's count (`workload.from_bench`)


@dataclass
class Row:
    case: str
    figure: str
    recorded: float | None
    predicted: float | None
    band: tuple[float | None, float | None] | None = None  # where the target's true figure lies
    spread: list[float] | None = None  # self-replay: the model's own range (`predict.spread`)

    @property
    def in_band(self) -> bool:
        return stats.in_band(self.predicted, self.band)

    @property
    def error(self) -> float | None:
        if self.recorded is None or self.predicted is None or self.recorded == 0:
            return None
        return (self.predicted - self.recorded) / self.recorded


def target_setup(case: Case, run: records.Run) -> setups.Setup:
    if case.setup:
        return setups.parse_setup(case.setup)
    s = setups.recorded(run.conditions)
    if s is None:
        raise ValueError(f"{case.target}: its conditions do not say its set-up")
    return replace(s, recorded=False)


def calibrated(case: Case, preset: Any) -> Any:
    """The preset fitted to the source run's own spans only (never the target's: that is what is predicted)."""
    from pdproxy.whatif import calibrate

    ids = {str(r["request_id"]) for r in records.read_run(case.source).requests}
    idx = traces.read_traces(list(case.source_traces))
    infos = [i for i in idx.by_request.values() if i.engine and i.request_id in ids]
    if not infos:
        raise ValueError(f"{case.name}: no vLLM spans of the source run in {case.source_traces}")
    return calibrate.fit(infos, preset).preset


def recorded_entry(bench: str, trace_files: tuple[str, ...]) -> dict[str, Any]:
    found = recorded_run.entry(bench, traces.read_traces(list(trace_files)) if trace_files else None)
    assert found is not None
    return found


def source_workload(case: Case) -> workload.Workload:
    wl = workload.from_bench(case.source, case.prefixes_as_counted)
    if case.warm_from:
        workload.warm_from(wl, case.warm_from)
    return wl


def _proxy_traces(files: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(t for t in files if "vllm-spans" not in t)


def lost(wl: workload.Workload, setup: setups.Setup, trace_files: tuple[str, ...]) -> tuple[Death, ...]:
    """The instances the run of `wl` lost, from its proxy's traces (pdproxy/whatif/failures.py)."""
    if not trace_files:
        return ()
    idx = workload.one_run(traces.read_traces(list(trace_files)), None, [r.request_id for r in wl.requests])
    return tuple(failures.read(idx, wl, setup.mode)[0])


def fitted(case: Case, params: ModelParams) -> ModelParams:
    """The model fitted to the source run as a whole (`pdproxy whatif --fit-run`), never to the target; the
    source run's failures replayed as the fit's replays do."""
    from pdproxy.whatif import fitrun

    wl = source_workload(case)
    own = setups.recorded(wl.conditions)
    if own is None:
        raise ValueError(f"{case.source}: its conditions do not say its set-up")
    proxy_traces = _proxy_traces(case.source_traces)
    return fitrun.fit_run(wl, own, params, recorded_entry(case.source, proxy_traces),
                          deaths=lost(wl, own, proxy_traces)).params


def case_params(case: Case, preset: Any) -> ModelParams:
    """The preset with the source run's routing, as `pdproxy whatif` reads it from the proxy's spans."""
    run = records.read_run(case.source)
    own = setups.recorded(run.conditions)
    files = _proxy_traces(case.source_traces)
    idx = workload.one_run(traces.read_traces(list(files)), None, [str(r["request_id"]) for r in run.requests]) \
        if files and own is not None else None
    routing = recorded_run.routing(idx) if idx is not None else {}
    return ModelParams(preset, **(recorded_run.policies(routing, own.mode) if own is not None else {}))


def run_case(case: Case, calibrate: bool = False, fit: bool = False, spread: bool = False) -> list[Row]:
    """The target run as the model predicts it from the source's workload: the target set-up with the target
    run's own failures (a recording with a failure is compared with a replay of it); `spread`: a self-replay's
    rows also get the model's own range over jittered replays."""
    wl = source_workload(case)
    target = records.read_run(case.target)
    preset = replace(PRESETS[case.preset], **dict(case.overrides))
    if calibrate:
        preset = calibrated(case, preset)
    params = case_params(case, preset)
    if fit:
        params = fitted(case, params)
    setup = target_setup(case, target)
    deaths = lost(workload.from_bench(case.target), setup, _proxy_traces(case.target_traces))
    pred = predict.run_setup(wl, setup, params, deaths)
    recorded = recorded_entry(case.target, case.target_traces)
    predicted = predict.build_report(wl, [pred])["runs"][0]
    bands = recorded.get("bands") or {}
    spreads = predict.spread(wl, setup, params, deaths) if spread and case.source == case.target else {}
    return [Row(case.name, name, get(recorded), get(predicted), bands.get(name),
                predict.around(spreads.get(name), get(predicted))) for name, get in FIGURES]
