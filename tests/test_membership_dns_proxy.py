"""`pdproxy serve` following DNS while requests flow (issue 53): simulated vLLM instances on 127.0.0.x (and one on
::1, by its AAAA record), a real dnsmasq whose records the test changes. Requests reach instances as DNS lists
them, stop reaching one DNS dropped, the DNS server's outage changes nothing, and no request fails."""

from __future__ import annotations

import json

import httpx

from dnsmasq import Dnsmasq
from ledgers import counter
from procs import HOST, free_port, pdproxy, start_proxy
from waits import Load, wait_until

PREFILL, DECODES = "127.0.0.2", ("127.0.0.3", "127.0.0.4", "::1")


def start_sims(port_p: int, port_d: int) -> dict[str, object]:
    """One prefill and three decodes, all started before any is waited for; keyed by address."""
    procs = {PREFILL: pdproxy("sim", "--role", "prefill", "--host", PREFILL, "--port", str(port_p),
                              "--model", "sim-model", name="sim-prefill")}
    for address in DECODES:
        procs[address] = pdproxy("sim", "--role", "decode", "--host", address, "--port", str(port_d),
                                 "--model", "sim-model", name="sim-decode")
    for address, proc in procs.items():
        proc.wait_http(f"{base(address, port_p if address == PREFILL else port_d)}/health")
    return procs


