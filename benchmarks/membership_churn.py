"""Churn soak (issue 53, item 5): instances with KV-event endpoints added and removed 1,000 times against a running
proxy, through the admin API and the watched file; nothing may grow, and each change is timed to its reconcile.

    python benchmarks/membership_churn.py [--cycles 1000] [--file-cycles 100] [--concurrency 4]

Engines: `--engines` simulated vLLM publishers (benchmarks/harness/kv_engines.py, silent, answering replays) whose
endpoints every added instance names, so each addition really subscribes (SUB socket and its monitor, the replay
socket, an index rebuilt from replay) and each removal really closes them. Every cycle uses a new instance URL, so
per-instance metric series come and go (`--instance-series-retention 1`). The proxy runs with `--debug-endpoints`.

A cycle: add (admin `POST /workers`, or the instance written into the file), wait until /status shows its KV events
flowing (every fourth admin cycle does not wait: its subscription is cancelled while it connects or rebuilds), remove (`DELETE /workers/{url}`, or the file rewritten without it), wait until /status no longer lists it
nor its subscription. `--concurrency` cycles run at once, each on its own URLs.

Printed side by side, before (after a warm-up, once the process made its KV-event machinery) and after (once the
last removal's series retention passed): asyncio tasks, open file descriptors and sockets (/debug/runtime), KV-event
subscriptions (/status), per-instance metric series and all series (/metrics), resident memory; then the time from
each change to its reconcile, p50 / p99: the admin API's answer (it answers once the reconciler applied the change),
the subscription flowing, the instance gone; and for the file, from the write to the same states. Exit status 1 if
anything grew.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

ENGINES = HERE / "harness" / "kv_engines.py"
RETENTION = 1.0  # --instance-series-retention: a departed instance's series go after this


def start_engines(count: int) -> tuple[subprocess.Popen, list[dict[str, str]]]:
    popen = subprocess.Popen([sys.executable, str(ENGINES), "--count", str(count), "--rate", "0"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = popen.stdout.readline()
    if not line:
        raise RuntimeError("kv_engines.py did not start")
    return popen, json.loads(line)["engines"]


def stop_engines(popen: subprocess.Popen) -> None:
    try:
        popen.stdin.write("stop\n")
        popen.stdin.flush()
        popen.wait(10)
    except (OSError, subprocess.TimeoutExpired):
        popen.kill()
        popen.wait()


def series(text: str) -> tuple[int, int]:
    """(all series, series naming one instance) in an exposition."""
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return len(lines), sum(("server_address=" in line or 'instance="' in line) for line in lines)


def snapshot(client: httpx.Client, url: str) -> dict[str, float]:
    runtime = client.get(url + "/debug/runtime").json()
    status = client.get(url + "/status").json()
    total, per_instance = series(client.get(url + "/metrics").text)
    return {"tasks": runtime["tasks"], "open_fds": runtime["open_fds"], "sockets": runtime["sockets"],
            "kv_subscriptions": len(status.get("kv_events") or {}),
            "instances": sum(len(v) for v in status["instances"].values()),
            "instance_series": per_instance, "series": total, "rss_mib": runtime["rss_bytes"] / 2**20}


def wait(predicate, what: str, timeout: float = 30.0, step: float = 0.005) -> float:
    """Seconds until `predicate()` held (polled every `step`); TimeoutError after `timeout`."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise TimeoutError(what)
        time.sleep(step)


