"""The what-if model against real vLLM 0.23 runs, cluster by cluster: in-sample fit and leave-one-out, for docs/explanation/whatif.md.

Each cluster's recordings go to one `pdproxy whatif` (the command itself, `--json`): one parameter set is fitted to
all of them, each is replayed against its recording (in-sample), and each is predicted by the model fitted to the
others (leave-one-out, the error a prediction states). Printed per recording and figure: recorded, leave-one-out
prediction and error, in-sample error, whether the left-out prediction lands in the recording's own band; then per
cluster the fitted parameters, and last the issue-56 goals (in-sample: TTFT p50 and p99 within ±25 %, tail ITL p99
within ±35 %, or inside vLLM's own run-to-run spread where that is wider; leave-one-out: TTFT p50 ±25 %, tail ITL
p99 ±35 %) and how many pairs of set-ups the leave-one-out predictions order as measured.

    PYTHONPATH=. python3 benchmarks/whatif_validation.py                 # every cluster (a few minutes)
    PYTHONPATH=. python3 benchmarks/whatif_validation.py --cluster one-h200-4
    PYTHONPATH=. python3 benchmarks/whatif_validation.py --run-b          # run B's self-replay with its dead decode
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdproxy.whatif.predict import within  # noqa: E402

F = ROOT / "tests/fixtures"
A, R, V, P = F / "real-xpyd-2026-12-01b", F / "real-ratios-2026-12-01", F / "vllm023", F / "real-repeats-2026-12-07"


def _repeats() -> list[str]:
    out = []
    for k in (1, 2, 3):
        pd = next(P.glob(f"pd-r{k}-*.jsonl.gz"))
        single = next(P.glob(f"single-r{k}-*.jsonl.gz"))
        out += ["--records", str(pd), "--records", str(single), "--warm-from", f"{single.name}={pd}",
                "--traces", str(P / f"tr-pd-r{k}.jsonl.gz"), "--traces", str(P / f"tr-single-r{k}.jsonl.gz")]
    return [*out, "--traces", str(P / "vllm-spans.otlp.jsonl.gz")]


# Each cluster: the runs of one set of instances (the same GPUs and card), and what their records do not say.
CLUSTERS: dict[str, tuple[str, list[str]]] = {
    "one-h200-4": ("four vLLM 0.23 instances on one H200 (run A and the ratio runs; 8 GiB KV each)", [
        "--records", str(A / "bench-pd-88412b25.jsonl.gz"), "--records", str(A / "bench-dp-cc978f0c.jsonl.gz"),
        "--records", str(R / "p1d3-147e34b8.jsonl.gz"), "--records", str(R / "p3d1-f3716690.jsonl.gz"),
        "--traces", str(A / "pd-a.jsonl.gz"), "--traces", str(A / "pd-dp.jsonl.gz"),
        "--traces", str(R / "rr-p1d3.jsonl.gz"), "--traces", str(R / "rr-p3d1.jsonl.gz"),
        # the benches named gpu.count 4 for four instances on one H200; 8 GiB of KV each
        "--recorded-gpus", "1", "--num-gpu-blocks", "4096"]),
    "one-h200-2": ("vllm023: a prefill and a decode instance on one H200, then the decode alone", [
        "--records", str(V / "bench-1gpu-pd.jsonl.gz"), "--records", str(V / "bench-1gpu-single.jsonl.gz"),
        "--warm-from", f"bench-1gpu-single.jsonl.gz={V / 'bench-1gpu-pd.jsonl.gz'}",
        "--traces", str(V / "vllm023-pd-1gpu.otlp.jsonl.gz")]),
    "two-h200": ("vllm023: a prefill and a decode instance on two H200s, then the decode alone", [
        "--records", str(V / "bench-2gpu-pd.jsonl.gz"), "--records", str(V / "bench-2gpu-single.jsonl.gz"),
        "--warm-from", f"bench-2gpu-single.jsonl.gz={V / 'bench-2gpu-pd.jsonl.gz'}",
        "--traces", str(V / "vllm023-pd-2gpu.otlp.jsonl.gz")]),
    "one-h100-2": ("the vllm023 1-GPU workload repeated three times on one H100 (P/D, then the decode alone)",
                   _repeats()),
}
RUN_B = ["--records", str(F / "xpyd/run-b-bench.jsonl.gz"), "--traces", str(F / "xpyd/run-b.otlp.jsonl.gz"),
         "--recorded-gpus", "1", "--num-gpu-blocks", "4096"]
GOAL_IN = {"TTFT p50": 0.25, "TTFT p99": 0.25, "tail ITL p99": 0.35}
GOAL_LOO = {"TTFT p50": 0.25, "tail ITL p99": 0.35}


def whatif(args: list[str], setup: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "pdproxy", "whatif", *args, "--json", "-", "--no-table"]
    if setup:
        cmd += ["--setup", setup]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    if p.returncode != 0:
        raise SystemExit(f"pdproxy whatif failed:\n{p.stderr}")
    return json.loads(p.stdout[p.stdout.index("{"):])


def _recorded_setup(args: list[str]) -> str | None:
    from pdproxy.bench.records import read_run
    from pdproxy.whatif import setups

    first = read_run(args[args.index("--records") + 1])
    s = setups.recorded(first.conditions)
    if "--recorded-gpus" in args and s is not None:
        return s.name
    return s.name if s is not None else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", action="append", choices=list(CLUSTERS), help="only these clusters")
    ap.add_argument("--run-b", action="store_true", help="run B's self-replay with its dead decode replayed")
    args = ap.parse_args()
    if args.run_b:
        rep = whatif(RUN_B, "2P2D")
        for r in rep["whatif"]["self_replay"]["rows"]:
            err = "n/a" if r["error"] is None else f"{r['error']:+.0%}"
            print(f"run B {r['figure']}: recorded {r['recorded']}, predicted {r['predicted']}, {err}")
        return 0
    print("| cluster | recording | set-up | figure | recorded | leave-one-out | error | in-sample | LOO in the band |")
    print("|---|---|---|---|---:|---:|---:|---:|:---:|")
    goals_in, goals_loo, pairs, slos = [], [], [], []
    worst: dict[str, float] = {}
    fitted_lines = []
    for name in args.cluster or list(CLUSTERS):
        what, cargs = CLUSTERS[name]
        t = time.perf_counter()
        rep = whatif(cargs, _recorded_setup(cargs))
        w = rep["whatif"]
        fitted_lines.append(f"{name}: {what}: " + ", ".join(
            f"{k} {v:.3g}" for k, v in w["fit_run"].items() if isinstance(v, (int, float)) and k != "best_round")
            + (f"; not fitted: {', '.join(w['fit_run']['unfitted'])}" if w["fit_run"]["unfitted"] else ""))
        rows = w["leave_one_out"]["rows"]
        for left, f in w["leave_one_out"]["fits"].items():
            fitted_lines.append(f"{name} without {left}: " + ", ".join(
                f"{k} {v:.3g}" for k, v in f.items() if isinstance(v, (int, float)) and k != "best_round")
                + (f"; not fitted: {', '.join(f['unfitted'])}" if f["unfitted"] else ""))
        for r in rows:
            if r["recorded"] is None:
                continue
            unit, fmt = (1.0, "{:.0f}") if r["figure"] == "completed" else (1e3, "{:.1f} ms")
            pred = fmt.format(r["predicted"] * unit) if r["predicted"] is not None else "—"
            err = f"{r['error']:+.0%}" if r["error"] is not None else "n/a"
            ins = f"{r['in_sample_error']:+.0%}" if r["in_sample_error"] is not None else "n/a"
            inside = ("yes" if r["in_band"] else "no") if r["band"] else ""
            print(f"| {name} | {r['left_out']} | {r['setup']} | {r['figure']} | {fmt.format(r['recorded'] * unit)} "
                  f"| {pred} | {err} | {ins} | {inside} |")
            if r["error"] is not None:
                worst[r["figure"]] = max(worst.get(r["figure"], 0.0), abs(r["error"]))
            if r["figure"] in GOAL_IN and r["in_sample"] is not None:
                ok = within(r["figure"], r["in_sample"], r["recorded"], GOAL_IN[r["figure"]])
                goals_in.append((name, r["left_out"], r["figure"], r["in_sample_error"], ok))
            if r["figure"] in GOAL_LOO and r["error"] is not None:
                goals_loo.append((name, r["left_out"], r["figure"], r["error"], GOAL_LOO[r["figure"]],
                                  within(r["figure"], r["predicted"], r["recorded"], GOAL_LOO[r["figure"]])))
        by_run: dict[str, dict[str, tuple[str, float, float]]] = {}
        for r in rows:
            if r["predicted"] is not None and r["recorded"] is not None:
                by_run.setdefault(r["figure"], {})[r["left_out"]] = (r["setup"], r["recorded"], r["predicted"])
        # SLO verdicts: at an SLO between each two neighbouring recorded figures of different set-ups, does the
        # left-out prediction meet it exactly when the recording did?
        for fig in ("TTFT p99", "tail ITL p99"):
            got = sorted(by_run.get(fig, {}).values(), key=lambda x: x[1])
            for lo, hi in zip(got, got[1:]):
                if lo[0] == hi[0] or lo[1] == hi[1]:
                    continue
                slo_value = (lo[1] * hi[1]) ** 0.5
                right = all((rec <= slo_value) == (pred <= slo_value) for _, rec, pred in got)
                slos.append((name, fig, slo_value, right))
        for fig in ("TTFT p50", "tail ITL p99"):  # pairs of different set-ups (repeats of one differ by noise)
            for (a, (sa, ra, pa)), (b, (sb, rb, pb)) in itertools.combinations(by_run.get(fig, {}).items(), 2):
                if sa != sb and ra != rb:
                    pairs.append((name, fig, a, b, (ra < rb) == (pa < pb)))
        print(f"<!-- {name}: {time.perf_counter() - t:.0f} s -->", file=sys.stderr)
    print()
    for line in fitted_lines:
        print(f"fitted {line}")
    ok_in = [g for g in goals_in if g[4]]
    ok_loo = [g for g in goals_loo if abs(g[3]) <= g[4]]
    ok_spread = [g for g in goals_loo if g[5]]
    print(f"\nin-sample within the goal (or vLLM's own spread): {len(ok_in)} of {len(goals_in)}; missed: "
          + ", ".join(f"{c}/{r} {f} {e:+.0%}" for c, r, f, e, ok in goals_in if not ok))
    print(f"leave-one-out within the goal: {len(ok_loo)} of {len(goals_loo)} ({len(ok_spread)} with vLLM's own spread); "
          "missed: " + ", ".join(f"{c}/{r} {f} {e:+.0%}" for c, r, f, e, g, _ in goals_loo if abs(e) > g))
    print(f"pairs of set-ups ordered as measured (leave-one-out, within each cluster): {sum(p[4] for p in pairs)} of "
          f"{len(pairs)}; missed: " + ", ".join(f"{c} {f} {a}/{b}" for c, f, a, b, ok in pairs if not ok))
    print(f"SLO verdicts (an SLO between each two neighbouring set-ups' recorded p99s): {sum(x[3] for x in slos)} of "
          f"{len(slos)} right for every left-out run; wrong: " + ", ".join(
              f"{c} {f} SLO {v * 1e3:.0f} ms" for c, f, v, ok in slos if not ok))
    print("worst leave-one-out |error| per figure: " + ", ".join(f"{k} {v:.0%}" for k, v in worst.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
