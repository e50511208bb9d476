"""What a worker process holds: `GET /debug/runtime` (only with --debug-endpoints), for leak checks;
and how its garbage collector and C allocator are set (`tune_gc`, `tune_malloc`).

Counts that should return to their idle values once traffic stops: asyncio tasks, open file
descriptors and sockets, requests in flight per instance, and resident memory; and the event
loop's largest lag since the previous read (`LoopLag`), which is what every request waited while
something blocked the loop. It says nothing about requests or their content, and sits behind the
API key when one is configured.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import resource
from typing import Final

# Container allocations (net of frees) between young-generation collections; CPython's default is 700
GC_YOUNG_THRESHOLD: Final = 10_000
# glibc's mallopt() parameters (malloc.h) and the values a worker sets
M_TRIM_THRESHOLD: Final = -1
M_MMAP_THRESHOLD: Final = -3
TRIM_THRESHOLD: Final = 16 << 20
MMAP_THRESHOLD: Final = 1 << 20
_malloc_tuned = False


def tune_gc() -> None:
    """Called once per worker before it serves: freeze what start-up built and collect the young
    generation less often.

    Why: a worker imports aiohttp, opentelemetry, prometheus-client, numpy..., some 10^5 objects
    the collector would otherwise walk at every full collection for the life of the process, and a
    request allocates a few hundred containers, so the default threshold (700) collects the young
    generation every request or two, each time walking every in-flight request's young objects.
    Frozen objects are never collected (they were built to live as long as the process anyway);
    the larger threshold lets up to that many objects in reference cycles wait for a collection
    (a traceback's frames, say): a few MB at most, measured by benchmarks/body_memory.py and soak.py.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def tune_malloc() -> bool:
    """Called once per worker: with glibc, keep up to 16 MiB of freed heap for reuse, and take blocks
    under 1 MiB from the heap. False where the C library has no such knobs (musl, macOS).

    Why: glibc hands the top of its heap back to the kernel as soon as twice its mmap threshold
    lies free there, and a batch of spans (~0.3 MB joined, framed, then freed once posted) frees
    that much at every post; the next batch then faults every page back in, a trap to the
    hypervisor each on a virtual machine. Three copies of a 273 KB batch took 470 us that way and
    15 us with these values (this 2-core VM); a large prompt body is the same story. Fixed values
    also end glibc's own threshold adjustment, which only ever learns from blocks already freed.
    """
    global _malloc_tuned
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    _malloc_tuned = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                      TRIM_THRESHOLD))
    return _malloc_tuned


def snapshot(proxy) -> dict:
    """What `proxy` (a pdproxy.pd.Proxy) and this process hold right now; served by pdproxy/server.py."""
    fds = _fd_kinds()
    pools = [p for p in (proxy.prefill, proxy.decode) if p is not None]
    return {
        "pid": os.getpid(),  # which worker answered
        "tasks": len(asyncio.all_tasks()),
        "open_fds": sum(fds.values()),
        "sockets": fds.get("socket", 0),
        "rss_bytes": _rss_bytes(),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "inflight_requests": proxy.admission.inflight,
        "queued_requests": proxy.admission.waiting,
        "instance_inflight": {f"{p.role}:{i.address}": i.inflight for p in pools for i in p.instances},
        "shadow_tasks": len(proxy.shadow.tasks) if proxy.shadow is not None else 0,
        "gc_frozen_objects": gc.get_freeze_count(),
        "gc_thresholds": list(gc.get_threshold()),
        "malloc_tuned": _malloc_tuned,
    }


class LoopLag:
    """How late the event loop runs a short timer: the largest delay since the last `take()`.

    Runs only with --debug-endpoints; a timer every 10 ms costs next to nothing and measures, from
    inside the process, a stall that a client's probe would see blurred by its own scheduling."""

    INTERVAL = 0.01  # seconds

    def __init__(self) -> None:
        self.largest = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def take(self) -> float:
        """The largest lag since the previous call, in seconds (and start over)."""
        largest, self.largest = self.largest, 0.0
        return largest

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.INTERVAL
            await asyncio.sleep(self.INTERVAL)
            self.largest = max(self.largest, loop.time() - due)


def _fd_kinds() -> dict[str, int]:
    kinds: dict[str, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return kinds
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        kind = target.split(":", 1)[0] if target.startswith(("socket:", "pipe:", "anon_inode:")) else "file"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
