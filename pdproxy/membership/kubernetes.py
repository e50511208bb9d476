"""The Kubernetes source: the pods a label selector matches, per role, as members.

vllm-router's flags (`--service-discovery`, `--prefill-selector app=vllm role=prefill`, `--decode-selector`,
`--selector` for single mode, `--service-discovery-namespace`, `--service-discovery-port`), with what its users
found missing (vllm-router #279, production-stack #1091, SMG's fixes; shared/research/membership-peers.md):

* Pods, not EndpointSlices: only a pod carries the annotations (bootstrap and KV-event ports) and its UID, and a
  selector per role needs no Service per role. The pod's Ready condition is the readiness an EndpointSlice copies.
* What a pod says, as a `Member`: URL `http://<podIP>:<port>`; `identity` its UID (a new pod at an old IP is a
  new instance); `ready` its Ready condition (NotReady keeps it, out of rotation: a flapping probe does not churn
  the pools, the event index or the metric series); `terminating` once it has a deletion timestamp (it drains
  through its grace period); gone when deleted, relabelled out of the selector, or Succeeded/Failed (evicted).
  A pod without an IP yet is not published.
* Ports, each from the pod itself (annotation first, then a named container port):
    HTTP           `pdproxy.io/port`, else `--service-discovery-port`, else the container port named `http`, else 80
    bootstrap      `vllm.ai/bootstrap-port` (vllm-router's), prefill pods only
    KV events      `pdproxy.io/kv-events-port`, else the container port named `kv-events`  -> tcp://<podIP>:<port>
    event replay   `pdproxy.io/kv-events-replay-port`, else the container port named `kv-replay`
  Only what a pod says is published: a member with no KV-event endpoint gets `--kv-events-endpoint`'s
  template from the reconciler.
* List, then watch from the list's resourceVersion. Every watch ends after `resync` seconds (60, SMG's period)
  and is followed by a full re-list, as is every reconnect and every 410 Gone: a pod deleted while the watch was
  down is dropped by the next list (production-stack #1091 missed it for 22 hours), and a watch gone silent lives
  at most one period. Level-triggered: each change publishes the whole set.
* The API server down or refusing: the last known set stays (none at start: the static instances serve), the
  state is "degraded" with the error in /status, one warning in the log, and retries back off from 0.5 s to 30 s.
  A selector that matches no pod is a warning too (a typo in a label is the usual cause).

Client: plain aiohttp against the REST API, not kubernetes_asyncio or kr8s. The source needs two requests on one
resource, and it must control exactly what the generated clients hide: the resourceVersion it resumes from, a
410 inside the stream, where a watch ends, lines of any length (aiohttp's readline stops at 128 KiB; a pod with a
large annotation is longer). kubernetes_asyncio takes 1.6-2.4 s to import (every generated model, in each
--workers process) and turns each pod into model objects; aiohttp is already pdproxy's. Credentials: the pod's
service account (token re-read on every request, as it rotates), or a kubeconfig (KUBECONFIG, else
~/.kube/config) with a token, a client certificate or none (`kubectl proxy`); exec and auth-provider plugins are
not run: point a kubeconfig at `kubectl proxy` for those.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import random
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import orjson
import yaml

from pdproxy.membership.model import DECODE, PREFILL, Member, MemberError, Publish, member, port_number

log = logging.getLogger("pdproxy.membership.kubernetes")

PORT_ANNOTATION = "pdproxy.io/port"
BOOTSTRAP_ANNOTATION = "vllm.ai/bootstrap-port"  # vllm-router's, fixed there too
KV_EVENTS_ANNOTATION = "pdproxy.io/kv-events-port"
KV_REPLAY_ANNOTATION = "pdproxy.io/kv-events-replay-port"
HTTP_PORT_NAME, KV_EVENTS_PORT_NAME, KV_REPLAY_PORT_NAME = "http", "kv-events", "kv-replay"
DEFAULT_PORT = 80  # vllm-router's --service-discovery-port default

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
RESYNC = 60.0
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 30.0
LIST_PAGE = 500
MAX_LINE = 64 * 1024 * 1024  # one watch event; a pod is at most ~1.5 MB in etcd


class KubeError(Exception):
    """The API server answered with an error, or could not be reached; `code` is the HTTP status if any."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class Gone(KubeError):
    """410: the resourceVersion is older than the server keeps; list again."""


# ---------------------------------------------------------------------------------------------
# Where the API server is and who we are


