"""Churn leaves nothing behind (issue 53, item 5; the soak is benchmarks/membership_churn.py, 1,000 cycles): instances
with KV-event endpoints added and removed 50 times through the admin API (some removed while their subscription
still connects) and a few times through the watched file; afterwards the proxy holds the same asyncio tasks, file
descriptors, sockets, KV-event subscriptions and metric series as before (each cycle used a new instance URL, so
its per-instance series came and went)."""

import json
import os
import threading
import time
from urllib.parse import quote

import httpx

from kv_publisher import PublisherProcess
from procs import FILES, HOST, free_port, pdproxy
from waits import scaled, wait_until

CYCLES, FILE_CYCLES, AT_ONCE = 50, 4, 2
LEAKS = ("tasks", "open_fds", "sockets", "kv_subscriptions", "instances", "instance_series")


def snapshot(client, url):
    runtime = client.get(url + "/debug/runtime").json()
    status = client.get(url + "/status").json()
    lines = [line for line in client.get(url + "/metrics").text.splitlines() if line and not line.startswith("#")]
    return {"tasks": runtime["tasks"], "open_fds": runtime["open_fds"], "sockets": runtime["sockets"],
            "kv_subscriptions": len(status.get("kv_events") or {}),
            "instances": sum(len(v) for v in status["instances"].values()),
            "instance_series": sum("server_address=" in line or 'instance="' in line for line in lines)}


def flowing(client, url, address):
    kv = (client.get(url + "/status").json().get("kv_events") or {}).get(address)
    return bool(kv and kv["flowing"])


def gone(client, url, address):
    status = client.get(url + "/status").json()
    return address not in (status.get("kv_events") or {}) and not any(
        i["url"] == f"http://{address}" for v in status["instances"].values() for i in v)


def test_instances_added_and_removed_many_times_leave_nothing_behind():
    engines = []
    proxy = None
    try:
        for _ in range(2):
            pub, replay = free_port(), free_port()
            engines.append((PublisherProcess(pub, replay), f"tcp://{HOST}:{pub}", f"tcp://{HOST}:{replay}"))
        path = FILES.scratch("churn") / "instances.json"
        path.write_text(json.dumps({"prefill": [], "decode": []}))
        port = free_port()
        proxy = pdproxy("serve", "--host", HOST, "--port", str(port), "--vllm-pd-disaggregation", "--instances-file",
                        str(path), "--instances-file-interval", "0.1", "--health-check-interval", "0", "--policy",
                        "precise_prefix", "--instance-series-retention", "0.5", "--debug-endpoints", "--no-tracing",
                        name="serve")
        url = f"http://{HOST}:{port}"
        proxy.wait_http(url + "/status")  # (/health says 503 while no instance is in)
        errors = []

        def member(n):
            _, pub, replay = engines[n % len(engines)]
            return {"url": f"http://{HOST}:{21000 + n}", "worker_type": "decode" if n % 2 else "prefill",
                    "kv_events_endpoint": pub, "kv_events_replay_endpoint": replay}

        def admin_cycles(first, count, step):
            with httpx.Client(timeout=30) as client:
                for n in range(first, count, step):
                    m = member(n)
                    address = m["url"].removeprefix("http://")
                    try:
                        assert client.post(url + "/workers", json=m).status_code == 200
                        if n % 4 != 3:  # every fourth removed at once, its subscription still connecting
                            wait_until(lambda: flowing(client, url, address), f"{address} flowing")
                        assert client.delete(url + "/workers/" + quote(m["url"], safe="")).status_code == 200
                        wait_until(lambda: gone(client, url, address), f"{address} gone")
                    except Exception as exc:
                        errors.append(f"{address}: {exc!r}")

        def file_cycle(client, n):
            m = member(n)
            address = m["url"].removeprefix("http://")
            for listed in ([{k: v for k, v in m.items() if k != "worker_type"}], []):
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"prefill": [], "decode": listed}))
                os.replace(tmp, path)
                if listed:
                    wait_until(lambda: flowing(client, url, address), f"{address} flowing (file)")
                else:
                    wait_until(lambda: gone(client, url, address), f"{address} gone (file)")

        with httpx.Client(timeout=30) as client:
            admin_cycles(900, 902, 1)  # the process makes its KV-event machinery once, and keeps it
            file_cycle(client, 950)
            time.sleep(scaled(1.0))  # the warm-up's series retention
            before = snapshot(client, url)
            started = time.monotonic()
            threads = [threading.Thread(target=admin_cycles, args=(k, CYCLES, AT_ONCE)) for k in range(AT_ONCE)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for n in range(FILE_CYCLES):
                file_cycle(client, 960 + n)
            took = time.monotonic() - started
            assert not errors, errors[:3]
            after = {}

            def settled():
                after.update(snapshot(client, url))
                return all(after[k] <= before[k] for k in LEAKS)

            try:
                wait_until(settled, "the counts back where they were")
            except AssertionError:
                raise AssertionError(f"grew after {CYCLES} + {FILE_CYCLES} cycles: before {before}, after {after}") \
                    from None
            assert after["kv_subscriptions"] == after["instances"] == 0
        print(f"{CYCLES} admin + {FILE_CYCLES} file cycles in {took:.1f} s; before {before}, after {after}")
    finally:
        if proxy is not None:
            proxy.stop()
        for publisher, _, _ in engines:
            publisher.stop()
