"""What one recording cannot tell: the parameters no mechanism in it shows, moved both ways, and the range that opens.

A run of 2P2D on one GPU shows how fast several decodes' reads go together, not one decode's link; four single
instances show the GPU's sharing, not the KV path. With one recording the fit leaves those parameters at the preset's
values (`RunFit.unfitted`), and any value would fit the recording equally well. So every candidate a parameter
matters to is predicted again with it halved and doubled, each figure's range is reported, and a verdict whose range
crosses an SLO says it cannot tell from this recording and names the run whose recording would fit that parameter.
(With two or more recordings, leave-one-out measures what they cannot tell instead: pdproxy/whatif/loo.py.)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pdproxy.whatif.fitrun import MAX_SHARE, RunFit
from pdproxy.whatif.model import ModelParams
from pdproxy.whatif.setups import Setup

FACTOR = 2.0  # each way: how far a parameter no recording shows is moved (the presets were measured elsewhere)
MOVED = ("kv_bandwidth_gbps", "kv_pair_gbps", "kv_together_gbps", "gpu_share")


def matters(knob: str, setup: Setup, params: ModelParams) -> bool:
    """Whether `knob` moves a prediction of `setup` at all."""
    p = params.preset
    if knob in ("kv_bandwidth_gbps", "kv_pair_gbps"):
        return setup.mode == "pd"
    if knob == "kv_together_gbps":
        return p.shared_gpu and setup.mode == "pd" and setup.decodes >= 2
    if knob == "gpu_share":
        return p.shared_gpu and setup.gpus > 1
    return False


def knobs(fit: RunFit, chosen: list[Setup], params: ModelParams) -> list[str]:
    """The parameters the fit left unfitted that move a prediction of a candidate."""
    return [k for k in fit.unfitted if k in MOVED and any(matters(k, s, params) for s in chosen)]


def moved(fit: RunFit, chosen: list[Setup], params: ModelParams) -> list[tuple[str, ModelParams]]:
    """("low"/"high", parameters) with every unfitted parameter that matters to a candidate halved, then doubled;
    none when nothing is left unfitted that matters. The caller keeps only those whose replay of the recorded set-up
    still fits the recording as well as the fit did."""
    knobs = globals()["knobs"](fit, chosen, params)
    if not knobs:
        return []
    out = []
    for label, f in (("low", 1 / FACTOR), ("high", FACTOR)):
        over = {k: min(getattr(params.preset, k) * f, MAX_SHARE) if k == "gpu_share" else getattr(params.preset, k) * f
                for k in knobs}
        out.append((label, replace(params, preset=replace(params.preset, **over))))
    return out


def ranges(main: dict[str, dict[str, float | None]], others: list[dict[str, dict[str, float | None]]]
           ) -> dict[str, dict[str, list[float]]]:
    """Per set-up and figure, [lowest, highest] over the prediction and its moved replays."""
    out: dict[str, dict[str, list[float]]] = {}
    for setup, figs in main.items():
        for name, v in figs.items():
            values = [x for x in [v, *((o.get(setup) or {}).get(name) for o in others)] if x is not None]
            if values:
                out.setdefault(setup, {})[name] = [min(values), max(values)]
    return out


def next_run(knobs: list[str], chosen: list[Setup]) -> str:
    """The run whose recording would fit what this one cannot tell."""
    wants = []
    if "kv_together_gbps" in knobs:
        several = next((s.name for s in chosen if s.mode == "pd" and s.decodes >= 2), "a split with two decodes or more")
        wants.append(f"{several} (several decodes reading KV at once)")
    if "kv_bandwidth_gbps" in knobs or "kv_pair_gbps" in knobs:
        one = next((s.name for s in chosen if s.mode == "pd" and s.decodes == 1), "a split with one decode")
        wants.append(f"{one} (one decode reading KV)")
    if "gpu_share" in knobs:
        single = next((s.name for s in chosen if s.mode == "single" and s.gpus > 1), "the instances as single ones")
        wants.append(f"{single} (single instances sharing the GPU)")
    return "record " + " or ".join(wants) + " and give both recordings (--records twice)"


def cannot_tell(verdicts: list[dict[str, Any]], spans: dict[str, dict[str, list[float]]], slo: Any,
                advice: str) -> None:
    """A verdict with SLOs whose candidate's or baseline's figure ranges across an SLO: cannot tell from this one
    recording (its decision and reason replaced, the criterion kept)."""
    if slo is None or (slo.ttft is None and slo.tail_itl is None):
        return
    p = slo.percentile
    for v in verdicts:
        for label in [v["candidate"], *v["baselines"]]:
            figs = spans.get(label) or {}
            for name, target in ((f"TTFT p{p}", slo.ttft), (f"tail ITL p{p}", slo.tail_itl)):
                lo_hi = figs.get(name)
                if target is None or lo_hi is None or not lo_hi[0] <= target <= lo_hi[1]:
                    continue
                v["decision"] = "cannot tell from this recording"
                v["decided_by"] = None
                v["reason"] = (f"{label}'s {name} ranges {lo_hi[0] * 1e3:.0f}-{lo_hi[1] * 1e3:.0f} ms over what this "
                               f"recording cannot tell, across the SLO of {target * 1e3:.0f} ms: {advice}")
                break
            else:
                continue
            break
