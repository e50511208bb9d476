"""100 engines per replica (issue 53, item 6): what following 100 discovered vLLM instances' KV events costs one pdproxy.

    python benchmarks/membership_scale.py [--tree LABEL=PATH ...] [--parts events,index]
    (smallest useful run: --seconds 3 --idle 1 --churn 3 --index-blocks 2048 --decisions 200)

1. Event path CPU (`events`). `--instances` engines (half prefill, half decode) publish on vLLM 0.23's wire from
   `--fleets` separate processes (benchmarks/harness/kv_engines.py, payloads encoded before the run: each engine
   `--rate` events/s in `--batches` batches/s, one 16-token block per event, 36 % BlockRemoved once its cache is
   full, as one real engine under load). A real `pdproxy serve` discovers them from a watched instances file (as an
   operator would), subscribes to every engine and rebuilds each index from its replay socket; then the engines
   publish. Printed per tree (pure, compiled...): the proxy process's own CPU (/proc/PID/stat, its threads
   included: ZMQ's I/O thread too) idle (subscribed, engines silent) and busy, the event path's share of a core
   per 100k events/s, events sent and applied (none may be lost), /health round trips meanwhile, RSS; beside them
   the machine's load and what the publishers used. Then `--churn` seconds of 10 membership changes a second
   through the admin API while the engines go on publishing (spare engines' instances added, each rebuilt from
   its replay buffer, and removed), each change timed to its reconcile.
2. Index memory and routing decisions (`index`), in a child process on the tree: `--instances` indexes of
   `--index-blocks` blocks each (resident memory before and after), then precise_prefix's decision among all of
   them for 4,000-token prompts (CPU time p50 / p99, best of three rounds), beside round_robin's for the same
   requests: the typical case (a prefix held where it was routed) and the worst (every instance holds the prompt).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import threading
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
from harness import stats  # noqa: E402

ENGINES = HERE / "harness" / "kv_engines.py"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


class Fleet:
    """One kv_engines.py process."""

    def __init__(self, count: int, rate: float, batches: float, seconds: float, capacity: int, seed: int) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, str(ENGINES), "--count", str(count), "--rate", str(rate), "--batches", str(batches),
             "--seconds", str(seconds), "--capacity", str(capacity), "--seed", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError("kv_engines.py did not start")
        self.engines: list[dict[str, str]] = json.loads(line)["engines"]

    def go(self) -> None:
        self.popen.stdin.write("go\n")
        self.popen.stdin.flush()

    def result(self) -> dict:
        return json.loads(self.popen.stdout.readline())

    def stop(self) -> None:
        try:
            self.popen.stdin.write("stop\n")
            self.popen.stdin.flush()
            self.popen.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.popen.kill()
            self.popen.wait()

    def cpu(self) -> float:
        return stats.cpu_seconds([self.popen.pid])


def instances_file(path: Path, engines: list[dict[str, str]]) -> list[str]:
    """Half prefill, half decode; each instance's URL a distinct port (nothing listens: health checks are off)."""
    roles: dict[str, list[dict]] = {"prefill": [], "decode": []}
    addresses = []
    for k, engine in enumerate(engines):
        role = "prefill" if k < len(engines) // 2 else "decode"
        address = f"127.0.0.1:{20000 + k}"
        addresses.append(address)
        roles[role].append({"url": f"http://{address}", "kv_events_endpoint": engine["pub"],
                            "kv_events_replay_endpoint": engine["replay"]})
    path.write_text(json.dumps(roles))
    return addresses


def kv_status(url: str) -> dict[str, dict]:
    return get_json(url + "/status")["kv_events"]


def wait_for(predicate, what: str, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.2)
    raise TimeoutError(f"{what} after {timeout:.0f} s")