@dataclass
class Cluster:
    """How to reach the API server: its URL, TLS, and the credentials sent with each request."""

    server: str
    ssl: ssl.SSLContext | bool = True
    token: str | None = None
    token_file: Path | None = None  # re-read on every request: a projected service-account token rotates
    tls_server_name: str | None = None
    origin: str = ""  # where this came from, for the log

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file is not None:
            try:
                token = self.token_file.read_text().strip()
            except OSError as exc:
                raise KubeError(f"cannot read the service-account token {self.token_file}: {exc.strerror}") from None
        return {"Authorization": f"Bearer {token}"} if token else {}


def find_cluster(environ: dict[str, str] | None = None, service_account: Path | None = None) -> Cluster:
    """KUBECONFIG if set, else the pod's service account, else ~/.kube/config (client-go's order); KubeError
    saying what is missing otherwise."""
    env = os.environ if environ is None else environ
    service_account = service_account or SERVICE_ACCOUNT
    if env.get("KUBECONFIG"):
        return from_kubeconfig([Path(p) for p in env["KUBECONFIG"].split(os.pathsep) if p])
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if host and port and (service_account / "token").is_file():
        ca = service_account / "ca.crt"
        context = ssl.create_default_context(cafile=str(ca)) if ca.is_file() else ssl.create_default_context()
        host = f"[{host}]" if ":" in host else host
        return Cluster(f"https://{host}:{port}", context, token_file=service_account / "token",
                       origin=f"in-cluster service account ({service_account})")
    default = Path(env.get("HOME") or Path.home()) / ".kube" / "config"
    if default.is_file():
        return from_kubeconfig([default])
    raise KubeError("no Kubernetes credentials: not in a pod (KUBERNETES_SERVICE_HOST unset or no service-account "
                    "token) and no kubeconfig (KUBECONFIG, ~/.kube/config)")


