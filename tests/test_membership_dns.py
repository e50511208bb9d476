"""The DNS membership source against a real DNS server (dnsmasq on 127.0.0.1, tests/dnsmasq.py) whose records
change while the test runs: instances appear and go, an empty answer counts only once confirmed, an outage of
any kind (server gone, silent, SERVFAIL, REFUSED) keeps the last known set, SRV gives ports and KV-event
endpoints, a short TTL shortens the wait, and a hundred instances fit in one answer.

Most tests drive the source's cycles one by one (`resolve`), so what each answer does is asserted exactly;
the ones about timing run the source's own loop (`run`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import pytest

from dnsmasq import Dnsmasq
from pdproxy.config import ConfigError, Settings, dns_nameservers, dns_queries, load_settings
from pdproxy.membership.dns import EMPTY_CONFIRMATIONS, DnsSource, from_settings
from pdproxy.membership.model import Member
from waits import scaled


class Published:
    """What the source published, in order."""

    def __init__(self) -> None:
        self.sets: list[frozenset[Member]] = []

    def __call__(self, members) -> None:
        self.sets.append(frozenset(members))

    @property
    def last(self) -> set[str]:
        return described(self.sets[-1]) if self.sets else set()


def described(members) -> set[str]:
    return {f"{m.role} {m.url}" + (f" kv {m.kv_events_endpoint}" if m.kv_events_endpoint else "") for m in members}


def source_for(server: Dnsmasq, interval: float = 0.2, timeout: float = 0.5, **settings) -> DnsSource:
    s = Settings(dns_server=[server.server], dns_interval=interval, **settings)
    return DnsSource(dns_queries(s), nameservers=dns_nameservers(s), interval=interval, timeout=timeout)


PD_HOSTS = {"prefill.test": ["127.0.0.2", "127.0.0.3"], "decode.test": ["127.0.0.4", "fd00::4"]}
PD_SET = {"prefill http://127.0.0.2:8100", "prefill http://127.0.0.3:8100", "decode http://127.0.0.4:8200",
          "decode http://[fd00::4]:8200"}


def test_instances_appear_and_go_with_their_a_and_aaaa_records() -> None:
    server = Dnsmasq(PD_HOSTS)
    source = source_for(server, dns_prefill=["prefill.test:8100"], dns_decode=["decode.test:8200"])

    async def main() -> None:
        published = Published()
        await source.resolve(published)
        assert published.last == PD_SET
        status = source.status()
        assert status["state"] == "ok" and status["last_error"] is None and status["instances"] == 4
        assert status["last_heard"] > time.time() - 5

        server.set_hosts({"prefill.test": ["127.0.0.3", "127.0.0.5"], "decode.test": ["127.0.0.4", "fd00::4"]})
        await source.resolve(published)  # one goes and one comes at once: a partial change is never held back
        assert published.last == PD_SET - {"prefill http://127.0.0.2:8100"} | {"prefill http://127.0.0.5:8100"}
        await source.resolve(published)
        assert len(published.sets) == 2, "an unchanged answer publishes nothing"

        server.set_hosts({"prefill.test": ["127.0.0.3", "127.0.0.5"], "decode.test": ["fd00::4"]})  # AAAA only
        await source.resolve(published)
        assert published.last == {"prefill http://127.0.0.3:8100", "prefill http://127.0.0.5:8100",
                                  "decode http://[fd00::4]:8200"}

    asyncio.run(main())
    server.stop()


def test_an_empty_answer_empties_a_name_only_when_repeated_over_two_intervals(caplog) -> None:
    """NXDOMAIN once (a DNS pod restarting) keeps every decode; three in a row spanning two intervals drop them."""
    caplog.set_level(logging.INFO, "pdproxy.membership.dns")
    server = Dnsmasq(PD_HOSTS)
    interval = 0.3
    source = source_for(server, interval=interval, dns_prefill=["prefill.test:8100"], dns_decode=["decode.test:8200"])
    without_decode = {"prefill.test": PD_HOSTS["prefill.test"]}

    async def main() -> None:
        published = Published()
        await source.resolve(published)
        assert published.last == PD_SET

        server.set_hosts(without_decode)  # decode.test: NXDOMAIN
        await source.resolve(published)
        assert published.last == PD_SET and len(published.sets) == 1
        assert [q["empty_answers"] for q in source.status()["names"] if q["role"] == "decode"] == [1, 1]
        server.set_hosts(PD_HOSTS)  # back: the odd answer was only that
        await source.resolve(published)
        assert len(published.sets) == 1 and all(q["empty_answers"] == 0 for q in source.status()["names"])

        server.set_hosts(without_decode)
        started = time.monotonic()
        for _ in range(EMPTY_CONFIRMATIONS + 2):  # the count alone is not enough: they must span two intervals
            await source.resolve(published)
        assert len(published.sets) == 1, "confirmed before two intervals passed"
        while published.last == PD_SET:
            assert time.monotonic() - started < scaled(5), source.status()
            await asyncio.sleep(interval / 3)
            await source.resolve(published)
        waited = time.monotonic() - started
        assert published.last == {"prefill http://127.0.0.2:8100", "prefill http://127.0.0.3:8100"}
        assert waited >= 2 * interval * 0.99, waited
        assert source.status()["state"] == "ok"

    asyncio.run(main())
    server.stop()
    said = caplog.text
    assert ("A decode.test answered NXDOMAIN (1 in a row); keeping its 1 instance(s) until the answer is confirmed"
            in said)
    assert "AAAA decode.test answered NXDOMAIN" in said and "times in a row: its 1 instance(s) are gone" in said


def test_no_outage_of_any_kind_shrinks_the_set(caplog) -> None:
    """Server stopped, silent (timeouts), SERVFAIL, REFUSED: every cycle keeps the last set and says why."""
    caplog.set_level(logging.INFO, "pdproxy.membership.dns")
    server = Dnsmasq(PD_HOSTS)
    timeout = 0.25
    source = source_for(server, timeout=timeout, dns_prefill=["prefill.test:8100"], dns_decode=["decode.test:8200"])

    async def main() -> None:
        published = Published()
        await source.resolve(published)
        assert published.last == PD_SET

        async def outage(expected: str, bound: float) -> None:
            started = time.monotonic()
            for _ in range(EMPTY_CONFIRMATIONS + 1):  # more cycles than an empty answer would need
                await source.resolve(published)
            took = (time.monotonic() - started) / (EMPTY_CONFIRMATIONS + 1)
            status = source.status()
            assert status["state"] == "degraded" and expected in status["last_error"], status
            assert all(q["state"] == "failed" for q in status["names"]) and status["instances"] == 4, status
            assert took < bound, (expected, took)

        server.stop()
        await outage(f"no answer within {timeout:g} s", bound=timeout + 0.3)  # nobody there: the datagrams vanish
        server.start()
        server.pause()
        await outage(f"no answer within {timeout:g} s", bound=timeout + 0.3)
        server.servfail()
        await outage("SERVFAIL from 127.0.0.1", bound=0.5)
        server.refuse()
        await outage("REFUSED from 127.0.0.1", bound=0.2)
        server.stop()
        server.start()
        await source.resolve(published)
        assert source.status()["state"] == "ok"
        assert published.sets == [published.sets[0]], "an outage changed the published set"

    asyncio.run(main())
    server.stop()
    queries = "A prefill.test, AAAA prefill.test, A decode.test, AAAA decode.test"
    assert (f"dns: {queries} failed (no answer within {timeout:g} s); keeping the last known set (4 instance(s))"
            in caplog.text)
    assert f"dns: {queries} failed (SERVFAIL from 127.0.0.1:{server.port})" in caplog.text
    assert f"dns: {queries} answer again" in caplog.text
    # logged when a failure starts or changes, not every cycle (stopped and silent both time out: one line)
    assert caplog.text.count(" failed (") == 3


def test_down_at_start_serves_the_static_set_then_follows_dns(caplog) -> None:
    caplog.set_level(logging.INFO, "pdproxy.membership.dns")
    server = Dnsmasq(PD_HOSTS)
    server.stop()  # its port, with nothing on it
    source = source_for(server, interval=0.1, timeout=0.2, dns_prefill=["prefill.test:8100"],
                        dns_decode=["decode.test:8200"])
    assert source.status() == {"state": "starting", "following": "prefill A prefill.test port 8100, decode A "
                               "decode.test port 8200", "nameservers": server.server, "interval": 0.1,
                               "last_error": None, "last_heard": None, "instances": 0, "names": []}

    async def main() -> None:
        published = Published()
        task = asyncio.create_task(source.run(published))
        try:
            deadline = time.monotonic() + scaled(5)
            while source.cycles < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            status = source.status()
            assert status["state"] == "degraded" and status["last_heard"] is None
            assert "no answer within 0.2 s" in status["last_error"] and published.sets == []
            await asyncio.to_thread(server.start)
            while not published.sets:
                assert time.monotonic() < deadline, source.status()
                await asyncio.sleep(0.05)
            assert published.last == PD_SET and source.status()["state"] == "ok"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    server.stop()
    assert "serving the static set until DNS answers" in caplog.text
    assert caplog.text.count("serving the static set") == 1


def test_srv_records_give_the_ports_and_the_kv_event_endpoints() -> None:
    """A headless Service with two named ports: _http._tcp for the HTTP port, _kv-events._tcp for the events, matched
    by SRV target (the pod), so two instances on one address (p0, p3) each get their own."""
    hosts = {"p0.prefill.test": ["127.0.0.2"], "p1.prefill.test": ["127.0.0.3", "fd00::3"],
             "d0.decode.test": ["127.0.0.4"], "p2.prefill.test": ["127.0.0.6"], "p3.prefill.test": ["127.0.0.2"]}
    srv = ["_http._tcp.prefill.test,p0.prefill.test,8100", "_http._tcp.prefill.test,p1.prefill.test,8101",
           "_kv-events._tcp.prefill.test,p0.prefill.test,5557", "_kv-events._tcp.prefill.test,p1.prefill.test,5558",
           "_http._tcp.decode.test,d0.decode.test,8200", "_http._tcp.prefill.test,p3.prefill.test,8103",
           "_kv-events._tcp.prefill.test,p3.prefill.test,5559"]
    server = Dnsmasq(hosts, srv=srv)
    source = source_for(server, dns_prefill=["prefill.test"], dns_decode=["_http._tcp.decode.test"],
                        dns_kv_events_port="kv-events")

    async def main() -> None:
        published = Published()
        await source.resolve(published)
        assert published.last == {"prefill http://127.0.0.2:8100 kv tcp://127.0.0.2:5557",
                                  "prefill http://127.0.0.2:8103 kv tcp://127.0.0.2:5559",
                                  "prefill http://127.0.0.3:8101 kv tcp://127.0.0.3:5558",
                                  "prefill http://[fd00::3]:8101 kv tcp://[fd00::3]:5558",
                                  "decode http://127.0.0.4:8200"}
        kinds = {(q["role"], q["query"], q["kind"]) for q in source.status()["names"]}
        assert ("prefill", "SRV _kv-events._tcp.prefill.test", "kv-events") in kinds
        assert ("decode", "SRV _kv-events._tcp.decode.test", "kv-events") in kinds  # asked, and empty

        # p1 goes, p2 comes without a kv-events port: its endpoint is left to the reconciler's template
        await asyncio.to_thread(server.set_srv, [s.replace("p1.", "p2.") for s in srv if "5558" not in s])
        await source.resolve(published)
        assert published.last == {"prefill http://127.0.0.2:8100 kv tcp://127.0.0.2:5557",
                                  "prefill http://127.0.0.2:8103 kv tcp://127.0.0.2:5559",
                                  "prefill http://127.0.0.6:8101", "decode http://127.0.0.4:8200"}

    asyncio.run(main())
    server.stop()


def test_a_short_ttl_shortens_the_wait() -> None:
    """Records with a 1 s TTL are asked again within about a second although the interval is 30 s."""
    server = Dnsmasq(PD_HOSTS, local_ttl=1)
    source = source_for(server, interval=30, dns_prefill=["prefill.test:8100"], dns_decode=["decode.test:8200"])

    async def main() -> None:
        published = Published()
        task = asyncio.create_task(source.run(published))
        try:
            deadline = time.monotonic() + scaled(5)
            while not published.sets:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            await asyncio.to_thread(server.set_hosts, {**PD_HOSTS, "prefill.test": ["127.0.0.9"]})
            changed = time.monotonic()
            while "prefill http://127.0.0.9:8100" not in published.last:
                assert time.monotonic() < deadline, source.status()
                await asyncio.sleep(0.02)
            assert time.monotonic() - changed < 1.0 + scaled(0.5)
            assert {q["ttl"] for q in source.status()["names"] if q["records"]} == {1.0}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    server.stop()


@pytest.mark.parametrize("count", [100, 300])
def test_a_hundred_and_more_instances_in_one_answer(count: int) -> None:
    """100 fit in one EDNS answer; 300 (4.8 kB) are truncated over UDP and fetched again over TCP."""
    server = Dnsmasq({"decode.test": [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(count)]})
    source = source_for(server, dns_decode=["decode.test:8200"])
    published = Published()
    asyncio.run(source.resolve(published))
    server.stop()
    assert len(published.last) == count and source.status()["state"] == "ok"


def test_settings_flags_and_their_one_line_errors() -> None:
    env = {"PDPROXY_DECODE": "http://d:1"}

    def load(**given) -> Settings:
        return load_settings(argparse.Namespace(**given), environ=env)

    s = load(dns_prefill=["vllm-prefill.default.svc.cluster.local"], dns_decode=["vllm-decode:8200", "_x._tcp.d."],
             dns_server=["10.96.0.10", "127.0.0.1:5353", "[fd00::10]:53", "fd00::11"], dns_kv_events_port="kv-events")
    assert [tuple(q) for q in dns_queries(s)] == [
        ("prefill", "SRV", "_http._tcp.vllm-prefill.default.svc.cluster.local", None,
         "_kv-events._tcp.vllm-prefill.default.svc.cluster.local"),
        ("decode", "A", "vllm-decode", 8200, "_kv-events._tcp.vllm-decode"),
        ("decode", "SRV", "_x._tcp.d.", None, "_kv-events._tcp.d.")]
    assert dns_nameservers(s) == [("10.96.0.10", 53), ("127.0.0.1", 5353), ("fd00::10", 53), ("fd00::11", 53)]
    assert load_settings(argparse.Namespace(), environ={**env, "PDPROXY_DNS_DECODE": "a.test, b.test",
                                                        "PDPROXY_DNS_PORT": "8000"}).dns_decode == ["a.test", "b.test"]
    assert from_settings(load()) is None
    source = from_settings(s)
    assert source is not None and source.name == "dns" and source.status()["state"] == "starting"

    for given, error in [
        (dict(dns_decode=["10.0.0.5:8000"]), "'10.0.0.5' is not a DNS name"),
        (dict(dns_decode=["bad name.test"]), "is not a DNS name"),
        (dict(dns_decode=["d.test:http-"]), "is neither a number nor a Service port name"),
        (dict(dns_decode=["d.test:70000"]), "port 70000 is out of range"),
        (dict(dns_decode=["_http._tcp.d.test:80"]), "an SRV name carries its ports"),
        (dict(dns_decode=["d.test"], dns_port="8_0"), "--dns-port: port '8_0' is neither"),
        (dict(dns_interval=0), "dns-interval must be > 0"),
        (dict(dns_server=["dns.example"]), "--dns-server 'dns.example' is not an IP address"),
        (dict(dns_server=["127.0.0.1:x"]), "port 'x' is not a number"),
        (dict(dns_kv_events_port="5557"), "--dns-kv-events-port '5557' is not a port name"),
    ]:
        with pytest.raises(ConfigError, match=".*") as raised:
            load(**given)
        assert error in str(raised.value) and "\n" not in str(raised.value), (given, raised.value)


def test_without_dns_server_resolv_conf_gives_the_search_list_and_a_missing_one_is_reported(tmp_path) -> None:
    """As in a pod: a short name is completed by resolv.conf's search list (there, `<ns>.svc.cluster.local`)."""
    import dns.nameserver

    server = Dnsmasq(PD_HOSTS)
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 127.0.0.1\nsearch elsewhere.test test\noptions ndots:2\n")
    s = Settings(dns_prefill=["prefill:8100"], dns_decode=["decode.test.:8200"])
    source = DnsSource(dns_queries(s), interval=0.2, timeout=0.5, resolv_conf=str(conf))
    resolver = source._get_resolver()
    assert resolver is not None and [str(n) for n in resolver.search] == ["elsewhere.test.", "test."]
    resolver.nameservers = [dns.nameserver.Do53Nameserver("127.0.0.1", server.port)]  # resolv.conf has no ports
    published = Published()
    asyncio.run(source.resolve(published))
    server.stop()
    assert published.last == PD_SET and source.status()["state"] == "ok"

    missing = DnsSource(dns_queries(s), interval=0.2, resolv_conf=str(tmp_path / "absent"))
    asyncio.run(missing.resolve(published))
    status = missing.status()
    assert status["state"] == "degraded" and f"cannot read {tmp_path / 'absent'}" in status["last_error"]
