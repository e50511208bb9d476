"""The recordings `pdproxy whatif` is given: each a run of one cluster, read with what the proxy's traces add to it.

`--records` may be repeated, once per recorded run of the same cluster (its GPUs, its card): each is a workload on
its own recorded set-up with its own recording to reproduce, and the trace files given with `--traces` are narrowed
to each run (the run its requests join, `workload.one_run`), so that its KV wait, its routing and the instances it
lost come from its own proxy's spans. One parameter set is fitted to all of them (pdproxy/whatif/fitrun.py), and
the first is the workload whose candidate set-ups are predicted.

What a bench record lacks the traces may say: a record made without `--mode` (README's bench example) gets the mode
and the instance counts from the proxy's resource (`pd.mode`, `pd.prefill.count`, `pd.decode.count`), each said.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdproxy.bench import records, traces
from pdproxy.whatif import failures, recorded as recorded_run, setups
from pdproxy.whatif.model import Death
from pdproxy.whatif.workload import Workload, WorkloadError, from_bench, from_index, one_run, warm_from

SET_UP_KEYS = ("pd.mode", "pd.prefill.count", "pd.decode.count")
CLUSTER_KEYS = ("gpu.kind", "gpu.count")  # filled in from the traces where the record lacks them


@dataclass
class Recording:
    """One recorded run: its workload, its set-up as recorded, its own figures, what its traces say of it."""

    name: str
    source: str
    workload: Workload
    idx: traces.TraceIndex | None = None
    setup: setups.Setup | None = None  # as recorded (`recorded=True`); None: the recording does not say
    entry: dict[str, Any] | None = None  # its report entry: what its self-replay is checked against
    deaths: tuple[Death, ...] = ()
    routing: dict[str, Any] = field(default_factory=dict)  # its proxy's policies as ModelParams fields
    bench: bool = True  # a bench record (else the trace files are the recording)


def load(record_files: list[str], trace_files: list[str], warm: list[str], prefixes_as_counted: bool,
         run: str | None = None) -> list[Recording]:
    """Every recording given: the bench records (one each), else the trace files (one run of them)."""
    idx = traces.read_traces(trace_files) if trace_files else None
    if not record_files:
        if idx is None:
            raise WorkloadError("no input: give a bench record file (--records) or trace files (--traces)")
        idx = one_run(idx, run)
        wl = from_index(idx, trace_files)
        return [_complete(Recording(wl.label or "recorded", ",".join(trace_files), wl, idx, bench=False))]
    names = [Path(f).name for f in record_files]
    if len(set(names)) != len(names):
        raise WorkloadError(f"a record file is given twice: {', '.join(record_files)}")
    out = []
    for path in record_files:
        wl = from_bench(path, prefixes_as_counted)
        own = one_run(idx, run if len(record_files) == 1 else None, [r.request_id for r in wl.requests]) \
            if idx is not None else None
        out.append(Recording(wl.label or Path(path).name, path, wl, own))
    for path in warm:
        _warm(out, path)
    return [_complete(r) for r in out]


def _warm(recs: list[Recording], spec: str) -> None:
    """`--warm-from FILE` (the first record) or `--warm-from RECORD=FILE` (the record given as RECORD, by path or file
    name): the run recorded in FILE preceded that record's on the same instances with the same seeded prompts, so
    that record starts with its prompts cached. A run whose caches were emptied in between takes none."""
    after, sep, before = spec.rpartition("=")
    if not sep:
        warm_from(recs[0].workload, before)
        return
    for r in recs:
        if after in (r.source, Path(r.source).name):
            warm_from(r.workload, before)
            return
    raise WorkloadError(f"--warm-from {spec}: {after} is not among the --records")


def _complete(rec: Recording) -> Recording:
    """The recording's set-up (from the traces where the record lacks it), its own figures, routing and failures."""
    wl, idx = rec.workload, rec.idx
    if idx is not None:
        found = traces.resource_conditions([i for i in idx.by_request.values() if i.deployment == "primary"])
        missing = [k for k in SET_UP_KEYS if k not in wl.conditions and k in found]
        for k in missing:
            wl.conditions[k] = str(found[k])
        if missing:
            wl.notes.append(f"{rec.name}: the record does not say its set-up; the proxy's traces do: "
                            + ", ".join(f"{k}={found[k]}" for k in missing))
        for k in CLUSTER_KEYS:
            if k not in wl.conditions and k in found:
                wl.conditions[k] = str(found[k])
    rec.setup = setups.recorded(wl.conditions)
    rec.entry = recorded_run.entry(rec.source if rec.bench else None, idx)
    if idx is not None:
        rec.routing = recorded_run.policies(recorded_run.routing(idx), rec.setup.mode) if rec.setup else {}
        if rec.setup is not None:
            found_deaths, notes = failures.read(idx, wl, rec.setup.mode)
            rec.deaths = tuple(found_deaths)
            wl.notes.extend(notes)
    return rec


def check_cluster(recs: list[Recording]) -> None:
    """Recordings fitted together must be runs of one cluster: the same card where they say (a run may use fewer of
    its GPUs: vllm023's single ran on one of the two); other hardware needs its own fit (it would pull the parameters
    apart)."""
    for key in ("gpu.kind",):
        seen = {r.name: str(r.workload.conditions[key]) for r in recs if r.workload.conditions.get(key) is not None}
        if len(set(seen.values())) > 1:
            raise setups.SetupError(
                f"the recordings are not of one cluster: {key} is " + ", ".join(f"{v} ({n})" for n, v in seen.items())
                + "; give the runs of each cluster to its own `pdproxy whatif`")
