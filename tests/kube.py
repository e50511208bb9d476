"""A real Kubernetes control plane for tests: etcd and kube-apiserver, built from their Go modules
(tools/build-etcd.sh, tools/build-kube-apiserver.sh), on free ports of 127.0.0.1.

There is no kubelet and no controller-manager: a test creates Pods and writes their status itself (podIP,
phase, the Ready condition), as a kubelet would. A pod made with the finalizer HOLD stays, with a deletion
timestamp, after it is deleted (a pod in its grace period) until `release` removes the finalizer. Each test
works in a namespace of its own (`namespace()`), so one control plane serves the whole session.

Stop order matters: kube-apiserver before etcd, or its graceful shutdown keeps its port for half a minute.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gotools
from procs import FILES, HOST, Proc, free_port
from waits import scaled

TOKEN = "pdproxy-test-admin-token"
HOLD = "pdproxy.test/hold"  # a finalizer: a deleted pod keeps its deletion timestamp until released
_names = itertools.count(1)


class KubeCluster:
    """etcd + kube-apiserver, and the few API calls the tests make."""

    def __init__(self) -> None:
        self.etcd_bin = gotools.build("tools/build-etcd.sh")
        self.apiserver_bin = gotools.build("tools/build-kube-apiserver.sh")
        self.dir = FILES.scratch("kube")
        self.etcd_port, self.peer_port, self.metrics_port = free_port(), free_port(), free_port()
        self.port = free_port()
        self.server = f"https://{HOST}:{self.port}"
        self.etcd: Proc | None = None
        self.apiserver: Proc | None = None
        self.ready_seconds = 0.0
        (self.dir / "tokens.csv").write_text(f"{TOKEN},admin,admin,system:masters\n")
        key = self.dir / "sa.key"
        subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(self.dir / "sa.pub")], check=True,
                       capture_output=True)

    # -- processes

    def start(self) -> None:
        began = time.monotonic()
        if self.etcd is None:
            self.etcd = Proc([str(self.etcd_bin), "--data-dir", str(self.dir / "etcd"), "--name", "default",
                              "--listen-client-urls", f"http://{HOST}:{self.etcd_port}",
                              "--advertise-client-urls", f"http://{HOST}:{self.etcd_port}",
                              "--listen-peer-urls", f"http://{HOST}:{self.peer_port}",
                              "--initial-advertise-peer-urls", f"http://{HOST}:{self.peer_port}",
                              "--initial-cluster", f"default=http://{HOST}:{self.peer_port}",
                              "--listen-metrics-urls", f"http://{HOST}:{self.metrics_port}",
                              "--log-level", "warn"], name="etcd")
            self.etcd.wait_http(f"http://{HOST}:{self.etcd_port}/health", timeout=30)
        self.start_apiserver()
        self.ready_seconds = time.monotonic() - began

    def start_apiserver(self) -> None:
        d = self.dir
        self.apiserver = Proc([
            str(self.apiserver_bin), f"--etcd-servers=http://{HOST}:{self.etcd_port}",
            f"--bind-address={HOST}", f"--advertise-address={HOST}", f"--secure-port={self.port}",
            f"--cert-dir={d / 'certs'}",  # a self-signed serving certificate for 127.0.0.1, and its CA, made once
            # RBAC, as a cluster has: the tests' admin is in system:masters; deploy/k8s's Role is checked for real
            "--authorization-mode=RBAC", f"--token-auth-file={d / 'tokens.csv'}",
            "--disable-admission-plugins=ServiceAccount",  # no controller-manager makes the default account
            "--service-account-issuer=https://kubernetes.default.svc", f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}", "--service-cluster-ip-range=10.96.0.0/16",
            "--enable-priority-and-fairness=false", "--watch-cache=true", "-v=0"], name="kube-apiserver")
        deadline = time.monotonic() + scaled(90)
        while True:
            if self.apiserver.popen.poll() is not None:
                raise RuntimeError(f"kube-apiserver exited:\n{self.apiserver.output()[-6000:]}")
            try:
                if self.get("/readyz", raw=True) == b"ok":
                    return
            except (OSError, ssl.SSLError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"kube-apiserver not ready:\n{self.apiserver.output()[-6000:]}")
            time.sleep(0.2)

    def stop_apiserver(self) -> None:
        if self.apiserver is not None:
            self.apiserver.stop(timeout=30)
            self.apiserver = None

    def stop(self) -> None:
        self.stop_apiserver()  # first: etcd gone under it, its shutdown hangs on to the port
        if self.etcd is not None:
            self.etcd.stop(timeout=15)
            self.etcd = None

    # -- what a client needs

    @property
    def ca(self) -> Path:
        return self.dir / "certs" / "apiserver.crt"  # the serving certificate followed by its CA

    def kubeconfig(self, server: str | None = None, path: Path | None = None) -> Path:
        """A kubeconfig for this control plane (or for `server`, a proxy in front of it)."""
        path = path or self.dir / f"kubeconfig-{next(_names)}.yaml"
        cluster: dict[str, Any] = {"server": server or self.server}
        if cluster["server"].startswith("https://"):
            cluster["certificate-authority"] = str(self.ca)
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": "admin", "user": {"token": TOKEN}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}]}))
        return path

    # -- the API

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
             raw: bool = False) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {TOKEN}", "Content-Type": content_type, "Accept": "application/json"})
        context = ssl.create_default_context(cafile=str(self.ca)) if self.ca.exists() else ssl._create_unverified_context()
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            payload = r.read()
        return payload if raw else json.loads(payload)

    def get(self, path: str, raw: bool = False) -> Any:
        return self.call("GET", path, raw=raw)

    def namespace(self, name: str | None = None) -> str:
        """A namespace of the test's own (or `name`, made unless it exists)."""
        name = name or f"t{next(_names)}-{int(time.time() * 1000) % 100000}"
        try:
            self.call("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise
        return name

    def create(self, obj: dict) -> dict:
        """Any namespaced object of the core or RBAC API (a manifest's ServiceAccount, Role, RoleBinding)."""
        group = obj["apiVersion"]
        prefix = "/api/v1" if group == "v1" else f"/apis/{group}"
        plural = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings"}[obj["kind"]]
        return self.call("POST", f"{prefix}/namespaces/{obj['metadata']['namespace']}/{plural}", obj)

    def token(self, ns: str, account: str) -> str:
        """A service account's token, as the kubelet mounts one (TokenRequest)."""
        return self.call("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{account}/token",
                         {"spec": {"expirationSeconds": 3600}})["status"]["token"]

    def create_pod(self, ns: str, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None,
                   ports: dict[str, int] | None = None, hold: bool = False) -> dict:
        meta: dict[str, Any] = {"name": name, "labels": labels, "annotations": annotations or {}}
        if hold:
            meta["finalizers"] = [HOLD]
        container = {"name": "vllm", "image": "vllm/vllm-openai:v0.23.0",
                     "ports": [{"name": n, "containerPort": p} for n, p in (ports or {}).items()]}
        return self.call("POST", f"/api/v1/namespaces/{ns}/pods", {"metadata": meta, "spec": {"containers": [container]}})

    def set_status(self, ns: str, name: str, ip: str | None = "127.0.0.1", ready: bool = True,
                   phase: str = "Running") -> dict:
        """What a kubelet would write: the phase, the pod's IP and its Ready condition."""
        status: dict[str, Any] = {"phase": phase, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]}
        if ip:
            status.update(podIP=ip, podIPs=[{"ip": ip}])
        return self.call("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", {"status": status},
                         content_type="application/merge-patch+json")

    def patch_pod(self, ns: str, name: str, patch: dict) -> dict:
        return self.call("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}", patch,
                         content_type="application/merge-patch+json")

    def delete_pod(self, ns: str, name: str, grace: int | None = None) -> dict:
        query = "" if grace is None else f"?gracePeriodSeconds={grace}"
        return self.call("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}{query}")

    def release(self, ns: str, name: str) -> None:
        """Remove the HOLD finalizer: a deleted pod then goes."""
        self.patch_pod(ns, name, {"metadata": {"finalizers": None}})

    def pods(self, ns: str) -> list[dict]:
        return self.get(f"/api/v1/namespaces/{ns}/pods")["items"]


@contextlib.contextmanager
def running_cluster() -> Iterator[KubeCluster]:
    cluster = KubeCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
