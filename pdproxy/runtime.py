"""`GET /debug/runtime` (only with --debug-endpoints): what the process holds, for leak checks.

Counts that should return to their idle values once traffic stops: asyncio tasks, open file
descriptors and sockets, requests in flight per instance, and resident memory; and the event
loop's largest lag since the previous read (`LoopLag`), which is what every request waited while
something blocked the loop. It says nothing about requests or their content, and sits behind the
API key when one is configured.
"""

from __future__ import annotations

import asyncio
import os
import resource


def snapshot(proxy) -> dict:
    """What `proxy` (a pdproxy.pd.Proxy) and this process hold right now; served by pdproxy/server.py."""
    fds = _fd_kinds()
    pools = [p for p in (proxy.prefill, proxy.decode) if p is not None]
    return {
        "tasks": len(asyncio.all_tasks()),
        "open_fds": sum(fds.values()),
        "sockets": fds.get("socket", 0),
        "rss_bytes": _rss_bytes(),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "inflight_requests": proxy.admission.inflight,
        "queued_requests": proxy.admission.waiting,
        "instance_inflight": {f"{p.role}:{i.address}": i.inflight for p in pools for i in p.instances},
        "shadow_tasks": len(proxy.shadow.tasks) if proxy.shadow is not None else 0,
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