def event_path(tree: str, args: argparse.Namespace) -> dict:
    per_fleet = -(-args.instances // args.fleets)
    warm = 2.0
    fleets = []
    out: dict = {}
    with tempfile.TemporaryDirectory() as d, harness.Procs() as procs:
        try:
            for f in range(args.fleets):
                count = min(per_fleet, args.instances - f * per_fleet)
                fleets.append(Fleet(count, args.rate, args.batches, warm + args.seconds + args.churn + 3, args.capacity,
                                    f + 1))
            spares = Fleet(args.churn_spares, args.rate, args.batches, warm + args.seconds + args.churn + 3,
                           args.capacity, 99) if args.churn else None
            engines = [e for fleet in fleets for e in fleet.engines]
            path = Path(d) / "instances.json"
            addresses = instances_file(path, engines)
            started = time.monotonic()
            proxy = procs.pdproxy(
                "serve", "--vllm-pd-disaggregation", "--instances-file", str(path), "--instances-file-interval",
                "0.2", "--health-check-interval", "0", "--policy", "precise_prefix", "--load-metrics-interval",
                "3600", "--no-tracing", "--log-level", os.environ.get("SCALE_LOG_LEVEL", "warning"),
                env={"PYTHONPATH": tree}, cwd=tree, log=Path(os.environ.get("SCALE_LOG_DIR", d)) / "proxy.log")
            wait_for(lambda: sum(s["flowing"] for s in kv_status(proxy.url).values()) == len(addresses),
                     "every instance flowing", 120)
            out["discovered_s"] = time.monotonic() - started
            compiled = get_json(proxy.url + "/status").get("compiled", {}).get("form")
            out["form"] = compiled
            # idle: subscribed, engines silent (each answers a replay probe every 2 s)
            time.sleep(1.0)
            c0, w0, m0 = proxy.cpu_seconds(), time.monotonic(), stats.machine_busy()
            time.sleep(args.idle)
            out["idle_core"] = (proxy.cpu_seconds() - c0) / (time.monotonic() - w0)
            for fleet in (*fleets, *([spares] if spares else [])):
                fleet.go()
            time.sleep(warm)
            before = sum(s["events"] for s in kv_status(proxy.url).values())
            f0 = sum(fl.cpu() for fl in fleets)
            c0, w0, m0 = proxy.cpu_seconds(), time.monotonic(), stats.machine_busy()
            health = []  # /health round trips meanwhile: what the event path makes other requests wait
            while time.monotonic() - w0 < args.seconds:
                asked = time.monotonic()
                with urllib.request.urlopen(proxy.url + "/health", timeout=30) as r:
                    r.read()
                health.append(time.monotonic() - asked)
                time.sleep(max(0.0, asked + 0.05 - time.monotonic()))
            c1, w1, m1 = proxy.cpu_seconds(), time.monotonic(), stats.machine_busy()
            after = sum(s["events"] for s in kv_status(proxy.url).values())
            f1 = sum(fl.cpu() for fl in fleets)
            if spares is not None:
                out["churn"] = churn(proxy.url, spares.engines, args.churn)
            wall = w1 - w0
            out["busy_core"] = (c1 - c0) / wall
            out["events_per_s"] = (after - before) / wall
            out["machine_core"] = (m1[0] - m0[0]) / stats.CLK_TCK / wall
            out["fleets_core"] = (f1 - f0) / wall
            out["health_ms"] = (pct(health, 50), pct(health, 99), max(health) * 1000)
            sent = [fleet.result() for fleet in fleets]
            if spares is not None:
                spares.result()
            out["sent"] = sum(s["sent_events"] for s in sent)
            out["dropped"] = sum(s["dropped_batches"] for s in sent)
            out["late"] = sum(s["late_batches"] for s in sent)
            try:
                wait_for(lambda: sum(s["events"] for s in kv_status(proxy.url).values()) >= out["sent"],
                         "every event applied", 30)
            except TimeoutError:
                pass
            status = kv_status(proxy.url)
            out["applied"] = sum(s["events"] for s in status.values())
            out["gaps"] = sum(s["gaps"] for s in status.values())
            out["flowing"] = sum(s["flowing"] for s in status.values())
            out["blocks"] = sum(s["blocks"] for s in status.values())
            out["rss_mib"] = proxy.memory_mb("VmRSS") * 1e6 / 2**20
        finally:
            for fleet in (*fleets, *([spares] if spares else [])):
                fleet.stop()
    return out


def churn(url: str, engines: list[dict[str, str]], seconds: float, rate: float = 10.0) -> dict:
    """`rate` membership changes a second through the admin API for `seconds`, while every engine publishes:
    spare engines' instances added (each one's events rebuilt from its replay buffer, then followed) and removed
    in turn. Timed per change: the admin API's answer (it answers once the reconciler applied it: in or out of
    the pools), and, from /status polled 10 times a second, the added instance's events flowing and the removed
    one gone with its subscription."""
    import httpx

    members = [{"url": f"http://127.0.0.1:{21000 + k}", "worker_type": "decode" if k % 2 else "prefill",
                "kv_events_endpoint": e["pub"], "kv_events_replay_endpoint": e["replay"]} for k, e in enumerate(engines)]
    pending: dict[str, tuple[str, float]] = {}  # address -> (what, when asked)
    times: dict[str, list[float]] = {"add answered": [], "remove answered": [], "add -> flowing": [],
                                     "remove -> gone": []}
    missed = {"add": 0, "remove": 0}  # not seen done before the same instance's next change
    inside: set[int] = set()
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def poll() -> None:
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < stop + 5 and (time.monotonic() < stop or pending):
                status = client.get(url + "/status").json()
                seen = time.monotonic()
                kv = status.get("kv_events") or {}
                pooled = {i["url"] for v in status["instances"].values() for i in v}
                with lock:
                    for address, (what, asked) in list(pending.items()):
                        if what == "add" and kv.get(address, {}).get("flowing"):
                            times["add -> flowing"].append(seen - asked)
                            del pending[address]
                        elif what == "remove" and address not in kv and f"http://{address}" not in pooled:
                            times["remove -> gone"].append(seen - asked)
                            del pending[address]
                time.sleep(0.2)

    poller = threading.Thread(target=poll)
    poller.start()
    local = threading.local()

    def change(k: int, what: str) -> None:
        """One admin change, on its own connection (changes are issued on time, not after the previous answer)."""
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(timeout=30)
        member, address = members[k], members[k]["url"].removeprefix("http://")
        asked = time.monotonic()
        with lock:
            if address in pending:
                missed[pending[address][0]] += 1
            pending[address] = (what, asked)
        if what == "remove":
            r = client.delete(url + "/workers/" + quote(member["url"], safe=""))
        else:
            r = client.post(url + "/workers", json=member)
        with lock:
            times[f"{what} answered"].append(time.monotonic() - asked)
            if r.status_code != 200:
                errors.append(f"{what} {address}: {r.status_code} {r.text[:200]}")

    errors: list[str] = []
    n = 0
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        while time.monotonic() < stop:
            k = n % len(members)
            what = "remove" if k in inside else "add"
            (inside.discard if what == "remove" else inside.add)(k)
            pool.submit(change, k, what)
            n += 1
            time.sleep(max(0.0, started + n / rate - time.monotonic()))
    poller.join()
    with httpx.Client(timeout=30) as client:
        for k in list(inside):
            client.delete(url + "/workers/" + quote(members[k]["url"], safe=""))
    return {"changes": n, "seconds": seconds, "unseen": len(pending), "missed": missed, "times": times,
            "errors": errors}


# Runs in a child process with the tree under test first on sys.path (pure or compiled): the index's memory at
# `blocks` per instance, then precise_prefix's decisions over the instances. Prints one JSON line.
INDEX_AND_DECISIONS = r"""
import gc, json, os, random, statistics, sys, time
instances, blocks, decisions = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
from pdproxy import compiled, policies
from pdproxy.kvevents.decode import BlockStored
from pdproxy.kvevents.subscriber import Source, Subscription
from pdproxy.policies.request import RequestView
from pdproxy.pool import Instance
from pdproxy.routing.tokens import given
from pdproxy.runtime import tune_gc

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

class Events:  # what precise_prefix reads: KVEvents.get
    def __init__(self, subs):
        self.subs = subs
    def get(self, address):
        return self.subs.get(address)

tune_gc()
rng = random.Random(7)
pool = [Instance(f"http://10.0.{k // 250}.{k % 250}:8000", "prefill") for k in range(instances)]
subs = {}
for inst in pool:  # a subscription in step (flowing), as the pump leaves it; no replay endpoint: no probe age
    sub = Subscription(Source(inst.address, "tcp://127.0.0.1:1"), 1 << 20, 2.0, 2.0)
    sub.connected, sub._resync, sub.next_seq = True, False, 0
    subs[inst.address] = sub
# 1. memory: every index filled as an engine fills it, chains of 16 single-block stores (decode generation)
before, start = rss(), time.process_time()
for inst in pool:
    index = subs[inst.address].index
    base, parent, events = rng.getrandbits(63), None, []
    for b in range(blocks):
        h = (base + b * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
        first = rng.randrange(128_000 - 16)
        events.append(BlockStored([h], parent, list(range(first, first + 16)), 16, "GPU"))
        parent = None if b % 16 == 15 else h
        if len(events) == 30:
            index.apply_all(events)
            events = []
    index.apply_all(events)
built = time.process_time() - start
gc.collect()
used = rss() - before
held = sum(len(s.index) for s in subs.values())

# 2. decisions: 4,000-token prompts; 8 shared prefixes of 2,000 tokens, each held by 3 instances (the typical
# case: a prefix lives where it was routed), and the worst case: every instance holds the whole prompt
def store_prompt(index, tokens):
    engine = [rng.getrandbits(63) for _ in range(len(tokens) // 16)]
    index.apply_all([BlockStored(engine, None, tokens, 16, "GPU")])

prefixes = [[rng.randrange(128_000) for _ in range(2000)] for _ in range(8)]
for p, prefix in enumerate(prefixes):
    for j in range(3):
        store_prompt(subs[pool[(p * 12 + j * 4) % instances].address].index, prefix)
worst_prompt = [rng.randrange(128_000) for _ in range(4000)]

def timed(policy, prompts, n):
    times = []
    for k in range(n):
        body = {"model": "m", "prompt": prompts[k % len(prompts)]}
        start = time.thread_time()  # CPU time: what the decision costs, not what the machine's other load adds
        view = RequestView(body)
        given(view)  # what the router does first: a token-id prompt's ids
        chosen, decision = policy.choose(pool, view)
        times.append(time.thread_time() - start)
    times.sort()
    return {"p50_us": statistics.median(times) * 1e6, "p99_us": times[int(len(times) * 0.99)] * 1e6,
            "reason": decision.reason}

precise = policies.create("precise_prefix")
precise.use_events(Events(subs))
typical = [prefix + [rng.randrange(128_000) for _ in range(2000)] for prefix in prefixes for _ in range(4)]
out = {"form": compiled.report()["modules"].get("pdproxy.kvevents.index"),
       "policy_form": compiled.report()["modules"].get("pdproxy.policies.precise_prefix"),
       "instances": instances, "blocks": held, "bytes": used, "build_us_per_block": built / (instances * blocks) * 1e6}
best = {}
for _ in range(3):  # the best of three rounds: other load on the machine only ever adds
    for label, policy, prompts in (("round_robin", policies.create("round_robin"), typical),
                                   ("precise_typical", precise, typical)):
        r = timed(policy, prompts, decisions)
        if label not in best or r["p99_us"] < best[label]["p99_us"]:
            best[label] = r
for inst in pool:
    store_prompt(subs[inst.address].index, worst_prompt)
for _ in range(3):
    r = timed(precise, [worst_prompt], max(50, decisions // 4))
    if "precise_worst" not in best or r["p99_us"] < best["precise_worst"]["p99_us"]:
        best["precise_worst"] = r
out.update(best)
print(json.dumps(out))
"""


def index_and_decisions(tree: str, args: argparse.Namespace) -> dict:
    child = harness.python_in(tree, ["-c", INDEX_AND_DECISIONS, str(args.instances), str(args.index_blocks),
                                     str(args.decisions)])
    if child.returncode != 0:
        raise RuntimeError(child.stderr[-3000:])
    return json.loads(child.stdout.strip().splitlines()[-1])


def pct(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=100)
    parser.add_argument("--fleets", type=int, default=4, help="publisher processes")
    parser.add_argument("--rate", type=float, default=1100.0, help="events/s per engine")
    parser.add_argument("--batches", type=float, default=37.0, help="batches/s per engine")
    parser.add_argument("--capacity", type=int, default=2048, help="blocks an engine holds before it removes")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--idle", type=float, default=5.0)
    parser.add_argument("--index-blocks", type=int, default=65_536, help="blocks per instance for the index's "
                        "memory (65,536: 1M tokens, an 80 GB GPU's KV cache for an 8B model)")
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--churn", type=float, default=10.0, help="seconds of 10 membership changes a second, "
                        "after the CPU window, while the engines publish (0: none)")
    parser.add_argument("--churn-spares", type=int, default=20, help="engines whose instances churn (each "
                        "added or removed every spares / 10 seconds)")
    parser.add_argument("--parts", default="events,index", help="events, index (index memory and decisions)")
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH: a pdproxy tree to measure "
                        "(default: this one)")
    args = parser.parse_args()
    trees = [t.split("=", 1) for t in args.tree] or [["this tree", str(harness.REPO)]]
    print(f"pdproxy, {args.instances} engines per replica ({harness.machine()}; load {os.getloadavg()[0]:.1f})")
    print(f"each engine: {args.rate:,.0f} events/s in {args.batches:g} batches/s; {args.fleets} publisher processes")
    parts = set(args.parts.split(","))
    rows: dict[str, dict[str, str]] = {}
    for label, tree in trees:
        row = rows[label] = {}
        if "index" in parts:
            d = index_and_decisions(tree, args)
            row["index memory (MiB)"] = f"{d['bytes'] / 2**20:.0f}"
            row["precise decision added at p99 (ms)"] = (
                f"{(d['precise_typical']['p99_us'] - d['round_robin']['p99_us']) / 1000:.2f}")
            row["worst-case decision p99 (ms)"] = f"{d['precise_worst']['p99_us'] / 1000:.2f}"
            rr, typ, worst = d["round_robin"], d["precise_typical"], d["precise_worst"]
            print(f"[{label}: index {d['form']}, policy {d['policy_form']}] index of {d['instances']} instances x "
                  f"{args.index_blocks:,} blocks ({d['blocks']:,} held): {d['bytes'] / 2**20:.0f} MiB, "
                  f"{d['bytes'] / d['blocks']:.0f} bytes a block (built at {d['build_us_per_block']:.2f} us a block); "
                  f"decision over {d['instances']} instances, 4,000-token prompts, p50 / p99 us: round_robin "
                  f"{rr['p50_us']:.0f} / {rr['p99_us']:.0f}, precise_prefix {typ['p50_us']:.0f} / {typ['p99_us']:.0f} "
                  f"({typ['reason']}; added at p99: {(typ['p99_us'] - rr['p99_us']) / 1000:.2f} ms), worst case (every "
                  f"instance holds the whole prompt) {worst['p50_us']:.0f} / {worst['p99_us']:.0f}")
        if "events" not in parts:
            continue
        r = event_path(tree, args)
        net = r["busy_core"] - r["idle_core"]
        row["event path (cores per 100k events/s)"] = f"{net / (r['events_per_s'] / 1e5):.2f}"
        row["/health p99 meanwhile (ms)"] = f"{r['health_ms'][1]:.0f}"
        print(f"[{label}: {r['form']}] discovered and flowing in {r['discovered_s']:.1f} s; CPU idle "
              f"{r['idle_core'] * 100:.1f} %, busy {r['busy_core'] * 100:.1f} % of a core at "
              f"{r['events_per_s']:,.0f} events/s: event path {net * 100:.1f} % -> "
              f"{net * 100 / (r['events_per_s'] / 1e5):.1f} % of a core per 100k events/s; "
              f"sent {r['sent']:,}, applied {r['applied']:,}, gaps {r['gaps']}, flowing {r['flowing']}, "
              f"dropped {r['dropped']}, late {r['late']}; /health p50 / p99 / max {r['health_ms'][0]:.1f} / "
              f"{r['health_ms'][1]:.1f} / {r['health_ms'][2]:.1f} ms; RSS {r['rss_mib']:.0f} MiB; machine {r['machine_core']:.2f} cores busy, "
              f"publishers {r['fleets_core'] * 100:.1f} %")
        if "churn" in r:
            c = r["churn"]
            print(f"   churn while the engines publish: {c['changes']} admin changes in {c['seconds']:.0f} s "
                  f"({c['changes'] / c['seconds']:.1f}/s; /status read 5 times a second), not seen done before the "
                  f"instance's next change {c['missed']}, by the end {c['unseen']}, errors {c['errors'][:2]}; "
                  f"p50 / p99 / max ms: " +
                  "; ".join(f"{k} {pct(v, 50):.0f} / {pct(v, 99):.0f} / {max(v, default=0) * 1000:.0f}"
                            for k, v in c["times"].items()))
            row["churn: changes/s done"] = f"{c['changes'] / c['seconds']:.1f}"
            row["churn: add -> flowing p99 (ms)"] = f"{pct(c['times']['add -> flowing'], 99):.0f}"
            row["churn: remove -> gone p99 (ms)"] = f"{pct(c['times']['remove -> gone'], 99):.0f}"
    budget = {"event path (cores per 100k events/s)": "0.25", "index memory (MiB)": "1024",
              "precise decision added at p99 (ms)": "1", "churn: changes/s done": "10",
              "churn: add -> flowing p99 (ms)": "1000", "churn: remove -> gone p99 (ms)": "1000"}
    keys = list(dict.fromkeys(k for row in rows.values() for k in row))
    if keys:
        print()
        print(f"{'':<40}" + "".join(f"{label[:16]:>18}" for label in rows) + f"{'budget':>10}")
        for key in keys:
            print(f"{key:<40}" + "".join(f"{row.get(key, '-'):>18}" for row in rows.values())
                  + f"{budget.get(key, ''):>10}")


if __name__ == "__main__":
    main()
