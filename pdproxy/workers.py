"""Several server processes on one port (`--workers N`), and one `/metrics` for all of them.

Why: one Python process relays on one core. With N workers, each process binds its own listening
socket to the same address with SO_REUSEPORT and the kernel spreads new connections across them;
each worker has its own event loop, connection pools, health checks, admission limit and tracer
(so `--max-inflight` is per worker, and each worker's spans carry its own `service.instance.id`).

Metrics: a scrape of `/metrics` reaches one worker at random, so every worker also serves its own
exposition on a private Unix socket in a run directory the parent creates, and the worker that
gets the scrape merges all of them: counters, histograms and load gauges are summed (a merged
histogram is the histogram of all requests), `pdproxy_instance_healthy` takes the minimum (an
instance counts as healthy when every worker has it in rotation), the newest exemplar of a bucket
wins, and `pdproxy_workers` says how many workers answered. Prometheus keeps scraping one target.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from pdproxy.children import die_with_parent

log = logging.getLogger("pdproxy.workers")


@dataclass(frozen=True)
class WorkerInfo:
    index: int
    count: int
    run_dir: str

    def socket_path(self, index: int) -> str:
        return str(Path(self.run_dir) / f"worker-{index}.sock")


def bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


def run_workers(count: int, first: socket.socket, host: str, run: callable) -> int:
    """Fork `count - 1` workers, each with its own SO_REUSEPORT socket on `first`'s port, and run
    worker 0 in this process; `run(sock, info)` serves until SIGTERM/SIGINT. Returns worker 0's code."""
    port = first.getsockname()[1]
    run_dir = tempfile.mkdtemp(prefix="pdproxy-workers-")
    children: list[int] = []
    parent = os.getpid()
    try:
        for index in range(1, count):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    die_with_parent(parent)  # a SIGKILLed parent cannot stop its workers itself
                    first.close()
                    code = run(bind(host, port, reuse_port=True), WorkerInfo(index, count, run_dir))
                finally:
                    os._exit(code)
            children.append(pid)
        code = run(first, WorkerInfo(0, count, run_dir))
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


async def serve_private(info: WorkerInfo, exposition: callable, admin_apply: callable | None) -> web.AppRunner:
    """This worker's own OpenMetrics exposition on its Unix socket, for the worker that gets a scrape; and
    the admin API's changes another worker got (`await admin_apply(action, fields)`), so every worker has them
before the caller gets its answer."""

    async def own(request: web.Request) -> web.Response:
        body, content_type = exposition("application/openmetrics-text")
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def membership(request: web.Request) -> web.Response:
        change = await request.json()
        try:
            await admin_apply(change["action"], change["fields"])
        except Exception as exc:  # the worker that got the request checked it: this is not expected
            log.warning("worker %d: forwarded admin change failed: %s", info.index, exc)
            return web.Response(status=500, text=str(exc))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_get("/metrics", own)
    if admin_apply is not None:
        app.router.add_post("/membership", membership)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    path = info.socket_path(info.index)
    if os.path.exists(path):
        os.unlink(path)
    await web.UnixSite(runner, path).start()
    return runner


async def forward_admin(info: WorkerInfo, action: str, fields: dict, timeout: float = 5.0) -> list[str]:
    """Apply an admin change in every other worker; the indexes of those that did not take it."""

    async def send(index: int) -> str | None:
        try:
            connector = aiohttp.UnixConnector(path=info.socket_path(index))
            async with aiohttp.ClientSession(connector=connector) as session:
                async with session.post("http://worker/membership", json={"action": action, "fields": fields},
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    return None if r.status == 204 else str(index)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return str(index)

    failed = await asyncio.gather(*(send(i) for i in range(info.count) if i != info.index))
    return [f for f in failed if f is not None]


async def sibling_expositions(info: WorkerInfo, timeout: float = 2.0) -> list[str]:
    """The other workers' OpenMetrics texts; a worker that does not answer is left out."""

    async def fetch(index: int) -> str | None:
        try:
            connector = aiohttp.UnixConnector(path=info.socket_path(index))
            async with aiohttp.ClientSession(connector=connector) as session:
                async with session.get("http://worker/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    texts = await asyncio.gather(*(fetch(i) for i in range(info.count) if i != info.index))
    return [t for t in texts if t]
