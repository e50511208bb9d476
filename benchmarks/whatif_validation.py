"""The what-if model against real vLLM 0.23 runs: the error per figure, for docs/whatif.md.

For each pair of recorded runs on the same instances, the workload of one is replayed on the set-up
of the other (and on its own set-up), and the prediction is compared with the recording: TTFT,
per-request max ITL (tail ITL) and the KV wait (pd.kv_transfer, upper bound), p50 and p99.

    PYTHONPATH=. python3 benchmarks/whatif_validation.py              # presets as shipped
    PYTHONPATH=. python3 benchmarks/whatif_validation.py --calibrate  # fitted to the source run's spans
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdproxy.whatif.validate import Case, run_case  # noqa: E402

A = ROOT / "tests/fixtures/real-xpyd-2026-12-01b"
V = ROOT / "tests/fixtures/vllm023"
RUN_A = (("max_model_len", 8192), ("num_gpu_blocks", 4096))


def cases() -> list[Case]:
    out = []
    for src, tgt, label in (("pd-88412b25", "dp-cc978f0c", "dp"), ("dp-cc978f0c", "pd-88412b25", "pd"),
                            ("pd-88412b25", "pd-88412b25", "pd"), ("dp-cc978f0c", "dp-cc978f0c", "dp")):
        tr = "pd-dp.jsonl.gz" if label == "dp" else "pd-a.jsonl.gz"
        src_tr = "pd-dp.jsonl.gz" if src.startswith("dp") else "pd-a.jsonl.gz"
        out.append(Case(f"run A, 1 H200 x 4 instances: {src.split('-')[0]} workload -> {label}",
                        str(A / f"bench-{src}.jsonl.gz"), str(A / f"bench-{tgt}.jsonl.gz"), (str(A / tr),),
                        "h200-llama8b", RUN_A, source_traces=(str(A / src_tr), str(A / "vllm-spans.otlp.jsonl.gz"))))
    for gpus, preset in (("1gpu", "h200-llama8b"), ("2gpu", "h200-llama8b-2gpu")):
        tr = (str(V / f"vllm023-pd-{gpus}.otlp.jsonl.gz"),)
        for src, tgt in (("pd", "single"), ("single", "pd"), ("pd", "pd"), ("single", "single")):
            setup = "1P1D" if tgt == "pd" else "1xsingle"
            out.append(Case(f"vllm023 {gpus}: {src} workload -> {tgt}", str(V / f"bench-{gpus}-{src}.jsonl.gz"),
                            str(V / f"bench-{gpus}-{tgt}.jsonl.gz"), tr, preset, setup=setup, source_traces=tr))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", action="store_true",
                    help="fit the model to each source run's own vLLM spans first (pdproxy whatif --calibrate)")
    args = ap.parse_args()
    print("| case | figure | recorded ms | predicted ms | error |")
    print("|---|---|---:|---:|---:|")
    for case in cases():
        t = time.perf_counter()
        rows = run_case(case, calibrate=args.calibrate)
        for r in rows:
            if r.recorded is None and r.predicted is None:
                continue
            err = f"{r.error:+.0%}" if r.error is not None else "n/a"
            rec = f"{r.recorded * 1e3:.1f}" if r.recorded is not None else "—"
            pred = f"{r.predicted * 1e3:.1f}" if r.predicted is not None else "—"
            print(f"| {case.name} | {r.figure} | {rec} | {pred} | {err} |")
        print(f"<!-- {case.name}: {time.perf_counter() - t:.1f} s -->", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
