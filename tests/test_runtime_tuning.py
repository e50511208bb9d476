"""Every worker serves with its collector and C allocator tuned (pdproxy/runtime.py): start-up's
objects frozen out of the collector's walks, the young generation collected every 10,000
allocations, and (glibc) freed heap kept for reuse rather than handed back at every large free.
Read from each worker of a real two-worker proxy through `/debug/runtime`."""

import platform

import httpx

from procs import start_proxy, start_sim
from pdproxy.runtime import GC_YOUNG_THRESHOLD


def test_each_worker_serves_tuned():
    sim, sim_url = start_sim("single", "--time-scale", "0.1")
    proxy, url = start_proxy("--decode", sim_url, "--workers", "2", "--debug-endpoints", "--no-tracing",
                             "--health-check-interval", "0")
    try:
        seen: dict[int, dict] = {}
        for _ in range(200):  # new connections: the kernel spreads them over both workers' sockets
            runtime = httpx.get(url + "/debug/runtime", headers={"Connection": "close"}).json()
            seen[runtime["pid"]] = runtime
            if len(seen) == 2:
                break
        assert len(seen) == 2, f"only {list(seen)} answered"
        for pid, runtime in seen.items():
            assert runtime["gc_frozen_objects"] > 10_000, (pid, runtime)  # aiohttp, opentelemetry, numpy...
            assert runtime["gc_thresholds"][0] == GC_YOUNG_THRESHOLD, (pid, runtime)
            if platform.libc_ver()[0] == "glibc":
                assert runtime["malloc_tuned"] is True, (pid, runtime)
    finally:
        proxy.stop()
        sim.stop()
