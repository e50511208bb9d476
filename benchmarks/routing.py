"""What routing costs: one decision per policy with 16 instances, and the prefix index's memory.

    python benchmarks/routing.py [--decisions 20000] [--prompts 100000]

* decision time: `Pool.pick()` (the candidates in rotation, then the policy) for a request whose
  prefix key is already computed, as pdproxy computes it once per request for both pools; p50/p99 over
  `--decisions` calls, 16 instances with random in-flight counts, the best of `--rounds` rounds (other
  load on the machine only ever adds). Target: p99 <= 20 us. Printed beside it, measured in the same
  run: a 16-element list comprehension, this machine's speed for the simplest per-instance loop.
* key time: computing that prefix key (RequestView.prefix) for a 4,000-token-id prompt and for a
  16,000-character text prompt, printed beside it, since a request pays it once.
* index memory: cache_aware's index after `--prompts` distinct 4,000-token prompts routed over the 16
  instances (traced by tracemalloc, default --max-tree-size). Target: <= 64 MB; eviction keeps it there.
* hostile inputs (issue 28): the loop time of the worst a client or an instance can send, beside the
  ordinary case: the prefix key of an 8 MB chat body of 2.7 million empty messages, and load_aware's
  reading of /metrics expositions built to be expensive (at its 2 MiB cap) beside a simulated vLLM's.
  Target: each <= 50 ms of loop (the best of `--rounds`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import timeit
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdproxy.policies import POLICIES, RequestView, create  # noqa: E402
from pdproxy.pool import Pool  # noqa: E402

INSTANCES = 16
TARGET_US, TARGET_MB, TARGET_HOSTILE_MS = 20.0, 64.0, 50.0


def pool_of(policy: str) -> Pool:
    pool = Pool("prefill", [f"http://10.0.0.{i}:8100" for i in range(INSTANCES)], create(policy), eject_after=0)
    if policy == "load_aware":  # fresh readings of every engine, as its background task keeps them
        from pdproxy.policies.load_aware import Reading

        for inst in pool.instances:
            pool.policy.readings[inst.url] = Reading(random.randint(0, 8), random.randint(0, 32), random.random(),
                                                     time.monotonic() + 3600)
    return pool


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def decision_times(policy: str, n: int, rng: random.Random) -> list[float]:
    pool = pool_of(policy)
    prompts = [[rng.randrange(100_000) for _ in range(4000)] for _ in range(64)]
    views = []
    for k in range(n):
        view = RequestView({"prompt": prompts[k % 64][:rng.randrange(1000, 4000)], "user": f"u{k % 500}"},
                           {"X-Session-Id": f"s{k % 500}"})
        view.prefix  # computed once per request, before the pools choose
        views.append(view)
    out = []
    for k, view in enumerate(views):
        for inst in pool.instances:
            inst.inflight = rng.randrange(8)
        t = time.perf_counter_ns()
        pool.pick(view)
        out.append((time.perf_counter_ns() - t) / 1000)
    return out[n // 10:]  # the first tenth warms the caches and the index


def key_times(rng: random.Random, n: int = 300) -> tuple[list[float], list[float]]:
    ids = [rng.randrange(100_000) for _ in range(4000)]
    text = " ".join(f"w{rng.randrange(10_000)}" for _ in range(2700))[:16_000]
    tokens, chars = [], []
    for k in range(n):
        for body, out in (({"prompt": [k] + ids[1:]}, tokens), ({"prompt": f"{k} {text}"}, chars)):
            t = time.perf_counter_ns()
            RequestView(body).prefix
            out.append((time.perf_counter_ns() - t) / 1000)
    return tokens, chars


def index_memory(prompts: int) -> tuple[float, int, int]:
    base = list(range(1000, 5000))  # 4,000 tokens; each prompt differs in its first token: nothing shared
    policy = create("cache_aware")
    pool = Pool("prefill", [f"http://10.0.0.{i}:8100" for i in range(INSTANCES)], policy, eject_after=0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for k in range(prompts):
        base[0] = k
        pool.pick(RequestView({"prompt": base}))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / 2**20, len(policy.index), policy.index.max_entries


def best_ms(work, rounds: int) -> float:
    return min(timeit.repeat(work, number=1, repeat=rounds)) * 1000


def hostile_times(rounds: int) -> list[tuple[str, float, str, float]]:
    """(hostile case, its ms, the ordinary case beside it, its ms)."""
    from pdproxy.policies.load_aware import MAX_METRICS_BYTES, parse_load
    from pdproxy.sim.metrics import SimMetrics

    chat = {"messages": [{"role": "user", "content": "hello " * 2000}] * 4}
    empty = {"messages": [{} for _ in range(2_700_000)]}  # what orjson makes of 8 MB of `{},`
    real = SimMetrics("sim-model").render()
    line = b'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
    alike = b'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 1.0\n'
    cap = MAX_METRICS_BYTES - 1

    def read(raw: bytes):
        def work() -> None:
            try:
                parse_load(raw)
            except ValueError:
                pass  # an unreadable exposition: what the hostile ones are
        return work

    return [
        ("chat key, 2.7M empty messages", best_ms(lambda: RequestView(empty, chat=True).prefix, rounds),
         "4 messages of 12,000 chars", best_ms(lambda: RequestView(chat, chat=True).prefix, rounds)),
        *((f"/metrics, {name} ({len(raw) / 2**20:.1f} MiB)", best_ms(read(raw), rounds),
           f"simulated vLLM ({len(real) // 1024} KiB)", best_ms(read(real), rounds))
          for name, raw in (("waiting samples", line * (cap // len(line))),
                            ("look-alike family", alike * (cap // len(alike))), ("newlines", b"\n" * cap))),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=20_000, help="decisions timed per policy (default 20000)")
    ap.add_argument("--prompts", type=int, default=100_000, help="distinct prompts for the memory figure")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per policy, the best kept (default 3)")
    args = ap.parse_args()
    rng = random.Random(1)
    print(f"routing cost, {INSTANCES} instances, Python {sys.version.split()[0]}")
    print(f"\ndecision (Pool.pick, prefix key computed), over {args.decisions} requests:")
    worst = 0.0
    for name in POLICIES:
        times = min((decision_times(name, args.decisions, rng) for _ in range(args.rounds)),
                    key=lambda t: percentile(t, 0.99))
        p99 = percentile(times, 0.99)
        worst = max(worst, p99)
        print(f"  {name:<16} p50 {statistics.median(times):6.1f} us   p99 {p99:6.1f} us")
    reference = timeit.repeat("[i.inflight for i in instances]", number=10_000, repeat=5,
                              globals={"instances": pool_of("round_robin").instances})
    print(f"  (reference: [i.inflight for i in instances] over 16 instances {min(reference) / 10_000 * 1e6:.2f} us)")
    tokens, chars = key_times(rng)
    print(f"\nprefix key, once per request: 4,000 token ids p50 {statistics.median(tokens):.1f} us "
          f"(p99 {percentile(tokens, 0.99):.1f}); 16,000 chars p50 {statistics.median(chars):.1f} us "
          f"(p99 {percentile(chars, 0.99):.1f})")
    mb, entries, bound = index_memory(args.prompts)
    print(f"\nprefix index after {args.prompts} distinct 4,000-token prompts: {mb:.1f} MB "
          f"({entries} entries, bound {bound})")
    print("\nhostile inputs, loop time per request or per read (best of rounds), beside the ordinary case:")
    hostile = hostile_times(args.rounds)
    for name, ms, ordinary, ordinary_ms in hostile:
        print(f"  {name:<48} {ms:7.2f} ms   {ordinary}: {ordinary_ms:.2f} ms")
    slowest = max(ms for _, ms, _, _ in hostile)
    print(f"\ntargets: decision p99 {worst:.1f} us <= {TARGET_US:g} us: {'yes' if worst <= TARGET_US else 'NO'}; "
          f"index {mb:.1f} MB <= {TARGET_MB:g} MB: {'yes' if mb <= TARGET_MB else 'NO'}; "
          f"hostile input {slowest:.1f} ms <= {TARGET_HOSTILE_MS:g} ms: {'yes' if slowest <= TARGET_HOSTILE_MS else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