def base(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def served(url: str) -> float:
    """Requests an instance finished (its vLLM counter)."""
    return counter(httpx.get(url + "/metrics", timeout=5).text, "vllm:request_success_total")


def test_requests_follow_dns_as_instances_come_and_go_with_no_failure() -> None:
    port_p, port_d = free_port(), free_port()
    sims = start_sims(port_p, port_d)
    d3, d4, d6 = (base(a, port_d) for a in DECODES)
    server = Dnsmasq({"prefill.test": [PREFILL], "decode.test": ["127.0.0.3"]})
    proxy = None
    try:
        proxy, url = start_proxy("--dns-prefill", f"prefill.test:{port_p}", "--dns-decode", f"decode.test:{port_d}",
                                 "--dns-server", server.server, "--dns-interval", "0.2",
                                 "--health-check-interval", "0.3", "--drain-timeout", "5")

        def status() -> dict:
            return httpx.get(url + "/status", timeout=5).json()

        def active() -> set[str]:
            return {i["url"] for i in status()["instances"]["decode"] if i.get("state") == "active"}

        wait_until(lambda: active() == {d3}, "the first decode from DNS in rotation")
        assert status()["mode"] == "pd"

        def send(phase: str) -> int:
            r = httpx.post(url + "/v1/completions", timeout=30,
                           json={"model": "sim-model", "prompt": f"hello {phase}", "max_tokens": 4})
            return r.status_code

        with Load(send, ["one", "three", "two", "outage"]) as load:
            load.run_phase("one", 0.5, minimum=5)

            # two more decodes in DNS, one by its AAAA record
            before = {u: served(u) for u in (d4, d6)}
            server.set_hosts({"prefill.test": [PREFILL], "decode.test": ["127.0.0.3", "127.0.0.4", "::1"]})
            load.enter("three")
            wait_until(lambda: active() == {d3, d4, d6}, "the new decodes in rotation")
            load.run_phase("three", 1.0, minimum=12)
            assert all(served(u) > before[u] for u in (d4, d6)), "a new decode got no request"

            # d3 leaves DNS: drained, then removed; after that it gets nothing
            server.set_hosts({"prefill.test": [PREFILL], "decode.test": ["127.0.0.4", "::1"]})
            load.enter("two")
            wait_until(lambda: d3 not in {i["url"] for i in status()["instances"]["decode"]}, "d3 removed")
            gone_at = served(d3)
            load.run_phase("two", 1.0, minimum=8)
            assert served(d3) == gone_at, "a request went to the instance DNS dropped"

            # the DNS server stops: nothing changes, requests go on
            server.stop()
            load.enter("outage")
            wait_until(lambda: status()["membership"]["sources"]["dns"]["state"] == "degraded", "the outage seen")
            load.run_phase("outage", 1.0, minimum=8)
            assert active() == {d4, d6}

        codes = [c for phase in load.results.values() for c in phase]
        assert load.errors == [] and set(codes) == {200}, (load.errors[:3], sorted(set(map(str, codes))))
        dns_status = status()["membership"]["sources"]["dns"]
        assert "no answer within" in dns_status["last_error"] and dns_status["instances"] == 3
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert counter(metrics, "pdproxy_requests_total") == counter(metrics, "pdproxy_requests_total", code="200")
        assert counter(metrics, "pdproxy_membership_changes_total", source="dns", kind="added") == 4
        assert counter(metrics, "pdproxy_membership_changes_total", source="dns", kind="removed") == 1
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
        for proc in sims.values():
            proc.stop()
    log = proxy.output()
    # one start-up line for the source, saying what it follows
    assert f"membership source dns: state starting, following prefill A prefill.test port {port_p}, decode A " \
           f"decode.test port {port_d}, nameservers {server.server}" in log


def test_kv_event_endpoints_from_srv_are_followed_and_dropped_with_their_instance() -> None:
    """The Service's `kv-events` port (SRV) gives each instance's event endpoint: subscribed when the instance
    appears in DNS, closed when it leaves. Every sim is on 127.0.0.1: the SRV target (the pod) tells them apart."""
    names = ("p", "d1", "d2")
    http = {n: free_port() for n in names}
    pub = {n: free_port() for n in names}
    procs = []
    try:
        for n in names:
            config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"tcp://{HOST}:{pub[n]}"})
            procs.append(pdproxy("sim", "--role", "prefill" if n == "p" else "decode", "--host", HOST, "--port",
                                 str(http[n]), "--model", "sim-model", "--kv-events-config", config,
                                 "--time-scale", "0.05", name=f"sim-{n}"))
        for n, proc in zip(names, procs):
            proc.wait_http(f"http://{HOST}:{http[n]}/health")

        def srv(*decodes: str) -> list[str]:
            out = [f"_http._tcp.prefill.test,p.pods.test,{http['p']}",
                   f"_kv-events._tcp.prefill.test,p.pods.test,{pub['p']}"]
            for n in decodes:
                out += [f"_http._tcp.decode.test,{n}.pods.test,{http[n]}",
                        f"_kv-events._tcp.decode.test,{n}.pods.test,{pub[n]}"]
            return out

        server = Dnsmasq({f"{n}.pods.test": [HOST] for n in names}, srv=srv("d1"))
        procs.append(server)
        proxy, url = start_proxy("--dns-prefill", "prefill.test", "--dns-decode", "decode.test",
                                 "--dns-kv-events-port", "kv-events", "--dns-server", server.server,
                                 "--dns-interval", "0.2", "--policy", "precise_prefix",
                                 "--health-check-interval", "0.5", "--instance-series-retention", "1")
        procs.append(proxy)

        def kv() -> dict:
            return httpx.get(url + "/status", timeout=5).json()["kv_events"]

        address = {n: f"{HOST}:{http[n]}" for n in names}
        wait_until(lambda: all(kv().get(address[n], {}).get("flowing") for n in ("p", "d1")), "p and d1 followed")
        assert kv()[address["d1"]]["endpoint"] == f"tcp://{HOST}:{pub['d1']}"

        server.set_srv(srv("d1", "d2"))
        wait_until(lambda: kv().get(address["d2"], {}).get("flowing"), "d2's events followed once DNS lists it")
        server.set_srv(srv("d2"))
        wait_until(lambda: address["d1"] not in kv(), "d1's subscription closed once DNS dropped it")
        assert set(kv()) == {address["p"], address["d2"]}
    finally:
        for proc in reversed(procs):
            proc.stop()
