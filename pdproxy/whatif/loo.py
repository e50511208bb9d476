"""Leave-one-out: how far the model carries to a run it was not fitted on, which is the error a prediction states.

With two or more recordings of a cluster, each is left out in turn: the model is fitted to the others
(pdproxy/whatif/fitrun.py) and predicts the one left out, its own set-up on its own workload, figure by figure
against its recording. A split never recorded is predicted the way the left-out run was, from runs of other
splits, so the largest miss here (per figure, rounded up to 5 %) is the error `pdproxy whatif` states for its
predictions; the in-sample fit, which saw every run, only says how well the model can reproduce them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from pdproxy.bench import stats
from pdproxy.whatif import fitrun, predict
from pdproxy.whatif.model import ModelParams

FIGURES = [name for name, _ in predict.FIGURES]


@dataclass
class Row:
    left_out: str
    setup: str
    figure: str
    recorded: float | None
    predicted: float | None  # fitted on the others
    in_sample: float | None  # fitted on all of them
    band: list[float | None] | None = None  # where the left-out run's true figure lies (its sampling band)

    @staticmethod
    def _err(pred: float | None, rec: float | None) -> float | None:
        return None if pred is None or not rec else (pred - rec) / rec

    @property
    def error(self) -> float | None:
        return self._err(self.predicted, self.recorded)

    @property
    def in_sample_error(self) -> float | None:
        return self._err(self.in_sample, self.recorded)

    @property
    def in_band(self) -> bool:
        return stats.in_band(self.predicted, self.band)

    def to_dict(self) -> dict[str, Any]:
        return {"left_out": self.left_out, "setup": self.setup, "figure": self.figure, "recorded": self.recorded,
                "predicted": self.predicted, "error": self.error, "in_sample": self.in_sample,
                "in_sample_error": self.in_sample_error, "band": self.band, "in_band": self.in_band}


def fit_job(job: tuple[list[fitrun.Target], ModelParams, fitrun.Target | None]
            ) -> tuple[fitrun.RunFit, dict[str, float | None] | None]:
    """Fit on `targets`, then replay `left` (if any) with the fit: one process's work (module level: pools map it)."""
    targets, params, left = job
    fit = fitrun.fit(targets, params)
    return fit, fitrun.replay((left, fit.params)) if left is not None else None


def jobs(targets: list[fitrun.Target], params: ModelParams) -> list[tuple[list[fitrun.Target], ModelParams,
                                                                            fitrun.Target]]:
    """One fit per recording left out (none with fewer than two recordings)."""
    if len(targets) < 2:
        return []
    return [([t for t in targets if t is not left], params, left) for left in targets]


def rows(targets: list[fitrun.Target], left_out: list[dict[str, float | None] | None], joint: fitrun.RunFit,
         bands: dict[str, dict[str, Any]]) -> list[Row]:
    out = []
    for t, pred in zip(targets, left_out):
        inside = joint.figures(t.name) or {}
        for name in FIGURES:
            rec = t.recorded.get(name)
            p = (pred or {}).get(name)
            if rec is None and p is None:
                continue
            out.append(Row(t.name, t.setup.name, name, rec, p, inside.get(name), (bands.get(t.name) or {}).get(name)))
    return out


def stated_errors(loo: list[Row], default: dict[str, float] = predict.EXPECTED_ERROR) -> dict[str, float]:
    """Per figure, the largest leave-one-out miss rounded up to 5 %, and no less than the fit's own miss (two
    recordings may predict each other by luck closer than the model reproduces either); a figure no left-out run
    has keeps `default`."""
    out = dict(default)
    for name in default:
        errs = [abs(e) for r in loo if r.figure == name
                for e in (r.error, r.in_sample_error) if e is not None]
        if errs:
            out[name] = max(0.05, math.ceil(max(errs) * 20 - 1e-9) / 20)
    return out


def table_lines(loo: list[Row]) -> list[str]:
    """The leave-one-out table as text: each recording as the model fitted to the others predicts it."""
    if not loo:
        return []
    lines = ["Leave-one-out: each recording predicted by the model fitted to the others (the stated error is the "
             "largest miss per figure):",
             f"  {'recording':<22} {'set-up':<14} {'figure':<13} {'recorded':>11} {'predicted':>11} {'error':>7} "
             f"{'in-sample':>9}"]
    for r in loo:
        unit, fmt = (1.0, "{:,.0f}") if r.figure == "completed" else (1e3, "{:,.1f} ms")
        rec = "—" if r.recorded is None else fmt.format(r.recorded * unit)
        pred = "—" if r.predicted is None else fmt.format(r.predicted * unit)
        err = "n/a" if r.error is None else f"{r.error:+.0%}"
        ins = "n/a" if r.in_sample_error is None else f"{r.in_sample_error:+.0%}"
        lines.append(f"  {r.left_out[:22]:<22} {r.setup[:14]:<14} {r.figure:<13} {rec:>11} {pred:>11} {err:>7} "
                     f"{ins:>9}")
    return lines


def with_routing(params: ModelParams, routing: dict[str, Any]) -> ModelParams:
    return replace(params, **routing) if routing else params
