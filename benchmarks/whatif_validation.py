"""The what-if model against real vLLM 0.23 runs: the error per figure, for docs/explanation/whatif.md.

Self-replay of every shared recording (its workload on its own set-up) and the cross pair of run A (the
same workload recorded as 2P2D and as four single instances, each predicted from the other), compared
with the recording: TTFT, per-request max ITL (tail ITL), the KV wait (pd.kv_transfer, upper bound),
p50 and p99, and the completed requests, beside the recording's own band (where the workload's true figure
lies, 95 % of the time: pdproxy/bench/stats.py `percentile_band`) and whether the prediction
lands in it. Last, the worst error per figure: what the output states.

    PYTHONPATH=. python3 benchmarks/whatif_validation.py              # presets as shipped
    PYTHONPATH=. python3 benchmarks/whatif_validation.py --fit-run    # fitted to the source run as a whole
    PYTHONPATH=. python3 benchmarks/whatif_validation.py --calibrate  # fitted to the source run's spans
    PYTHONPATH=. python3 benchmarks/whatif_validation.py --fit-run --prefixes-as-counted  # docs/explanation/whatif.md "Spread"
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdproxy.bench import stats  # noqa: E402
from pdproxy.whatif.validate import Case, run_case  # noqa: E402

A = ROOT / "tests/fixtures/real-xpyd-2026-12-01b"
B = ROOT / "tests/fixtures/xpyd"
V = ROOT / "tests/fixtures/vllm023"
RUN_A = (("max_model_len", 8192), ("num_gpu_blocks", 4096))
A_RUNS = {"pd": ("pd-88412b25", "pd-a.jsonl.gz"), "dp": ("dp-cc978f0c", "pd-dp.jsonl.gz")}


def _run_a(src: str, tgt: str) -> Case:
    (s, s_tr), (t, t_tr) = A_RUNS[src], A_RUNS[tgt]
    kind = "self-replay" if src == tgt else "cross"
    return Case(f"{kind}: run A {src} workload -> {tgt}", str(A / f"bench-{s}.jsonl.gz"), str(A / f"bench-{t}.jsonl.gz"),
                (str(A / t_tr),), "h200-llama8b", RUN_A,
                source_traces=(str(A / s_tr), str(A / "vllm-spans.otlp.jsonl.gz")))


def cases() -> list[Case]:
    out = [_run_a("pd", "pd"), _run_a("dp", "dp")]
    b, b_tr = str(B / "run-b-bench.jsonl.gz"), str(B / "run-b.otlp.jsonl.gz")
    out.append(Case("self-replay: run B (2P2D, a decode killed at 18 s)", b, b, (b_tr,), "h200-llama8b", RUN_A,
                    source_traces=(b_tr,)))
    for gpus, preset in (("1gpu", "h200-llama8b"), ("2gpu", "h200-llama8b-2gpu")):
        tr = (str(V / f"vllm023-pd-{gpus}.otlp.jsonl.gz"),)
        for kind in ("pd", "single"):
            bench = str(V / f"bench-{gpus}-{kind}.jsonl.gz")
            out.append(Case(f"self-replay: vllm023 {gpus} {kind}", bench, bench, tr, preset,
                            setup="1P1D" if kind == "pd" else "1xsingle", source_traces=tr,
                            warm_from="" if kind == "pd" else str(V / f"bench-{gpus}-pd.jsonl.gz")))
    # four singles -> 2P2D: single instances move no KV, so the singles fit only the GPU sharing; the 2P2D's KV
    # path is the preset's (the link measured on lone transfers, the decodes' intake fitted on run B)
    return [*out, _run_a("pd", "dp"), _run_a("dp", "pd")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", action="store_true",
                    help="fit the model to each source run's own vLLM spans first (pdproxy whatif --calibrate)")
    ap.add_argument("--fit-run", action="store_true",
                    help="fit the model to each source run as a whole first (pdproxy whatif --fit-run)")
    ap.add_argument("--prefixes-as-counted", action="store_true",
                    help="shared prefixes at the size the server counted (pdproxy whatif --prefixes-as-counted)")
    ap.add_argument("--spread", action="store_true",
                    help="self-replays: the model's own range over replays with a millisecond of API-server jitter "
                         "(pdproxy whatif's spread; four more replays per case)")
    args = ap.parse_args()
    print("| case | figure | recorded | predicted | error | recorded's band | in it |"
          + (" model's spread | recorded in it |" if args.spread else ""))
    print("|---|---|---:|---:|---:|---:|:---:|" + ("---:|:---:|" if args.spread else ""))
    worst: dict[str, float] = {}
    started = time.perf_counter()
    for case in cases():
        case = replace(case, prefixes_as_counted=args.prefixes_as_counted)
        t = time.perf_counter()
        rows = run_case(case, calibrate=args.calibrate, fit=args.fit_run, spread=args.spread)
        for r in rows:
            if r.recorded is None and r.predicted is None:
                continue
            unit, fmt = (1.0, "{:.0f}") if r.figure == "completed" else (1e3, "{:.1f} ms")
            err = f"{r.error:+.0%}" if r.error is not None else "n/a"
            rec = fmt.format(r.recorded * unit) if r.recorded is not None else "—"
            pred = fmt.format(r.predicted * unit) if r.predicted is not None else "—"
            band = " / ".join("unbounded" if b is None else f"{b / r.recorded - 1:+.0%}" for b in r.band) \
                if r.band and r.recorded else ""
            inside = ("yes" if r.in_band else "no") if r.band else ""
            spread = ""
            if args.spread:
                lo_hi = " / ".join(f"{b / r.recorded - 1:+.0%}" for b in r.spread) if r.spread and r.recorded else ""
                held = ("yes" if stats.in_band(r.recorded, r.spread) else "no") \
                    if r.spread and r.recorded is not None else ""
                spread = f" {lo_hi} | {held} |"
            print(f"| {case.name} | {r.figure} | {rec} | {pred} | {err} | {band} | {inside} |{spread}")
            if r.error is not None and not case.outside:
                worst[r.figure] = max(worst.get(r.figure, 0.0), abs(r.error))
        print(f"<!-- {case.name}: {time.perf_counter() - t:.1f} s -->", file=sys.stderr)
    print("\nWorst |error| per figure (the stated error): "
          + ", ".join(f"{k} ±{v:.0%}" for k, v in worst.items()))
    for case in cases():
        if case.outside:
            print(f"left out of it: {case.name}: {case.outside}")
    print(f"<!-- all cases: {time.perf_counter() - started:.1f} s -->", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
