"""What a real kube-apiserver will not do on demand, for the Kubernetes source's fault tests.

`FakeKube` is a scripted API server (aiohttp, on 127.0.0.1, in the test's own event loop), after SMG's
`k8s_discovery_test.rs`: it serves LIST and WATCH of pods from a dict the test edits, and its watch can answer
410 Gone (as an HTTP status or as an ERROR event inside the stream), go silent (headers, then nothing, never
closing), or refuse (403). `Forwarder` is a TCP relay in front of the real API server that a test cuts (every
connection closed, nothing listening) and restores on the same port: a watch lost while pods change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from aiohttp import web

from procs import HOST, free_port


class FakeKube:
    """A scripted API server for `/api/v1/namespaces/{ns}/pods` and `/api/v1/pods`."""

    def __init__(self) -> None:
        self.pods: dict[str, dict] = {}  # name -> pod
        self.rv = 100
        self.watch_mode = "normal"  # normal | gone-status | gone-event | silent
        self.refuse: int | None = None  # answer every request with this status (403, 500)
        self.requests: list[tuple[str, dict[str, str]]] = []  # ("list" | "watch", query)
        self._watchers: list[asyncio.Queue] = []
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> FakeKube:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get("/api/v1/pods", self._pods)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, self.port).start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for q in self._watchers:
            q.put_nowait(None)
        assert self._runner is not None
        await self._runner.cleanup()

    # -- what the test changes

    def put(self, name: str, ip: str | None = "127.0.0.1", ready: bool = True, labels: dict | None = None,
            annotations: dict | None = None, uid: str | None = None, notify: bool = True,
            deleting: bool = False) -> dict:
        """Add or replace a pod (a MODIFIED/ADDED event to live watches unless notify is False)."""
        self.rv += 1
        kind = "MODIFIED" if name in self.pods else "ADDED"
        status: dict[str, Any] = {"phase": "Running",
                                  "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        if ip:
            status["podIP"] = ip
        pod = {"metadata": {"name": name, "namespace": "default", "uid": uid or f"uid-{name}",
                            "resourceVersion": str(self.rv), "labels": labels or {"role": "decode"},
                            "annotations": annotations or {}},
               "spec": {"containers": [{"name": "vllm"}]}, "status": status}
        if deleting:
            pod["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"
        self.pods[name] = pod
        if notify:
            self._send({"type": kind, "object": pod})
        return pod

    def remove(self, name: str, notify: bool = True) -> None:
        """Delete a pod; with notify False the watches never hear of it (only a list shows it gone)."""
        self.rv += 1
        pod = self.pods.pop(name)
        if notify:
            self._send({"type": "DELETED", "object": pod})

    def lists(self) -> int:
        return sum(1 for kind, _ in self.requests if kind == "list")

    def watches(self) -> list[dict[str, str]]:
        return [q for kind, q in self.requests if kind == "watch"]

    # -- the server

    def _send(self, event: dict) -> None:
        for q in self._watchers:
            q.put_nowait(event)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        watching = query.get("watch") in ("1", "true")
        self.requests.append(("watch" if watching else "list", query))
        if self.refuse:
            return web.json_response({"kind": "Status", "code": self.refuse,
                                      "message": f'pods is forbidden: User "system:serviceaccount:x:y" cannot '
                                                 f'{"watch" if watching else "list"} resource "pods"'},
                                     status=self.refuse)
        wanted = dict(item.split("=", 1) for item in query.get("labelSelector", "").split(",") if item)

        def matches(pod: dict) -> bool:
            return wanted.items() <= pod["metadata"]["labels"].items()

        if not watching:
            return web.json_response({"kind": "PodList", "metadata": {"resourceVersion": str(self.rv)},
                                      "items": [p for p in self.pods.values() if matches(p)]})
        if self.watch_mode == "gone-status":
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired",
                                      "message": "too old resource version"}, status=410)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if self.watch_mode == "gone-event":
            await resp.write(json.dumps({"type": "ERROR", "object": {
                "kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"}}).encode()
                + b"\n")
            return resp
        if self.watch_mode == "silent":
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()  # never a byte, never closed (until the client gives up)
            return resp
        q: asyncio.Queue = asyncio.Queue()
        self._watchers.append(q)
        try:
            while (event := await q.get()) is not None:
                if matches(event["object"]):
                    await resp.write(json.dumps(event).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.remove(q)
        return resp


class Forwarder:
    """A TCP relay on 127.0.0.1 to `target` (host, port) that a test can cut and restore on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.accepted = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, HOST, self.port, reuse_address=True)

    async def cut(self) -> None:
        """Nothing listens, and every open connection (the watch's) is closed."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._conns):
            writer.transport.abort()
        self._conns.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._conns.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._conns.difference_update((writer, up_writer))
