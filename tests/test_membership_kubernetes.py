"""The Kubernetes source (pdproxy/membership/kubernetes.py) against a real kube-apiserver on a real etcd.

The control plane is built from Go modules and started once per session (tests/kube.py; conftest's
`kube_apiserver`); each test has a namespace of its own and plays the kubelet itself (pod IP, phase, Ready).
A scripted API server (tests/fake_kube.py) gives what a real one will not on demand: 410 Gone, a silent
watch, 403. Each test measures how long the source took to see a change; a bound on it is only there to end a
broken run.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from fake_kube import FakeKube, Forwarder
from procs import HOST, free_port
from waits import scaled

from pdproxy.config import ConfigError, load_settings
from pdproxy.cli import build_parser
from pdproxy.membership.kubernetes import (BOOTSTRAP_ANNOTATION, KV_EVENTS_ANNOTATION, KV_REPLAY_ANNOTATION,
                                           PORT_ANNOTATION, Cluster, KubeError, KubernetesSource, find_cluster,
                                           from_kubeconfig, from_settings, pod_member)
from pdproxy.membership.model import Member

REPO = Path(__file__).resolve().parents[1]
PREFILL = {"app": "vllm", "role": "prefill"}
DECODE = {"app": "vllm", "role": "decode"}


class Published:
    """The source's publish(): keeps every whole set it was given."""

    def __init__(self) -> None:
        self.sets: list[dict[tuple[str, str], Member]] = []

    def __call__(self, members) -> None:
        self.sets.append({m.key: m for m in members})

    @property
    def last(self) -> dict[tuple[str, str], Member]:
        return self.sets[-1] if self.sets else {}

    async def until(self, what: str, holds: Callable[[dict[tuple[str, str], Member]], bool],
                    timeout: float = 15.0) -> float:
        """Seconds until the last published set satisfies `holds`."""
        began = time.monotonic()
        deadline = began + scaled(timeout)
        while not holds(self.last):
            if time.monotonic() > deadline:
                raise AssertionError(f"not published within {scaled(timeout):.0f}s: {what}; last set: {self.last}")
            await asyncio.sleep(0.02)
        return time.monotonic() - began