def from_kubeconfig(paths: list[Path]) -> Cluster:
    """The current context of one or more kubeconfig files (merged as kubectl does: the first to name a thing
    wins)."""
    merged: dict[str, dict[str, Any]] = {"clusters": {}, "users": {}, "contexts": {}}
    current = None
    bases: dict[tuple[str, str], Path] = {}
    for path in paths:
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise KubeError(f"cannot read kubeconfig {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise KubeError(f"kubeconfig {path} is not valid YAML: {exc}") from None
        if not isinstance(doc, dict):
            raise KubeError(f"kubeconfig {path} is not a kubeconfig (a mapping)")
        current = current or doc.get("current-context")
        for kind in merged:
            for entry in doc.get(kind) or []:
                if isinstance(entry, dict) and entry.get("name") not in merged[kind]:
                    merged[kind][entry["name"]] = entry.get(kind[:-1]) or {}
                    bases[(kind, entry["name"])] = path.parent
    where = ", ".join(map(str, paths))
    if not current or current not in merged["contexts"]:
        raise KubeError(f"kubeconfig {where}: no current context" + (f" named {current!r}" if current else ""))
    ctx = merged["contexts"][current]
    cluster = merged["clusters"].get(ctx.get("cluster"))
    if not cluster or not cluster.get("server"):
        raise KubeError(f"kubeconfig {where}: context {current!r} names no cluster with a server")
    user = merged["users"].get(ctx.get("user"), {}) or {}
    cluster_dir = bases.get(("clusters", ctx.get("cluster")), Path("."))
    user_dir = bases.get(("users", ctx.get("user")), Path("."))
    if user.get("exec") or user.get("auth-provider"):
        raise KubeError(f"kubeconfig {where}: user {ctx.get('user')!r} authenticates with an exec or auth-provider "
                        "plugin, which pdproxy does not run; run `kubectl proxy` and point a kubeconfig at it")
    server = str(cluster["server"]).rstrip("/")
    context: ssl.SSLContext | bool = True
    if server.startswith("https://"):
        context = _ssl_context(cluster, user, cluster_dir, user_dir, where)
    token = user.get("token")
    token_file = None
    if not token and user.get("tokenFile"):
        token_file = _path(user["tokenFile"], user_dir)
    if user.get("username") and user.get("password"):
        raise KubeError(f"kubeconfig {where}: basic authentication (username/password) is not supported")
    return Cluster(server, context, token=token, token_file=token_file,
                   tls_server_name=cluster.get("tls-server-name"), origin=f"kubeconfig {where}, context {current}")


def _path(value: str, base: Path) -> Path:
    path = Path(os.path.expanduser(str(value)))
    return path if path.is_absolute() else base / path


def _ssl_context(cluster: dict, user: dict, cluster_dir: Path, user_dir: Path, where: str) -> ssl.SSLContext:
    try:
        if cluster.get("certificate-authority-data"):
            context = ssl.create_default_context(
                cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
        elif cluster.get("certificate-authority"):
            context = ssl.create_default_context(cafile=str(_path(cluster["certificate-authority"], cluster_dir)))
        else:
            context = ssl.create_default_context()
        if cluster.get("insecure-skip-tls-verify"):
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        cert = user.get("client-certificate-data") or user.get("client-certificate")
        key = user.get("client-key-data") or user.get("client-key")
        if cert and key:
            if user.get("client-certificate-data"):
                _load_chain_data(context, base64.b64decode(cert), base64.b64decode(key))
            else:
                context.load_cert_chain(str(_path(cert, user_dir)), str(_path(key, user_dir)))
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise KubeError(f"kubeconfig {where}: TLS settings unusable: {exc}") from None
    return context


def _load_chain_data(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """ssl takes a client certificate only from files: written to a private directory, loaded, removed."""
    with tempfile.TemporaryDirectory(prefix="pdproxy-kube-") as tmp:
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        for path, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
        context.load_cert_chain(str(cert_path), str(key_path))


# ---------------------------------------------------------------------------------------------
# A pod, as a member


@dataclass(frozen=True, slots=True)
class PodView:
    """What the source keeps of one pod: its name (for the log and /status) and its member, if it has one."""

    name: str
    member: Member | None
    why_not: str = ""  # no member: why (no IP yet, finished, a bad annotation)


def pod_member(pod: dict[str, Any], role: str, port: int | None = None) -> PodView:
    """The member `pod` stands for in `role`, or why it stands for none. `port` is --service-discovery-port."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    phase = status.get("phase")
    if phase in ("Succeeded", "Failed"):
        return PodView(name, None, f"phase {phase}")
    ip = status.get("podIP")
    if not ip:
        return PodView(name, None, "no IP yet")
    annotations = meta.get("annotations") or {}
    named: dict[str, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") and p.get("containerPort"):
                named.setdefault(p["name"], int(p["containerPort"]))
    ready = phase == "Running" and any(c.get("type") == "Ready" and c.get("status") == "True"
                                       for c in status.get("conditions") or [])
    host = f"[{ip}]" if ":" in ip else ip
    try:
        http = _port(annotations.get(PORT_ANNOTATION), PORT_ANNOTATION)
        http = http or port or named.get(HTTP_PORT_NAME) or DEFAULT_PORT
        kv = _port(annotations.get(KV_EVENTS_ANNOTATION), KV_EVENTS_ANNOTATION) or named.get(KV_EVENTS_PORT_NAME)
        replay = _port(annotations.get(KV_REPLAY_ANNOTATION), KV_REPLAY_ANNOTATION) or named.get(KV_REPLAY_PORT_NAME)
        bootstrap = annotations.get(BOOTSTRAP_ANNOTATION) if role == PREFILL else None
        return PodView(name, member(role, f"http://{host}:{http}",
                                    kv_events_endpoint=f"tcp://{host}:{kv}" if kv else None,
                                    kv_events_replay_endpoint=f"tcp://{host}:{replay}" if replay else None,
                                    bootstrap_port=bootstrap, identity=meta.get("uid"), ready=ready,
                                    terminating=bool(meta.get("deletionTimestamp"))))
    except MemberError as exc:
        return PodView(name, None, str(exc))


def _port(value: Any, what: str) -> int | None:
    return port_number(value, f"annotation {what}")


def selector_text(labels: dict[str, str]) -> str:
    """A labelSelector query: `app=vllm,role=prefill`."""
    return ",".join(f"{k}={v}" for k, v in labels.items())


# ---------------------------------------------------------------------------------------------
# The source


@dataclass
class _Role:
    """One role's watch: its pods (by UID) and what /status says of it."""

    role: str
    selector: str
    pods: dict[str, PodView] = field(default_factory=dict)
    listed: bool = False  # a list has succeeded at least once
    resource_version: str | None = None
    lists: int = 0
    watches: int = 0
    gone: int = 0  # 410s
    failures: int = 0  # consecutive failed attempts
    last_error: str | None = None
    last_error_at: float | None = None
    warned_empty: bool = False
    warned_pods: dict[str, str] = field(default_factory=dict)  # uid -> the reason already in the log


class KubernetesSource:
    """Watches the pods of each role's label selector and publishes them as members (module docstring)."""

    name = "kubernetes"

    def __init__(self, selectors: dict[str, dict[str, str]], namespace: str | None = None, port: int | None = None,
                 resync: float = RESYNC, cluster: Cluster | Callable[[], Cluster] = find_cluster,
                 backoff: tuple[float, float] = (BACKOFF_FIRST, BACKOFF_MAX)) -> None:
        self.namespace = namespace
        self.port = port
        self.resync = resync
        self._cluster_source = cluster
        self.cluster: Cluster | None = cluster if isinstance(cluster, Cluster) else None
        self.backoff = backoff
        self.roles = {role: _Role(role, selector_text(labels)) for role, labels in selectors.items()}
        self._published: frozenset[Member] | None = None
        self._publish: Publish | None = None
        self.last_heard: float | None = None  # wall time of the API server's last answer
        self.started: float | None = None
        self.publishes = 0

    # -- the Source protocol

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        self.started = time.time()
        if self.cluster is None:
            try:
                self.cluster = self._cluster_source()  # type: ignore[operator]
            except KubeError as exc:
                for r in self.roles.values():
                    r.last_error, r.last_error_at = str(exc), time.time()
                log.error("kubernetes: %s; discovery is off, the static instances serve", exc)
                await asyncio.Event().wait()  # nothing to retry: the configuration must change
        assert self.cluster is not None
        log.debug("kubernetes: %s on %s (%s)", self.following(), self.cluster.server, self.cluster.origin)
        connector = aiohttp.TCPConnector(ssl=self.cluster.ssl, limit=0)
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, raise_for_status=False) as session:
            async with asyncio.TaskGroup() as group:
                for r in self.roles.values():
                    group.create_task(self._follow(session, r), name=f"kubernetes-{r.role}")

    def status(self) -> dict[str, Any]:
        # (start-up logs the fields that are set as the source's one line: what it follows first)
        roles = {}
        for r in self.roles.values():
            members = [v.member for v in r.pods.values() if v.member is not None]
            roles[r.role] = {
                "selector": r.selector, "listed": r.listed, "pods": len(r.pods), "members": len(members),
                "ready": sum(1 for m in members if m.ready and not m.terminating),
                "terminating": sum(1 for m in members if m.terminating),
                "lists": r.lists, "watches": r.watches, "gone": r.gone, "resource_version": r.resource_version,
                "last_error": r.last_error if r.failures else None,
                "without_member": dict(list({v.name: v.why_not for v in r.pods.values()
                                             if v.member is None}.items())[:20]),
            }
        failing = [r for r in self.roles.values() if r.failures or (r.last_error and not r.listed)]
        state = "degraded" if failing else "ok" if all(r.listed for r in self.roles.values()) else "starting"
        return {"state": state, "following": self.following(),
                "server": self.cluster.server if self.cluster else None,
                "last_error": next((r.last_error for r in failing), None),
                "last_heard": self.last_heard,
                "instances": len(self._published or ()),
                "resync": self.resync, "roles": roles if self.started else {}}

    def following(self) -> str:
        where = f"namespace {self.namespace}" if self.namespace else "every namespace"
        return f"{', '.join(f'{r.role} pods {r.selector}' for r in self.roles.values())} in {where}"

    # -- one role: list, watch, again

    async def _follow(self, session: aiohttp.ClientSession, r: _Role) -> None:
        delay = self.backoff[0]
        while True:
            began = time.monotonic()
            try:
                await self._list(session, r)
                self._recovered(r)
                await self._watch(session, r)
            except Gone:
                r.gone += 1
                log.debug("kubernetes: %s watch: resourceVersion %s is gone (410); listing again",
                          r.role, r.resource_version)
                if time.monotonic() - began > 1.0:
                    continue  # the usual case: re-list at once
            except (KubeError, aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                self._failed(r, exc)
            except Exception as exc:  # a bug here must not end discovery: the set stays, and it says so
                log.exception("kubernetes: %s pods: unexpected error", r.role)
                self._failed(r, exc)
            else:
                if time.monotonic() - began >= min(self.resync, 5.0):
                    delay = self.backoff[0]
                    continue  # the watch lived its time: re-list now
            # a failure, or a watch the server ended at once: wait before the next attempt, longer each time
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self.backoff[1])

    def _path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods" if self.namespace else "/api/v1/pods"

    async def _list(self, session: aiohttp.ClientSession, r: _Role) -> None:
        """Every pod the selector matches, replacing what the watch had built (a delete it missed is seen here)."""
        pods: dict[str, PodView] = {}
        token = None
        while True:
            query = {"labelSelector": r.selector, "limit": LIST_PAGE}
            if token:
                query["continue"] = token
            body = await self._get_json(session, query, timeout=30.0)
            for pod in body.get("items") or []:
                uid = (pod.get("metadata") or {}).get("uid")
                if uid:
                    pods[uid] = self._view(pod, r)
            meta = body.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                break
        r.pods, r.resource_version, r.listed = pods, meta.get("resourceVersion"), True
        r.warned_pods = {uid: why for uid, why in r.warned_pods.items() if uid in pods}
        r.lists += 1
        if not pods and not r.warned_empty:
            log.warning("kubernetes: no pod in %s matches the %s selector %s (a label typo? pods not created yet?)",
                        f"namespace {self.namespace}" if self.namespace else "any namespace", r.role, r.selector)
            r.warned_empty = True
        elif pods:
            r.warned_empty = False
        self._changed()

    async def _watch(self, session: aiohttp.ClientSession, r: _Role) -> None:
        """Follow changes from the list's resourceVersion for at most `resync` seconds; Gone on 410."""
        query: dict[str, Any] = {"labelSelector": r.selector, "watch": "1", "allowWatchBookmarks": "true",
                                 "resourceVersion": r.resource_version or "",
                                 "timeoutSeconds": max(1, int(self.resync + 0.999))}
        r.watches += 1
        period = asyncio.timeout(self.resync)  # the server's timeoutSeconds is a courtesy; this is the bound
        try:
            async with period:
                async with self._request(session, query) as resp:
                    await self._raise_for(resp)
                    self.last_heard = time.time()
                    async for line in _lines(resp.content):
                        self.last_heard = time.time()
                        self._event(orjson.loads(line), r)
        except TimeoutError:
            if not period.expired():
                raise  # a connect or read timeout: a failure
            # the period is over (or the watch went silent): the caller lists again

    def _event(self, event: dict[str, Any], r: _Role) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            message = obj.get("message") or str(obj)
            raise (Gone if code == 410 else KubeError)(f"watch error {code}: {message}", code)
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            r.resource_version = meta["resourceVersion"]
        uid = meta.get("uid")
        if kind == "BOOKMARK" or not uid:
            return
        if kind == "DELETED":
            r.warned_pods.pop(uid, None)
            if r.pods.pop(uid, None) is not None:
                self._changed()
        elif kind in ("ADDED", "MODIFIED"):
            view = self._view(obj, r)
            if r.pods.get(uid) != view:
                r.pods[uid] = view
                self._changed()

    def _view(self, pod: dict[str, Any], r: _Role) -> PodView:
        view = pod_member(pod, r.role, self.port)
        uid = (pod.get("metadata") or {}).get("uid", "")
        if view.member is None and view.why_not.startswith("annotation") and r.warned_pods.get(uid) != view.why_not:
            r.warned_pods[uid] = view.why_not
            log.warning("kubernetes: %s pod %s left out: %s", r.role, view.name, view.why_not)
        return view

    # -- HTTP

    def _request(self, session: aiohttp.ClientSession, query: dict[str, Any],
                 timeout: float | None = None) -> Any:
        assert self.cluster is not None
        kwargs: dict[str, Any] = {"headers": {"Accept": "application/json", **self.cluster.headers()}}
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
        if self.cluster.tls_server_name:
            kwargs["server_hostname"] = self.cluster.tls_server_name
        return session.get(f"{self.cluster.server}{self._path()}?{urlencode(query)}", **kwargs)

    async def _get_json(self, session: aiohttp.ClientSession, query: dict[str, Any], timeout: float) -> dict:
        async with self._request(session, query, timeout) as resp:
            await self._raise_for(resp)
            body = orjson.loads(await resp.read())
        self.last_heard = time.time()
        return body

    async def _raise_for(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status == 200:
            return
        text = (await resp.read())[:2000].decode(errors="replace")
        try:
            message = orjson.loads(text).get("message") or text
        except (orjson.JSONDecodeError, AttributeError):
            message = text.strip() or resp.reason
        self.last_heard = time.time()
        if resp.status == 410:
            raise Gone(f"410 {message}", 410)
        hint = ""
        if resp.status in (401, 403):
            hint = (" (the service account needs get, list and watch on pods"
                    + (f" in namespace {self.namespace}" if self.namespace else " in every namespace: a ClusterRole")
                    + "; deploy/k8s/overlays/discovery)")
        raise KubeError(f"{resp.status} {message}{hint}", resp.status)

    # -- bookkeeping

    def _failed(self, r: _Role, exc: BaseException) -> None:
        text = str(exc) or type(exc).__name__
        if isinstance(exc, (aiohttp.ClientError, OSError, asyncio.TimeoutError)) and not isinstance(exc, KubeError):
            text = f"API server unreachable: {type(exc).__name__}: {text}"
        r.failures += 1
        r.last_error, r.last_error_at = text, time.time()
        if r.failures == 1:
            kept = ("its last known set stays" if r.listed
                    else "nothing found yet: the instances given as flags serve")
            log.warning("kubernetes: %s pods (%s): %s; %s, retrying", r.role, r.selector, text, kept)
        else:
            log.debug("kubernetes: %s pods: attempt %d failed: %s", r.role, r.failures, text)

    def _recovered(self, r: _Role) -> None:
        if r.failures:
            log.warning("kubernetes: %s pods: the API server answers again after %d failed attempt(s); %d pod(s)",
                        r.role, r.failures, len(r.pods))
            r.failures = 0

    def members(self) -> frozenset[Member]:
        """The whole desired set: every role's members, one per (role, URL) (a live pod before a terminating
        one, a Ready before a NotReady: an IP reused before its old pod is gone)."""
        chosen: dict[tuple[str, str], Member] = {}
        for r in self.roles.values():
            for view in r.pods.values():
                m = view.member
                if m is None:
                    continue
                held = chosen.get(m.key)
                if held is None or _rank(m) > _rank(held):
                    chosen[m.key] = m
        return frozenset(chosen.values())

    def _changed(self) -> None:
        current = self.members()
        if current != self._published and self._publish is not None:
            self._published = current
            self.publishes += 1
            self._publish(sorted(current, key=lambda m: m.key))


def _rank(m: Member) -> tuple[bool, bool, str]:
    return not m.terminating, m.ready, m.identity or ""


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The watch's newline-delimited JSON events, whatever their length."""
    buffer = bytearray()
    async for chunk in stream.iter_any():
        buffer += chunk
        if b"\n" not in chunk:  # a long event arrives in many chunks: split once its end has come
            if len(buffer) > MAX_LINE:
                raise KubeError(f"a watch event over {MAX_LINE} bytes")
            continue
        *lines, rest = bytes(buffer).split(b"\n")
        buffer = bytearray(rest)
        for line in lines:
            if line.strip():
                yield line
    if buffer.strip():
        yield bytes(buffer)


def from_settings(settings: Any) -> KubernetesSource | None:
    """The source `pdproxy serve --service-discovery ...` asks for, or None when discovery is off. No credentials
    at all (not in a pod, no kubeconfig) is a ConfigError at start-up; an API server that does not answer is not
    (the source retries, and says so in /status)."""
    if not getattr(settings, "service_discovery", False):
        given = [f"--{n.replace('_', '-')}" for n in ("selector", "prefill_selector", "decode_selector")
                 if getattr(settings, n, None)]
        if given:
            log.warning("kubernetes: %s given without --service-discovery: no pods are watched", ", ".join(given))
        return None
    from pdproxy.config import ConfigError

    try:
        cluster = find_cluster()
    except KubeError as exc:
        raise ConfigError(f"--service-discovery: {exc}") from None
    if settings.selector:
        selectors = {DECODE: dict(settings.selector)}  # single mode: the instances are the decode pool
    else:
        selectors = {role: dict(labels) for role, labels in
                     ((PREFILL, settings.prefill_selector), (DECODE, settings.decode_selector)) if labels}
    return KubernetesSource(selectors, namespace=settings.service_discovery_namespace,
                            port=settings.service_discovery_port, resync=settings.service_discovery_resync,
                            cluster=cluster)


__all__ = ["Cluster", "KubeError", "KubernetesSource", "PodView", "find_cluster", "from_kubeconfig", "from_settings",
           "pod_member"]