class Churn:
    def __init__(self, url: str, engines: list[dict[str, str]], file: Path | None) -> None:
        self.url, self.engines, self.file = url, engines, file
        self.times: dict[str, list[float]] = {}
        self.file_members: dict[str, dict] = {}
        self.file_lock = threading.Lock()
        self.errors: list[str] = []

    def record(self, what: str, seconds: float) -> None:
        self.times.setdefault(what, []).append(seconds)

    def gone(self, client: httpx.Client, address: str) -> bool:
        status = client.get(self.url + "/status").json()
        pooled = any(i["url"] == f"http://{address}" for v in status["instances"].values() for i in v)
        return not pooled and address not in (status.get("kv_events") or {})

    def flowing(self, client: httpx.Client, address: str) -> bool:
        kv = (client.get(self.url + "/status").json().get("kv_events") or {}).get(address)
        return bool(kv and kv["flowing"])

    def admin_cycle(self, client: httpx.Client, n: int) -> None:
        engine = self.engines[n % len(self.engines)]
        address = f"127.0.0.1:{20000 + n}"
        member = {"url": f"http://{address}", "worker_type": "decode" if n % 2 else "prefill",
                  "kv_events_endpoint": engine["pub"], "kv_events_replay_endpoint": engine["replay"]}
        start = time.monotonic()
        r = client.post(self.url + "/workers", json=member)
        if r.status_code != 200:
            self.errors.append(f"add {address}: {r.status_code} {r.text[:200]}")
            return
        self.record("admin add answered", time.monotonic() - start)
        if n % 4 != 3:  # (every fourth is removed at once: its subscription cancelled while it connects, rebuilds)
            wait(lambda: self.flowing(client, address), f"{address} flowing")
            self.record("admin add -> flowing", time.monotonic() - start)
        start = time.monotonic()
        r = client.delete(self.url + "/workers/" + quote(member["url"], safe=""))
        if r.status_code != 200:
            self.errors.append(f"remove {address}: {r.status_code} {r.text[:200]}")
            return
        self.record("admin remove answered", time.monotonic() - start)
        wait(lambda: self.gone(client, address), f"{address} gone")
        self.record("admin remove -> gone", time.monotonic() - start)

    def write_file(self) -> None:
        assert self.file is not None
        roles: dict[str, list[dict]] = {"prefill": [], "decode": []}
        for member in self.file_members.values():
            roles[member["role"]].append({k: v for k, v in member.items() if k != "role"})
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(roles))
        os.replace(tmp, self.file)  # an atomic rename, as a ConfigMap update

    def file_cycle(self, client: httpx.Client, n: int) -> None:
        engine = self.engines[n % len(self.engines)]
        address = f"127.0.0.1:{40000 + n}"
        with self.file_lock:
            self.file_members[address] = {"url": f"http://{address}", "role": "decode" if n % 2 else "prefill",
                                          "kv_events_endpoint": engine["pub"],
                                          "kv_events_replay_endpoint": engine["replay"]}
            start = time.monotonic()
            self.write_file()
        wait(lambda: self.flowing(client, address), f"{address} flowing")
        self.record("file add -> flowing", time.monotonic() - start)
        with self.file_lock:
            del self.file_members[address]
            start = time.monotonic()
            self.write_file()
        wait(lambda: self.gone(client, address), f"{address} gone")
        self.record("file remove -> gone", time.monotonic() - start)

    def held(self, client: httpx.Client, count: int) -> dict[str, float]:
        """The snapshot while `count` instances are in, all flowing (then removed)."""
        members = []
        for k in range(count):
            engine = self.engines[k % len(self.engines)]
            members.append({"url": f"http://127.0.0.1:{19000 + k}", "worker_type": "decode",
                            "kv_events_endpoint": engine["pub"], "kv_events_replay_endpoint": engine["replay"]})
            client.post(self.url + "/workers", json=members[-1]).raise_for_status()
        for m in members:
            wait(lambda: self.flowing(client, m["url"].removeprefix("http://")), "flowing")
        out = snapshot(client, self.url)
        for m in members:
            client.delete(self.url + "/workers/" + quote(m["url"], safe="")).raise_for_status()
        return out

    def run(self, kind: str, cycles: int, concurrency: int, first: int = 0) -> None:
        def worker(k: int) -> None:
            with httpx.Client(timeout=30) as client:
                for n in range(first + k, first + cycles, concurrency):
                    try:
                        (self.admin_cycle if kind == "admin" else self.file_cycle)(client, n)
                    except Exception as exc:  # counted, reported: a soak goes on
                        self.errors.append(f"cycle {n}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def settle(client: httpx.Client, url: str, baseline: dict[str, float], timeout: float = 30.0) -> dict[str, float]:
    """The snapshot once every departed instance's series retention passed and the counts came back (or the
    timeout: then what is left is reported)."""
    deadline = time.monotonic() + timeout
    time.sleep(RETENTION + 0.5)
    while True:
        now = snapshot(client, url)
        if all(now[k] <= baseline[k] for k in LEAK_KEYS) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


LEAK_KEYS = ("tasks", "open_fds", "sockets", "kv_subscriptions", "instances", "instance_series", "series")


def percentiles(samples: list[float]) -> str:
    if not samples:
        return "-"
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"{statistics.median(ordered) * 1000:.0f} / {p99 * 1000:.0f} ms (n={len(ordered)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=1000, help="admin API add/remove cycles")
    parser.add_argument("--file-cycles", type=int, default=100, help="watched-file add/remove cycles")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--tree", default=str(harness.REPO), help="the pdproxy tree to run (default: this one)")
    args = parser.parse_args()
    print(f"pdproxy membership churn ({harness.machine()}; load {os.getloadavg()[0]:.1f}); {args.cycles} admin "
          f"cycles + {args.file_cycles} file cycles, {args.concurrency} at once, {args.engines} engines")
    engines_proc, engines = start_engines(args.engines)
    try:
        with tempfile.TemporaryDirectory() as d, harness.Procs() as procs, httpx.Client(timeout=30) as client:
            path = Path(d) / "instances.json"
            path.write_text(json.dumps({"prefill": [], "decode": []}))
            proxy = procs.pdproxy(
                "serve", "--vllm-pd-disaggregation", "--instances-file", str(path), "--instances-file-interval", "0.1",
                "--health-check-interval", "0", "--policy", "precise_prefix", "--instance-series-retention",
                str(RETENTION), "--debug-endpoints", "--no-tracing", "--log-level", "warning", env={"PYTHONPATH": args.tree},
                cwd=args.tree, ready="/status", log=Path(d) / "proxy.log")
            churn = Churn(proxy.url, engines, path)
            churn.run("admin", args.warmup, 1, first=9000)  # the KV-event machinery made once, as it stays
            churn.run("file", 2, 1, first=9000)
            churn.times.clear()
            before = settle(client, proxy.url, snapshot(client, proxy.url))
            during = churn.held(client, 10)  # what 10 instances hold: the check below has something to find
            started = time.monotonic()
            churn.run("admin", args.cycles, args.concurrency)
            admin_s = time.monotonic() - started
            started = time.monotonic()
            churn.run("file", args.file_cycles, min(args.concurrency, 2))
            file_s = time.monotonic() - started
            after = settle(client, proxy.url, before)
            print(f"{args.cycles} admin cycles in {admin_s:.0f} s, {args.file_cycles} file cycles in {file_s:.0f} s; "
                  f"errors {len(churn.errors)}" + (f": {churn.errors[:3]}" if churn.errors else ""))
            print(f"{'':>22} {'before':>10} {'10 in':>10} {'after':>10}")
            for key in (*LEAK_KEYS, "rss_mib"):
                grew = key in LEAK_KEYS and after[key] > before[key]
                print(f"{key:>22} {before[key]:>10.0f} {during[key]:>10.0f} {after[key]:>10.0f}"
                      f"{'   GREW' if grew else ''}")
            print("change -> reconciled, p50 / p99:")
            for what, samples in churn.times.items():
                print(f"  {what:<24} {percentiles(samples)}")
            leaked = [k for k in LEAK_KEYS if after[k] > before[k]]
            if leaked or churn.errors:
                print(f"FAILED: grew {leaked}, errors {len(churn.errors)}; proxy log tail:\n{proxy.output()[-1500:]}")
                sys.exit(1)
            print("nothing grew")
    finally:
        stop_engines(engines_proc)


if __name__ == "__main__":
    main()
