"""The admin HTTP API: instances added and removed by hand, with vllm-router's routes and parameters.

    POST   /workers             JSON {url, worker_type: prefill|decode, bootstrap_port,
                                      kv_events_endpoint, kv_events_replay_endpoint}   (pdproxy's: the last two)
    GET    /workers             every instance: url, worker_type, bootstrap_port, is_healthy, load, and
                                pdproxy's sources, joined, state
    GET    /workers/{url}       one instance (the URL percent-encoded, or as it is)
    DELETE /workers/{url}       withdraw it: drained, then removed
    POST   /add_worker?url=U[&worker_type=prefill|decode][&bootstrap_port=N]     (legacy)
    POST   /remove_worker?url=U                                                   (legacy)
    GET    /list_workers        {"urls": [...]}                                   (legacy)

Guarded by --admin-api-key, else by --api-key (`Authorization: Bearer KEY`): 401 without credentials, 403
with wrong ones. With neither key set, only loopback callers are served (403 for others): an open admin API
on a proxy's public port would let any client point traffic anywhere.

An instance added here is the operator's own word: discovery never removes it. Removing an instance that the
flags gave withdraws it as vllm-router's /remove_worker does; one that a discovery source still lists is
refused with 409 naming the source (it would be back at the next reconcile). Errors are OpenAI-style JSON.
With --workers N the change reaches every worker (pdproxy/workers.py forwards it) before the answer.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

from aiohttp import web

from pdproxy import jsonio
from pdproxy.errors import error_body
from pdproxy.membership.model import DECODE, PREFILL, ROLES, Member, MemberError, member, normalise_url
from pdproxy.membership.service import Membership, state_of

MAX_ADMIN_BODY = 64 * 1024
GIVEN_BY_HAND = ("admin", "flags")
# applies one admin change in the other workers (--workers N); None with one worker
Forward = Callable[[str, dict[str, Any]], Awaitable[list[str]]]


ROUTES = (("POST", "/workers", "create"), ("GET", "/workers", "list"), ("GET", "/workers/{url:.+}", "get"),
          ("DELETE", "/workers/{url:.+}", "delete"), ("POST", "/add_worker", "add_legacy"),
          ("POST", "/remove_worker", "remove_legacy"), ("GET", "/list_workers", "list_legacy"))


def admin_routes(app: web.Application, key: web.AppKey) -> None:
    """The admin API's routes on `app`, served by the `AdminAPI` the app holds under `key` once started."""
    for method, path, name in ROUTES:
        async def handler(request: web.Request, name: str = name) -> web.Response:
            return await request.app[key].serve(name, request)
        app.router.add_route(method, path, handler)


class AdminError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def response(self) -> web.Response:
        return web.json_response(error_body(self.message, self.status, self.code), status=self.status)


