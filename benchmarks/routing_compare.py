"""Routing policies compared side by side on 2 prefill + 2 decode simulated vLLM instances.

    python benchmarks/routing_compare.py [--requests 200] [--json out.json]

Two comparisons, each a pair of `pdproxy bench` runs against fresh instances and a fresh proxy that
differ only in the prefill pool's policy:

* prefix reuse: 8 shared system prompts of 1,300 words (~3,000 tokens) in front of 64-token questions,
  concurrency 16,
  KV cache 1,400 blocks per instance (22,400 tokens: room for the running requests and about half the
  system prompts), KV link 25 GB/s; round_robin against cache_aware. Reported: the prefill instances'
  prefix-cache hit rate and computed prompt tokens (their own vLLM counters, read by the bench with
  --engine-metrics), TTFT p50 and p99.
* one slow instance: prefill instance 0 runs 4x slower (--time-scale 4), distinct 1,024-token prompts,
  concurrency 12, KV link 25 GB/s; round_robin against load_aware (engine /metrics read every 0.5 s). Reported: TTFT p50
  and p99 and the slow instance's share of the prompt tokens.

The numbers are simulated GPU time plus this machine's real proxy and HTTP time; docs/notes/routing.md quotes
a run. tests/test_routing_compare.py runs this script small and checks the direction of each result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

SIM = ("--preset", "h200-llama8b-2gpu", "--kv-bandwidth-gbps", "25")  # a fast KV link: routing decides TTFT
PREFIX_SIM = (*SIM, "--num-gpu-blocks", "1400")


def one_run(policy: list[str], sim: tuple[str, ...], bench: list[str], work: Path,
            slow: tuple[str, ...] = ()) -> dict:
    """Fresh instances and proxy; one `pdproxy bench` run; its summary."""
    with harness.Procs() as procs:
        prefill = [procs.pdproxy("sim", "--role", "prefill", *sim, *(slow if k == 0 else ())).url for k in range(2)]
        decode = [procs.pdproxy("sim", "--role", "decode", *sim).url for _ in range(2)]
        url = procs.pdproxy("serve", "--prefill", *prefill, "--decode", *decode, *policy,
                            "--health-check-interval", "0", "--no-tracing").url
        out = work / f"{'-'.join(policy).strip('-')}-{time.monotonic_ns()}.jsonl"
        done = subprocess.run([sys.executable, "-m", "pdproxy", "bench", "--url", url, "--out", str(out), "--quiet",
                               "--label", policy[-1], "--engine-metrics", *prefill, *bench],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(done.stderr)
        summary = json.loads(out.read_text().splitlines()[-1])
        counters = summary["engine_counters"]
        tokens = [counters["instances"][u]["prompt_tokens"] for u in prefill]
        st = summary["stats"]
        return {"policy": " ".join(policy), "ok": st["requests"]["ok"], "failed": st["requests"]["failed"],
                "hit_rate": counters["hit_rate"], "computed_tokens": counters["computed"],
                "ttft_p50": st["ttft"]["p50"], "ttft_p99": st["ttft"]["p99"],
                "slow_share": tokens[0] / sum(tokens) if sum(tokens) else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per run, after 16 warm-up ones (default 200)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    n = str(args.requests + 16)
    prefix_bench = ["--shared-prefixes", "8", "--prefix-len", "3000", "--prompt-len", "64", "--output-len", "16",
                    "--concurrency", "16", "--requests", n, "--warmup-requests", "16"]
    slow_bench = ["--prompt-len", "1024", "--output-len", "16", "--concurrency", "12", "--requests", n,
                  "--warmup-requests", "16"]
    results: dict[str, list[dict]] = {"prefix_reuse": [], "slow_instance": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for policy in (["--prefill-policy", "round_robin"], ["--prefill-policy", "cache_aware"]):
            results["prefix_reuse"].append(one_run(policy, PREFIX_SIM, prefix_bench, work))
        for policy in (["--prefill-policy", "round_robin"],
                       ["--prefill-policy", "load_aware", "--load-metrics-interval", "0.5"]):
            results["slow_instance"].append(one_run(policy, SIM, slow_bench, work, slow=("--time-scale", "4")))

    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    print(f"routing comparison, 2 prefill + 2 decode simulated instances, {args.requests} measured requests per run")
    print("\nprefix reuse (8 system prompts x 3,000 tokens, concurrency 16, 1,400 KV blocks per instance):")
    print(f"  {'prefill policy':<16} {'hit rate':>9} {'computed':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ok/failed':>10}")
    for r in results["prefix_reuse"]:
        print(f"  {r['policy'].split()[-1]:<16} {pct(r['hit_rate']):>9} {r['computed_tokens']:>10.0f} "
              f"{r['ttft_p50'] * 1e3:>7.0f}ms {r['ttft_p99'] * 1e3:>7.0f}ms {r['ok']:>6}/{r['failed']}")
    print("\none slow prefill instance (4x), 1,024-token prompts, concurrency 12:")
    print(f"  {'prefill policy':<16} {'slow share':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ok/failed':>10}")
    for r in results["slow_instance"]:
        print(f"  {r['policy'].split()[1]:<16} {pct(r['slow_share']):>10} {r['ttft_p50'] * 1e3:>7.0f}ms "
              f"{r['ttft_p99'] * 1e3:>7.0f}ms {r['ok']:>6}/{r['failed']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