async def until(what: str, holds: Callable[[], bool], timeout: float = 15.0) -> float:
    began = time.monotonic()
    while not holds():
        if time.monotonic() - began > scaled(timeout):
            raise AssertionError(f"not within {scaled(timeout):.0f}s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - began


class Running:
    """A source running as a task of the test's loop."""

    def __init__(self, source: KubernetesSource) -> None:
        self.source, self.published = source, Published()
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> Running:
        self.task = asyncio.create_task(self.source.run(self.published))
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.task is not None
        if self.task.done():
            self.task.result()  # the source must never end by itself: raise what ended it
            raise AssertionError("the source's run() returned")
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def kube_source(kube, ns: str | None, selectors=None, resync: float = 30.0, server: str | None = None,
                **kwargs) -> KubernetesSource:
    cluster = from_kubeconfig([kube.kubeconfig(server)])
    return KubernetesSource(selectors or {"prefill": PREFILL, "decode": DECODE}, namespace=ns, resync=resync,
                            cluster=cluster, backoff=(0.1, 0.5), **kwargs)


# ---------------------------------------------------------------------------------------------
# Against the real kube-apiserver


def test_pods_join_serve_drain_and_leave(kube_apiserver):
    """The life of a pod as the pools need it: no IP, no member; Ready serves; NotReady stays but out of
    rotation (no thrash); a deletion timestamp drains; relabelled or gone, it leaves. Ports and endpoints from
    annotations (prefill) and named container ports (decode)."""
    kube = kube_apiserver
    ns = kube.namespace()
    seen: dict[str, float] = {}

    async def scenario() -> None:
        async with Running(kube_source(kube, ns)) as run:
            pub = run.published
            p = await asyncio.to_thread(kube.create_pod, ns, "prefill-0", PREFILL, annotations={
                PORT_ANNOTATION: "8100", BOOTSTRAP_ANNOTATION: "8998", KV_EVENTS_ANNOTATION: "5557",
                KV_REPLAY_ANNOTATION: "5567"}, hold=True)
            d = await asyncio.to_thread(kube.create_pod, ns, "decode-0", DECODE,
                                        ports={"http": 8200, "kv-events": 5558, "kv-replay": 5568, "metrics": 9000})
            await until("both roles listed", lambda: run.source.status()["state"] == "ok")
            assert pub.last == {}, "a pod without an IP is no member"
            status = run.source.status()
            assert status["roles"]["prefill"]["without_member"] == {f"{ns}/prefill-0": "no IP yet"}

            async def change(what: str, call, *args, holds) -> None:
                """Make a change as a kubelet or an operator would; how long until it is published."""
                began = time.monotonic()
                await asyncio.to_thread(call, ns, *args)
                await pub.until(what, holds)
                seen[what] = max(seen.get(what, 0.0), time.monotonic() - began)

            await asyncio.to_thread(kube.set_status, ns, "prefill-0", "127.0.0.2")
            await change("Ready", kube.set_status, "decode-0", "127.0.0.3",
                         holds=lambda s: len(s) == 2 and all(m.ready for m in s.values()))
            prefill = pub.last[("prefill", "http://127.0.0.2:8100")]
            assert prefill == Member("prefill", "http://127.0.0.2:8100", "tcp://127.0.0.2:5557", "tcp://127.0.0.2:5567",
                                     8998, p["metadata"]["uid"], True, False)
            decode = pub.last[("decode", "http://127.0.0.3:8200")]
            assert decode == Member("decode", "http://127.0.0.3:8200", "tcp://127.0.0.3:5558", "tcp://127.0.0.3:5568",
                                    None, d["metadata"]["uid"], True, False), "bootstrap ports are prefills' only"

            # readiness flaps: the member stays, out of rotation, and comes back; nothing else changes
            sets_before = len(pub.sets)
            for _ in range(3):
                await change("NotReady", kube.set_status, "decode-0", "127.0.0.3", False,
                             holds=lambda s: not s[decode.key].ready)
                assert set(pub.last) == {prefill.key, decode.key}
                await change("Ready again", kube.set_status, "decode-0", "127.0.0.3", True,
                             holds=lambda s: s[decode.key].ready)
            assert len(pub.sets) - sets_before == 6, "one publish per readiness change, no more"

            # deleted with a grace period: terminating (drained), still there until it is gone
            await change("terminating", kube.delete_pod, "prefill-0", 30,
                         holds=lambda s: s.get(prefill.key, prefill).terminating)
            assert pub.last[prefill.key].identity == prefill.identity
            await change("deleted", kube.release, "prefill-0", holds=lambda s: prefill.key not in s)

            # relabelled out of the selector: gone; back in: back
            await change("relabelled away", kube.patch_pod, "decode-0", {"metadata": {"labels": {"role": "other"}}},
                         holds=lambda s: s == {})
            await change("relabelled back", kube.patch_pod, "decode-0", {"metadata": {"labels": {"role": "decode"}}},
                         holds=lambda s: list(s) == [decode.key])

            # a pod that failed (an eviction) is dropped even though it keeps its IP
            await asyncio.to_thread(kube.set_status, ns, "decode-0", "127.0.0.3", False, "Failed")
            await pub.until("failed pod dropped", lambda s: s == {})
            status = run.source.status()
            assert status["state"] == "ok" and status["last_error"] is None
            assert status["roles"]["decode"]["lists"] == 1, "all of it from one list and its watch"

    asyncio.run(scenario())
    print("API call to published, slowest of each kind (s):", {k: round(v, 3) for k, v in seen.items()})
    assert max(seen.values()) < scaled(5)


def test_a_pod_deleted_while_the_watch_was_cut_is_dropped_after_the_relist(kube_apiserver):
    """production-stack #1091: the watch drops, a pod is deleted and another created meanwhile; once the API
    server is reachable again, a list (not only a watch resumed) brings the set back in step."""
    kube = kube_apiserver
    ns = kube.namespace()

    async def scenario() -> None:
        relay = Forwarder((HOST, kube.port))
        await relay.start()
        for name, ip in (("decode-0", "127.0.0.4"), ("decode-1", "127.0.0.5")):
            await asyncio.to_thread(kube.create_pod, ns, name, DECODE, ports={"http": 8000})
            await asyncio.to_thread(kube.set_status, ns, name, ip)
        source = kube_source(kube, ns, {"decode": DECODE}, server=f"https://{HOST}:{relay.port}")
        async with Running(source) as run:
            pub = run.published
            await pub.until("both decodes", lambda s: len(s) == 2)
            lists = source.status()["roles"]["decode"]["lists"]
            await relay.cut()
            await until("the source sees the cut", lambda: source.status()["state"] == "degraded")
            assert "unreachable" in source.status()["last_error"]
            await asyncio.to_thread(kube.delete_pod, ns, "decode-1", 0)
            await asyncio.to_thread(kube.create_pod, ns, "decode-2", DECODE, ports={"http": 8000})
            await asyncio.to_thread(kube.set_status, ns, "decode-2", "127.0.0.6")
            await asyncio.sleep(0.3)
            assert set(pub.last) == {("decode", "http://127.0.0.4:8000"), ("decode", "http://127.0.0.5:8000")}, \
                "while cut off, the last known set stays"
            await relay.start()
            took = await pub.until("deleted pod dropped, new one in", lambda s: set(s) == {
                ("decode", "http://127.0.0.4:8000"), ("decode", "http://127.0.0.6:8000")})
            status = source.status()
            assert status["state"] == "ok" and status["roles"]["decode"]["lists"] > lists
            print(f"back in step {took:.2f} s after the API server was reachable again")
            await relay.cut()

    asyncio.run(scenario())


def test_api_server_down_at_start_then_up(kube_apiserver, caplog):
    """Nothing answers at start: the source says so (degraded, the error, one warning), publishes nothing (the
    static instances serve), and follows the pods once the API server answers."""
    kube = kube_apiserver
    ns = kube.namespace()
    caplog.set_level(logging.DEBUG, logger="pdproxy.membership.kubernetes")

    async def scenario() -> None:
        await asyncio.to_thread(kube.create_pod, ns, "decode-0", DECODE, ports={"http": 8000})
        await asyncio.to_thread(kube.set_status, ns, "decode-0", "127.0.0.7")
        relay = Forwarder((HOST, kube.port))  # not started: nothing listens on its port yet
        source = kube_source(kube, ns, {"decode": DECODE}, server=f"https://{HOST}:{relay.port}")
        async with Running(source) as run:
            await until("a few failed attempts", lambda: source.roles["decode"].failures >= 3)
            status = source.status()
            assert status["state"] == "degraded" and "unreachable" in status["last_error"], status
            assert not status["roles"]["decode"]["listed"] and run.published.sets == []
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and "the instances given as flags serve" in warnings[0].getMessage(), warnings
            await relay.start()
            took = await run.published.until("the pod, once the API server answers",
                                             lambda s: list(s) == [("decode", "http://127.0.0.7:8000")])
            assert source.status()["state"] == "ok"
            assert any("answers again" in r.getMessage() for r in caplog.records)
            print(f"pod published {took:.2f} s after the API server became reachable")
            await relay.cut()

    asyncio.run(scenario())


def test_a_selector_matching_nothing_warns(kube_apiserver, caplog):
    kube = kube_apiserver
    ns = kube.namespace()
    caplog.set_level(logging.WARNING, logger="pdproxy.membership.kubernetes")

    async def scenario() -> None:
        await asyncio.to_thread(kube.create_pod, ns, "decode-0", DECODE, ports={"http": 8000})
        await asyncio.to_thread(kube.set_status, ns, "decode-0", "127.0.0.8")
        typo = {"app": "vlm", "role": "decode"}
        async with Running(kube_source(kube, ns, {"decode": typo}, resync=0.5)) as run:
            await until("two lists", lambda: run.source.roles["decode"].lists >= 2)
            status = run.source.status()
            assert status["state"] == "ok" and status["roles"]["decode"]["members"] == 0
            assert run.published.sets in ([], [{}])
        warned = [r.getMessage() for r in caplog.records if "matches" in r.getMessage()]
        assert len(warned) == 1, "once, not at every re-list"
        assert f"no pod in namespace {ns} matches the decode selector app=vlm,role=decode" in warned[0]

    asyncio.run(scenario())


def test_every_namespace_and_both_roles_one_pod(kube_apiserver):
    """No namespace given: every namespace (vllm-router's default). A pod both selectors match is in both pools
    (a kv_both instance); --service-discovery-port gives the port when no annotation does."""
    kube = kube_apiserver
    ns = kube.namespace()
    both = {"app": "both-" + ns}

    async def scenario() -> None:
        await asyncio.to_thread(kube.create_pod, ns, "both-0", both)
        await asyncio.to_thread(kube.set_status, ns, "both-0", "127.0.0.9")
        source = kube_source(kube, None, {"prefill": both, "decode": both}, port=8300)
        async with Running(source) as run:
            await run.published.until("in both pools", lambda s: set(s) == {
                ("prefill", "http://127.0.0.9:8300"), ("decode", "http://127.0.0.9:8300")})
            assert source.status()["following"] == f"prefill pods app=both-{ns}, decode pods app=both-{ns} in every " \
                "namespace"

    asyncio.run(scenario())


def test_the_discovery_overlay_runs_with_exactly_the_access_its_role_grants(kube_apiserver, tmp_path, monkeypatch):
    """deploy/k8s/overlays/discovery applied to the real API server (RBAC on): pdproxy's ServiceAccount, with a
    token mounted as a kubelet would, runs the source from the Deployment's own arguments and finds the vLLM
    namespace's pods; the same account is refused (403, and told why) in a namespace its Role does not cover."""
    kubectl = shutil.which("kubectl") or pytest.skip("kubectl (with its built-in kustomize) not installed")
    built = subprocess.run([kubectl, "kustomize", str(REPO / "deploy/k8s/overlays/discovery")], capture_output=True,
                           text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    kube = kube_apiserver
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pdproxy"]
    spec = deployment["spec"]["template"]["spec"]
    rbac = [d for d in docs if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    for obj in rbac:
        kube.namespace(obj["metadata"]["namespace"])
        kube.create(obj)
    account = next(d for d in rbac if d["kind"] == "ServiceAccount")["metadata"]
    assert spec["serviceAccountName"] == account["name"]
    # the account's token and the cluster's CA where a kubelet mounts them, and the in-cluster environment
    mounted = tmp_path / "serviceaccount"
    mounted.mkdir()
    (mounted / "token").write_text(kube.token(account["namespace"], account["name"]))
    (mounted / "ca.crt").write_bytes(kube.ca.read_bytes())
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", HOST)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(kube.port))
    monkeypatch.setattr("pdproxy.membership.kubernetes.SERVICE_ACCOUNT", mounted)
    argv = [a.replace("$(PDPROXY_RUN_LABEL)", "production") for a in spec["containers"][0]["args"]]
    source = from_settings(serve_settings(*argv[1:]))
    assert source.cluster.origin.startswith("in-cluster") and source.namespace == "vllm"
    source.resync, source.backoff = 30.0, (0.1, 0.5)
    kube.create_pod("vllm", "vllm-decode-0", {"app": "vllm", "role": "decode"}, ports={"http": 8000})
    kube.set_status("vllm", "vllm-decode-0", "127.0.0.10")
    elsewhere = KubernetesSource({"decode": DECODE}, namespace=kube.namespace(), cluster=source.cluster,
                                 backoff=(0.1, 0.5))

    async def scenario() -> None:
        async with Running(source) as run, Running(elsewhere) as refused:
            await run.published.until("the vLLM namespace's decode pod",
                                      lambda s: list(s) == [("decode", "http://127.0.0.10:8000")])
            assert source.status()["state"] == "ok"
            await until("refused elsewhere", lambda: elsewhere.status()["state"] == "degraded")
            error = elsewhere.status()["last_error"]
            assert error.startswith("403") and 'cannot list resource "pods"' in error and "needs get, list and " \
                "watch on pods" in error, error
            assert refused.published.sets == []

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------
# Faults a real API server does not give on demand


def fake_source(fake: FakeKube, resync: float = 30.0, selectors=None) -> KubernetesSource:
    return KubernetesSource(selectors or {"decode": {"role": "decode"}}, namespace="default", resync=resync,
                            cluster=Cluster(fake.url), backoff=(0.05, 0.2))


@pytest.mark.parametrize("how", ["gone-status", "gone-event"])
def test_410_gone_relists(how):
    """The watch's resourceVersion is too old (410, as the status of the request or as an ERROR event in the
    stream): the source lists again, and a pod removed meanwhile goes."""

    async def scenario() -> None:
        async with FakeKube() as fake:
            fake.put("a", "127.0.0.11")
            fake.put("b", "127.0.0.12")
            fake.watch_mode = how  # every watch: 410
            async with Running(fake_source(fake)) as run:
                await run.published.until("a and b", lambda s: len(s) == 2)
                await until("410 seen", lambda: run.source.roles["decode"].gone >= 1)
                fake.remove("b", notify=False)  # no watch can tell: only a list shows it
                await run.published.until("b dropped", lambda s: list(s) == [("decode", "http://127.0.0.11:80")])
                kinds = [kind for kind, _ in fake.requests]
                assert kinds[0] == "list" and all(b == "list" for a, b in zip(kinds, kinds[1:]) if a == "watch"), \
                    f"a list after every 410: {kinds}"
                assert all(w["resourceVersion"] for w in fake.watches()), "every watch from the list's version"
                assert run.source.status()["state"] == "ok", "410 is routine, not a failure"
                # a 410 at once after each list is retried with a back-off, not in a tight loop
                lists = fake.lists()
                await asyncio.sleep(1.0)
                assert fake.lists() - lists <= 12, fake.lists() - lists

    asyncio.run(scenario())


def test_a_silent_watch_is_restarted():
    """A watch that sends nothing and never closes (a dead connection, a stuck proxy) lives at most one resync
    period: then the source lists again and sees what it missed."""
    resync = 1.0

    async def scenario() -> None:
        async with FakeKube() as fake:
            fake.put("a", "127.0.0.11")
            fake.put("b", "127.0.0.12")
            fake.watch_mode = "silent"
            async with Running(fake_source(fake, resync=resync)) as run:
                await run.published.until("a and b", lambda s: len(s) == 2)
                began = time.monotonic()
                fake.remove("b", notify=False)
                await run.published.until("b dropped", lambda s: len(s) == 1, timeout=resync * 5)
                took = time.monotonic() - began
                assert took <= resync + scaled(1.0), took
                assert len(fake.watches()) >= 2
                print(f"silent watch restarted, missed delete seen after {took:.2f} s (resync {resync} s)")

    asyncio.run(scenario())


def test_an_address_taken_over_by_a_new_pod_while_the_old_one_terminates():
    """A StatefulSet pod recreated, or an IP reused: two pods at one URL, the old one terminating. The instance is
    the new pod (its UID, not draining), and stays when the old one goes."""

    async def scenario() -> None:
        async with FakeKube() as fake:
            fake.put("old", "127.0.0.11", uid="uid-old")
            async with Running(fake_source(fake)) as run:
                key = ("decode", "http://127.0.0.11:80")
                await run.published.until("the old pod", lambda s: s.get(key) and s[key].identity == "uid-old")
                fake.put("old", "127.0.0.11", uid="uid-old", deleting=True)
                await run.published.until("the old pod terminating", lambda s: s[key].terminating)
                fake.put("new", "127.0.0.11", uid="uid-new", ready=False)
                await run.published.until("the new pod, not yet ready", lambda s: s[key].identity == "uid-new")
                assert not run.published.last[key].terminating
                fake.put("new", "127.0.0.11", uid="uid-new")
                fake.remove("old")
                await run.published.until("the new pod, Ready", lambda s: s[key].ready)
                assert list(run.published.last) == [key] and run.published.last[key].identity == "uid-new"

    asyncio.run(scenario())


def test_forbidden_says_what_the_role_needs(caplog):
    caplog.set_level(logging.WARNING, logger="pdproxy.membership.kubernetes")

    async def scenario() -> None:
        async with FakeKube() as fake:
            fake.refuse = 403
            async with Running(fake_source(fake)) as run:
                await until("refused", lambda: run.source.status()["state"] == "degraded")
                error = run.source.status()["last_error"]
                assert error.startswith("403 pods is forbidden") and "get, list and watch on pods in namespace " \
                    "default" in error, error
                fake.refuse = None
                fake.put("a", "127.0.0.11")
                await run.published.until("a, once allowed", lambda s: len(s) == 1)
                assert run.source.status()["state"] == "ok"

    asyncio.run(scenario())


def test_a_bad_annotation_leaves_the_pod_out_with_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="pdproxy.membership.kubernetes")

    async def scenario() -> None:
        async with FakeKube() as fake:
            fake.put("a", "127.0.0.11", annotations={PORT_ANNOTATION: "eighty"})
            fake.put("b", "127.0.0.12")
            async with Running(fake_source(fake, resync=0.3)) as run:
                await run.published.until("b only", lambda s: list(s) == [("decode", "http://127.0.0.12:80")])
                await until("re-listed", lambda: fake.lists() >= 3)
                assert run.source.status()["roles"]["decode"]["without_member"] == {
                    "default/a": "annotation pdproxy.io/port 'eighty' is not a port number"}
        warned = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
        assert len(warned) == 1, warned

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------
# Pods, credentials and flags, without a server


def pod(ip="10.0.0.5", phase="Running", ready=True, annotations=None, ports=None, deleting=False) -> dict:
    meta = {"name": "p", "namespace": "ns", "uid": "u-1", "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    return {"metadata": meta,
            "spec": {"containers": [{"name": "c", "ports": [{"name": n, "containerPort": p}
                                                            for n, p in (ports or {}).items()]}]},
            "status": {"phase": phase, "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_pod_member_ports_and_states():
    # the HTTP port: annotation, then the flag, then the container port named http, then 80
    assert pod_member(pod(annotations={PORT_ANNOTATION: "9000"}, ports={"http": 8000}), "decode", 7000).member.url \
        == "http://10.0.0.5:9000"
    assert pod_member(pod(ports={"http": 8000}), "decode", 7000).member.url == "http://10.0.0.5:7000"
    assert pod_member(pod(ports={"http": 8000}), "decode").member.url == "http://10.0.0.5:8000"
    assert pod_member(pod(), "decode").member.url == "http://10.0.0.5:80"
    # IPv6 pod IPs in brackets, in the URL and the endpoints
    m = pod_member(pod(ip="fd00::5", ports={"http": 8000, "kv-events": 5557}), "decode").member
    assert (m.url, m.kv_events_endpoint) == ("http://[fd00::5]:8000", "tcp://[fd00::5]:5557")
    # states
    assert pod_member(pod(ready=False), "decode").member.ready is False
    assert pod_member(pod(phase="Pending", ready=True), "decode").member.ready is False
    assert pod_member(pod(deleting=True), "decode").member.terminating is True
    assert pod_member(pod(ip=None), "decode").why_not == "no IP yet"
    assert pod_member(pod(phase="Failed"), "decode").why_not == "phase Failed"
    assert pod_member(pod(annotations={BOOTSTRAP_ANNOTATION: "none"}), "prefill").member.bootstrap_port is None
    assert "not a port number" in pod_member(pod(annotations={KV_EVENTS_ANNOTATION: "70000"}), "decode").why_not
    assert "bootstrap_port" in pod_member(pod(annotations={BOOTSTRAP_ANNOTATION: "x"}), "prefill").why_not


def test_credentials(tmp_path: Path):
    # in a pod: the service account's token (re-read each time) and CA
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("t1\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "HOME": str(tmp_path)}
    cluster = find_cluster(env, service_account=sa)
    assert cluster.server == "https://10.96.0.1:443" and cluster.headers() == {"Authorization": "Bearer t1"}
    (sa / "token").write_text("t2")
    assert cluster.headers() == {"Authorization": "Bearer t2"}, "a rotated token is used"
    # nowhere
    with pytest.raises(KubeError, match="no Kubernetes credentials"):
        find_cluster({"HOME": str(tmp_path)}, service_account=tmp_path / "none")
    # a kubeconfig: KUBECONFIG first; `kubectl proxy` (http, no user); relative paths from the file's folder
    config = tmp_path / "config"
    config.write_text("""
apiVersion: v1
kind: Config
current-context: proxy
clusters:
- {name: local, cluster: {server: "http://127.0.0.1:8001/"}}
users:
- {name: tok, user: {tokenFile: tok.txt}}
- {name: sso, user: {exec: {command: aws}}}
contexts:
- {name: proxy, context: {cluster: local, user: tok}}
- {name: eks, context: {cluster: local, user: sso}}
""")
    (tmp_path / "tok.txt").write_text("abc")
    cluster = find_cluster({**env, "KUBECONFIG": str(config)}, service_account=sa)
    assert cluster.server == "http://127.0.0.1:8001" and cluster.headers() == {"Authorization": "Bearer abc"}
    config.write_text(config.read_text().replace("current-context: proxy", "current-context: eks"))
    with pytest.raises(KubeError, match="exec or auth-provider plugin.*kubectl proxy"):
        from_kubeconfig([config])
    config.write_text("current-context: nowhere\n")
    with pytest.raises(KubeError, match="no current context named 'nowhere'"):
        from_kubeconfig([config])


def serve_settings(*argv: str, environ=None):
    argv = ("serve", *argv)
    return load_settings(build_parser(list(argv)).parse_args(list(argv)), environ=environ or {})


def test_vllm_router_flags(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "k"))
    (tmp_path / "k").write_text("current-context: c\nclusters: [{name: x, cluster: {server: 'http://127.0.0.1:1'}}]\n"
                                "contexts: [{name: c, context: {cluster: x}}]\n")
    s = serve_settings("--service-discovery", "--prefill-selector", "app=vllm", "role=prefill",
                       "--decode-selector", "app=vllm", "role=decode", "--service-discovery-namespace", "vllm",
                       "--service-discovery-port", "8000")
    assert (s.prefill_urls, s.decode_urls, s.mode) == ([], [], "pd"), "no toy-proxy defaults beside discovery"
    source = from_settings(s)
    assert {r: v.selector for r, v in source.roles.items()} == {"prefill": "app=vllm,role=prefill",
                                                                "decode": "app=vllm,role=decode"}
    assert (source.namespace, source.port, source.resync) == ("vllm", 8000, 60.0)
    single = serve_settings("--service-discovery", environ={"PDPROXY_SELECTOR": "app=vllm,role=single"})
    assert single.mode == "single" and list(from_settings(single).roles) == ["decode"]
    assert from_settings(serve_settings("--decode", "http://127.0.0.1:8200")) is None
    # selectors without --service-discovery do nothing, as in vllm-router: accepted, and the log says so
    with caplog.at_level(logging.WARNING, logger="pdproxy.membership.kubernetes"):
        assert from_settings(serve_settings("--decode", "http://127.0.0.1:8200", "--decode-selector", "a=b")) is None
    assert "--decode-selector given without --service-discovery" in caplog.text
    # with static instances beside it: both stay
    mixed = serve_settings("--service-discovery", "--decode-selector", "app=vllm", "--prefill", "http://10.0.0.1:8100")
    assert mixed.prefill_urls == ["http://10.0.0.1:8100"] and mixed.mode == "pd"
    for argv, error in [
        (["--service-discovery"], "--service-discovery needs --prefill-selector and --decode-selector"),
        (["--service-discovery", "--selector", "app!=x"], "only equality selectors"),
        (["--service-discovery", "--selector", "app==x"], "only equality selectors"),
        (["--service-discovery", "--selector", "app=x y"], "must be a label value"),
        (["--service-discovery", "--selector", "app"], "is not KEY=VALUE"),
        (["--service-discovery", "--prefill-selector", "a=b"], "no decode instance"),
        (["--service-discovery", "--selector", "a=b", "--decode-selector", "c=d"], "--selector finds single-mode"),
        (["--service-discovery", "--selector", "a=b", "--service-discovery-namespace", "Vllm"], "not a namespace"),
        (["--service-discovery", "--selector", "a=b", "--service-discovery-port", "0"], "--service-discovery-port"),
    ]:
        with pytest.raises(ConfigError, match=error):
            serve_settings(*argv)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="--service-discovery: cannot read kubeconfig"):
        from_settings(s)


# ---------------------------------------------------------------------------------------------
# End to end: pdproxy serve following the pods while requests flow


def test_serve_follows_the_pods_while_requests_flow(kube_apiserver, started):
    """`pdproxy serve --service-discovery ...` (vllm-router's launch line) on the real API server, its pods
    pointing at simulated vLLM instances: requests reach a decode pod once it is Ready, stop reaching one that is
    being deleted (drained through its grace period, then gone), and not one request fails."""
    import httpx

    from ledgers import counter
    from procs import pdproxy, start_sim
    from waits import Load, wait_until

    kube = kube_apiserver
    ns = kube.namespace()
    sims = {}
    for role, name in (("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")):
        proc, url = start_sim(role)
        started.append(proc)
        sims[name] = url
        kube.create_pod(ns, name, PREFILL if role == "prefill" else DECODE, hold=True,
                        annotations={PORT_ANNOTATION: url.rsplit(":", 1)[1]})
    address = {name: url.removeprefix("http://") for name, url in sims.items()}
    kube.set_status(ns, "prefill-0", HOST)
    kube.set_status(ns, "decode-0", HOST)
    kube.set_status(ns, "decode-1", HOST, ready=False)  # running, its readiness probe not passed yet
    port = free_port()
    proxy = pdproxy("serve", "--host", HOST, "--port", str(port), "--service-discovery",
                    "--service-discovery-namespace", ns, "--prefill-selector", "app=vllm", "role=prefill",
                    "--decode-selector", "app=vllm", "role=decode", "--health-check-interval", "0.5",
                    "--drain-timeout", "20", env={"KUBECONFIG": str(kube.kubeconfig())})
    started.append(proxy)
    url = f"http://{HOST}:{port}"
    proxy.wait_http(url + "/healthcheck")

    def states() -> dict[str, str]:
        body = httpx.get(url + "/status", timeout=5).json()
        return {i["url"]: i["state"] for role in ("prefill", "decode") for i in body["instances"][role]}

    def attempts(name: str) -> float:
        return counter(httpx.get(url + "/metrics", timeout=5).text, "pdproxy_instance_attempts_total",
                       role="decode", server_address=address[name])

    expected = {sims["prefill-0"]: "active", sims["decode-0"]: "active", sims["decode-1"]: "not_ready"}
    wait_until(lambda: states() == expected, "the Ready pods in rotation", timeout=20)
    source = httpx.get(url + "/status", timeout=5).json()["membership"]["sources"]["kubernetes"]
    assert source["state"] == "ok" and source["instances"] == 3, source

    def send(phase: str) -> int:
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "sim-model", "prompt": "hello there", "max_tokens": 24, "min_tokens": 24, "ignore_eos": True,
            "stream": True})
        return r.status_code if r.text.rstrip().endswith("data: [DONE]") else -r.status_code

    phases = ["one decode", "both decodes", "decode-0 leaving", "decode-0 gone"]
    with Load(send, phases) as a, Load(send, phases) as b:
        a.run_phase("one decode", 1.0, 5), b.end_phase("one decode", 5)
        assert attempts("decode-1") == 0, "not Ready: no request"
        for load in (a, b):
            load.enter("both decodes")
        began = time.monotonic()
        kube.set_status(ns, "decode-1", HOST, ready=True)
        wait_until(lambda: attempts("decode-1") > 0, "a request on decode-1 once Ready")
        to_first_request = time.monotonic() - began
        a.end_phase("both decodes", 5), b.end_phase("both decodes", 5)

        for load in (a, b):
            load.enter("decode-0 leaving")
        began = time.monotonic()
        kube.delete_pod(ns, "decode-0", 30)  # terminating: the finalizer holds it, as a grace period would
        wait_until(lambda: states().get(sims["decode-0"]) in ("draining", None), "decode-0 draining")
        to_drain = time.monotonic() - began
        wait_until(lambda: sims["decode-0"] not in states(), "decode-0 drained and removed", timeout=25)
        after_drain = attempts("decode-0")
        a.end_phase("decode-0 leaving", 3), b.end_phase("decode-0 leaving", 3)
        kube.release(ns, "decode-0")  # the pod goes

        for load in (a, b):
            load.enter("decode-0 gone")
        a.run_phase("decode-0 gone", 1.0, 5), b.end_phase("decode-0 gone", 5)
        assert attempts("decode-0") == after_drain, "no request after its drain"
    results = {p: a.results[p] + b.results[p] for p in phases}
    assert {p: [r for r in rs if r != 200] for p, rs in results.items()} == {p: [] for p in phases}, \
        "every request whole, none failed"
    metrics = httpx.get(url + "/metrics", timeout=5).text
    assert counter(metrics, "pdproxy_requests_total") == counter(metrics, "pdproxy_requests_total", code="200") \
        == sum(map(len, results.values()))
    assert counter(metrics, "pdproxy_instance_attempts_total", role="prefill", server_address=address["prefill-0"]) \
        >= sum(map(len, results.values())), "every request prefilled on the discovered prefill pod"
    assert counter(metrics, "pdproxy_membership_changes_total", source="kubernetes", kind="added") == 3
    assert counter(metrics, "pdproxy_membership_changes_total", source="kubernetes", kind="removed") == 1
    print(f"requests per phase: { {p: len(rs) for p, rs in results.items()} }; Ready to first request "
          f"{to_first_request:.2f} s, deletion to draining {to_drain:.2f} s")
    proxy.stop()