class AdminAPI:
    def __init__(self, membership: Membership, key: str | None, pd_mode: bool,
                 forward: Forward | None = None) -> None:
        self.membership = membership
        self._digest = hashlib.sha256(f"Bearer {key}".encode()).digest() if key else None
        self.pd_mode = pd_mode
        self.forward = forward

    async def serve(self, name: str, request: web.Request) -> web.Response:
        """One admin request: authorised, then handled by the method `name`."""
        try:
            self._authorise(request)
            return await getattr(self, name)(request)
        except AdminError as err:
            return err.response()

    def _authorise(self, request: web.Request) -> None:
        if self._digest is None:
            peer = request.remote or ""
            try:
                loopback = ipaddress.ip_address(peer.split("%")[0]).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise AdminError(403, "the admin API serves loopback callers only unless --admin-api-key (or "
                                      "--api-key) is set", "forbidden")
            return
        given = request.headers.get("Authorization")
        if not given:
            raise AdminError(401, "the admin API needs 'Authorization: Bearer <admin key>'", "unauthorized")
        if not hmac.compare_digest(hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest(), self._digest):
            raise AdminError(403, "wrong admin API key", "forbidden")

    # -- changes -----------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        fields = await self._json(request)
        return await self._add(fields, request)

    async def add_legacy(self, request: web.Request) -> web.Response:
        fields = {k: v for k, v in request.query.items() if k in ("url", "worker_type", "role", "bootstrap_port")}
        return await self._add(fields, request)

    async def _add(self, fields: dict[str, Any], request: web.Request) -> web.Response:
        new = self.member_of(fields)
        changed = self.membership.admin.put(new)
        await self.membership.reconciler.settled()
        await self._forwarded(request, "put", fields)
        entry = self.membership.entry(new.role, new.url)
        return web.json_response({"success": True, "message": f"Worker {new.url} {'added' if changed else 'was there'}",
                                  "worker": self._describe(new, entry)})

    async def delete(self, request: web.Request) -> web.Response:
        return await self._remove(request.match_info["url"], request)

    async def remove_legacy(self, request: web.Request) -> web.Response:
        url = request.query.get("url")
        if not url:
            raise AdminError(400, "remove_worker needs ?url=http://host:port", "invalid_url")
        return await self._remove(url, request)

    async def _remove(self, raw: str, request: web.Request) -> web.Response:
        url = self._url(unquote(raw))
        keys = [(role, url) for role in ROLES if self.membership.entry(role, url) is not None]
        if not keys:
            raise AdminError(404, f"Worker {url} not found", "WORKER_NOT_FOUND")
        discovered = sorted({s for key in keys for s in self._sources(key) if s not in GIVEN_BY_HAND})
        if discovered:
            raise AdminError(409, f"Worker {url} is listed by {', '.join(discovered)}: it would come back at the "
                                  f"next reconcile; remove it there", "WORKER_DISCOVERED")
        for key in keys:
            self.membership.admin.withdraw(key)
            self.membership.flags.withdraw(key)
        await self.membership.reconciler.settled()
        await self._forwarded(request, "withdraw", {"url": url})
        return web.json_response({"success": True, "message": f"Worker {url} removed successfully (draining)",
                                  "worker": None})

    async def _forwarded(self, request: web.Request, action: str, fields: dict[str, Any]) -> None:
        if self.forward is None or request.headers.get("X-Pdproxy-Forwarded"):
            return
        failed = await self.forward(action, fields)
        if failed:
            raise AdminError(502, f"applied here, but not in worker(s) {', '.join(failed)}; retry the request",
                             "forward_failed")

    async def apply(self, action: str, fields: dict[str, Any]) -> None:
        """An admin change forwarded from another worker, applied before its answer."""
        if action == "put":
            self.membership.admin.put(self.member_of(fields))
        else:
            url = self._url(fields.get("url"))
            for role in ROLES:
                self.membership.admin.withdraw((role, url))
                self.membership.flags.withdraw((role, url))
        await self.membership.reconciler.settled()

    # -- reading -----------------------------------------------------------------------------------

    async def list(self, request: web.Request) -> web.Response:
        workers = [self._describe(m, e) for m, e in self.membership.members()]
        return web.json_response({"workers": workers, "total": len(workers), "stats": {
            "prefill_count": sum(w["worker_type"] == PREFILL for w in workers),
            "decode_count": sum(w["worker_type"] == DECODE for w in workers), "regular_count": 0}})

    async def get(self, request: web.Request) -> web.Response:
        url = self._url(unquote(request.match_info["url"]))
        found = [self._describe(m, e) for m, e in self.membership.members() if m.url == url]
        if not found:
            raise AdminError(404, f"Worker {url} not found", "WORKER_NOT_FOUND")
        return web.json_response(found[0] if len(found) == 1 else {"url": url, "roles": found})

    async def list_legacy(self, request: web.Request) -> web.Response:
        return web.json_response({"urls": sorted({m.url for m, _ in self.membership.members()})})

    # -- helpers -----------------------------------------------------------------------------------

    def member_of(self, fields: dict[str, Any]) -> Member:
        unknown = sorted(set(fields) - {"url", "worker_type", "role", "bootstrap_port", "kv_events_endpoint",
                                        "kv_events_replay_endpoint", "model_id", "priority", "cost", "labels"})
        if unknown:
            raise AdminError(400, f"unknown field(s) {', '.join(unknown)}", "invalid_request")
        role = fields.get("worker_type") or fields.get("role")
        if role in (None, "regular"):
            if self.pd_mode:
                raise AdminError(400, "this proxy runs prefill/decode: give worker_type prefill or decode",
                                 "invalid_worker_type")
            role = DECODE
        if role == PREFILL and not self.pd_mode:
            raise AdminError(400, "this proxy runs without prefill instances (single mode); start it with "
                                  "--vllm-pd-disaggregation to take prefill workers", "invalid_worker_type")
        try:
            return member(role, fields.get("url"), bootstrap_port=fields.get("bootstrap_port"),
                          kv_events_endpoint=fields.get("kv_events_endpoint"),
                          kv_events_replay_endpoint=fields.get("kv_events_replay_endpoint"))
        except MemberError as exc:
            raise AdminError(400, str(exc), "invalid_url" if "url" in str(exc) else "invalid_request") from None

    @staticmethod
    def _url(raw: Any) -> str:
        try:
            return normalise_url(raw)
        except MemberError as exc:
            raise AdminError(400, str(exc), "invalid_url") from None

    async def _json(self, request: web.Request) -> dict[str, Any]:
        if request.content_length is not None and request.content_length > MAX_ADMIN_BODY:
            raise AdminError(413, f"body over {MAX_ADMIN_BODY} bytes", "too_large")
        raw = await request.content.read(MAX_ADMIN_BODY + 1)
        if len(raw) > MAX_ADMIN_BODY:
            raise AdminError(413, f"body over {MAX_ADMIN_BODY} bytes", "too_large")
        try:
            fields = jsonio.loads(raw)
        except ValueError:
            raise AdminError(400, "body is not JSON: send {\"url\": ..., \"worker_type\": ...}", "invalid_json") \
                from None
        if not isinstance(fields, dict):
            raise AdminError(400, "body must be a JSON object", "invalid_json")
        return fields

    def _sources(self, key: tuple[str, str]) -> list[str]:
        return [name for name, wanted in self.membership.reconciler.wanted.items() if key in wanted]

    def _describe(self, m: Member, entry: Any) -> dict[str, Any]:
        instance = entry.instance if entry is not None else None
        out: dict[str, Any] = {"url": m.url, "worker_type": m.role, "bootstrap_port": m.bootstrap_port,
                               "kv_events_endpoint": m.kv_events_endpoint,
                               "kv_events_replay_endpoint": m.kv_events_replay_endpoint}
        if instance is not None:
            out.update(is_healthy=instance.healthy, load=instance.inflight, state=state_of(instance, entry),
                       sources=list(entry.sources), joined=entry.joined)
        return out
