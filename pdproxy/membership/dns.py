"""Membership from DNS: a headless Service's records, asked again and again while the proxy runs.

A Kubernetes headless Service (`clusterIP: None`) publishes one A/AAAA record per ready pod under its name,
and, per named port, SRV records `_PORT._tcp.NAME` whose targets are the pods and whose port is the port. So
a name per role (`--dns-prefill`, `--dns-decode`) is the whole membership of that role, without RBAC, and
the same holds for any DNS that lists instances (Consul, a zone file, dnsmasq).

What an answer means here (docs/reference/membership.md, "DNS"):
- records: the role's instances from that name are exactly those, now. An answer that drops some instances
  but not all is applied at once: each goes through the reconciler's drain, which fails no request.
- a failure (timeout, SERVFAIL, REFUSED, the server down or unreachable): nothing is learnt; the last known
  set stays. A DNS outage never empties a pool, and a proxy started during one serves its static set.
- NXDOMAIN or no records: a real state (no pod ready: scaled to zero, every pod restarting), but also what a
  resolver answers for a moment when it is in a bad state (a DNS pod restarted before its view of the cluster
  is complete, a stale negative answer cached on the way). So an empty answer empties a name's set only when
  it is given EMPTY_CONFIRMATIONS (3) times in a row spanning at least two intervals from first to last: one
  odd answer never drops every instance, and a real scale-to-zero is followed within two intervals (10 s by
  default), far shorter than a pod's start. An empty A answer while the name's AAAA records list instances
  (or the reverse) is applied at once: the name is there, so it is no resolver's odd moment.
Each record type is judged on its own (A, AAAA, SRV, the KV-event SRV): a server that fails AAAA queries
(some middleboxes do) does not freeze the A records.

The client is dnspython (`dns.asyncresolver`), not aiodns: it is pure Python (nothing to build beside the
compiled wheel; aiodns stands on pycares, a C extension), keeps no cache unless asked (recent c-ares keeps one of
its own by default, c-ares PR 786: an answer could come from it, not from the server), returns the whole
response (the SRV targets' addresses in its additional section, the records' TTLs), tells NXDOMAIN, an empty
answer, SERVFAIL/REFUSED and a timeout apart (the rule above rests on that), takes a port per nameserver
(a test's server on a high port), and reads /etc/resolv.conf's nameservers, search list and ndots as a
pod's libc does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from pdproxy.config import DnsName, Settings, dns_nameservers, dns_queries
from pdproxy.membership.model import Member, MemberError, Publish, member

log = logging.getLogger("pdproxy.membership.dns")

# empty answers in a row (NXDOMAIN or no records) that empty a name's set: the first and two more
EMPTY_CONFIRMATIONS = 3
MIN_TTL_WAIT = 1.0  # a short TTL shortens the wait to the next resolution, never below this (TTL 0: "do not cache")
EDNS_PAYLOAD = 1232  # bytes of a UDP answer (the 2020 DNS flag day's size): ~70 A records; more go over TCP


class _Failed(Exception):
    """A question that got no usable answer (timeout, SERVFAIL, REFUSED, unreachable): nothing is learnt."""


@dataclass
class _Query:
    """One question asked every cycle, with what it last said. `values` are (address, port, SRV target or None):
    for an instance query its HTTP address, for a KV-event query the instance's event port."""

    role: str
    rdtype: str  # "A", "AAAA", "SRV" (instances) or "KV" (SRV of the KV-event port)
    qname: str
    port: int | None
    values: frozenset[tuple[str, int, str | None]] = frozenset()
    answered: bool = False  # has given an answer (records or empty) at least once
    empties: int = 0  # empty answers in a row while `values` still holds instances
    empty_since: float = 0.0  # monotonic time of the first of them
    error: str | None = None  # the last attempt's failure; None when it answered
    ttl: float | None = None
    heard: float | None = None  # wall-clock time of the last answer

    def describe(self) -> str:
        return f"{self.rdtype if self.rdtype != 'KV' else 'SRV'} {self.qname}"


@dataclass
class _Name:
    """A name given for a role: its instance queries and, maybe, its KV-event query."""

    spec: DnsName
    queries: list[_Query]
    kv: _Query | None = None


class DnsSource:
    """The instances that DNS names list, published as one desired set whenever it changes."""

    name = "dns"

    def __init__(self, names: list[DnsName], *, nameservers: list[tuple[str, int]] | None = None,
                 interval: float = 5.0, timeout: float | None = None, resolv_conf: str = "/etc/resolv.conf") -> None:
        self.interval = interval
        # one question's bound: a late answer would arrive after the next cycle began
        self.timeout = timeout if timeout is not None else max(0.5, min(2.0, interval / 2))
        self.nameservers = list(nameservers or [])
        self.resolv_conf = resolv_conf
        self.names: list[_Name] = []
        for spec in names:
            if spec.kind == "SRV":
                queries = [_Query(spec.role, "SRV", spec.qname, None)]
            else:
                queries = [_Query(spec.role, rdtype, spec.qname, spec.port) for rdtype in ("A", "AAAA")]
            kv = _Query(spec.role, "KV", spec.kv_events_qname, None) if spec.kv_events_qname else None
            self.names.append(_Name(spec, queries, kv))
        self._resolver: dns.asyncresolver.Resolver | None = None
        self._published: frozenset[Member] | None = None
        self._state = "starting"
        self._last_error: str | None = None
        self._resolver_error: str | None = None
        self._next_wait = interval
        self.cycles = 0

    # --- the Source protocol ---------------------------------------------------------------------------------

    async def run(self, publish: Publish) -> None:
        while True:
            await self.resolve(publish)
            await asyncio.sleep(self._next_wait)

    def status(self) -> dict[str, Any]:
        heard = [q.heard for q in self._queries() if q.heard is not None]
        # (start-up logs these fields that are set, as the source's one line: what it follows comes first, and
        # the questions' details only once they were asked)
        return {
            "state": self._state,
            "following": self._names_text(),
            "nameservers": self._servers_text(),
            "interval": self.interval,
            "last_error": self._last_error,
            "last_heard": max(heard) if heard else None,
            "instances": len(self._published or ()),
            "names": [self._query_status(q) for q in self._queries()] if self.cycles else [],
        }

    # --- one cycle ---------------------------------------------------------------------------------------------

    async def resolve(self, publish: Publish) -> None:
        """Ask every question once, update what each last said, and publish the whole set if it changed."""
        self.cycles += 1
        resolver = self._get_resolver()
        queries = self._queries()
        if resolver is None:
            outcomes: list[Any] = [_Failed(self._resolver_error)] * len(queries)
        else:
            outcomes = await asyncio.gather(*(self._ask(resolver, q) for q in queries), return_exceptions=True)
        now = time.time()
        errors_before = [q.error for q in queries]
        said = dict(zip(map(id, queries), outcomes))
        for name in self.names:
            # an empty A answer beside AAAA records (or the reverse) is the truth at once: the name still lists
            # instances, so it is no resolver's odd moment
            listed = any(isinstance(said[id(q)], tuple) and said[id(q)][0] for q in name.queries)
            for query in name.queries:
                self._learn(query, said[id(query)], now, confirmed=listed)
            if name.kv is not None:
                self._learn(name.kv, said[id(name.kv)], now, confirmed=False)
        desired = self._desired()
        answered = any(q.answered for q in queries)
        failures = [q for q in queries if q.error is not None]
        self._last_error = "; ".join(f"{q.describe()}: {q.error}" for q in failures) or None
        if not answered:
            if self._state != "degraded":
                log.warning("dns: no answer yet (%s); serving the static set until DNS answers", self._last_error)
            self._state = "degraded"
        else:
            self._state = "degraded" if failures else "ok"
            self._log_failures(queries, errors_before)
        if answered and desired != self._published:
            self._log_change(desired)
            self._published = desired
            publish(sorted(desired, key=lambda m: m.key))
        ttls = [q.ttl for q in queries if q.ttl is not None and q.error is None]
        self._next_wait = min(self.interval, max(min(ttls), MIN_TTL_WAIT)) if ttls else self.interval

    def _learn(self, query: _Query, outcome: Any, now: float, confirmed: bool) -> None:
        """Take one answer (values, ttl, why empty) or failure into what `query` last said."""
        if isinstance(outcome, asyncio.CancelledError):
            raise outcome
        if isinstance(outcome, BaseException):
            query.error = str(outcome) if isinstance(outcome, _Failed) else f"{type(outcome).__name__}: {outcome}"
            return
        values, ttl, why = outcome
        query.error, query.heard, query.ttl, query.answered = None, now, ttl, True
        if values:
            query.values, query.empties = values, 0
        elif query.values:
            query.empties += 1
            if query.empties == 1:
                query.empty_since = time.monotonic()
            if confirmed:
                log.info("dns: %s answered %s: its %d instance(s) are gone (the name lists others)",
                         query.describe(), why, len(query.values))
                query.values, query.empties = frozenset(), 0
            elif (query.empties >= EMPTY_CONFIRMATIONS
                  and time.monotonic() - query.empty_since >= (EMPTY_CONFIRMATIONS - 1) * self.interval * 0.99):
                log.warning("dns: %s answered %s %d times in a row: its %d instance(s) are gone", query.describe(),
                            why, query.empties, len(query.values))
                query.values, query.empties = frozenset(), 0
            else:
                log.warning("dns: %s answered %s (%d in a row); keeping its %d instance(s) until the answer is "
                            "confirmed", query.describe(), why, query.empties, len(query.values))

    def _desired(self) -> frozenset[Member]:
        out: set[Member] = set()
        for name in self.names:
            # an instance's KV-event port: the one its SRV target (its pod) has, else the one its address has;
            # none when that is ambiguous (two instances on one address), and the reconciler's template applies
            by_target: dict[str, set[int]] = {}
            by_address: dict[str, set[int]] = {}
            for address, port, target in name.kv.values if name.kv else ():
                by_address.setdefault(address, set()).add(port)
                if target is not None:
                    by_target.setdefault(target, set()).add(port)
            for query in name.queries:
                for address, port, target in query.values:
                    host = f"[{address}]" if ":" in address else address
                    ports = (by_target[target] if target is not None and target in by_target
                             else by_address.get(address, set()))
                    kv_port = next(iter(ports)) if len(ports) == 1 else None
                    try:
                        out.add(member(query.role, f"http://{host}:{port}",
                                       kv_events_endpoint=f"tcp://{host}:{kv_port}" if kv_port else None))
                    except MemberError as exc:  # cannot happen for an address and a port; never fail the loop
                        log.warning("dns: %s gave an unusable instance: %s", query.describe(), exc)
        return frozenset(out)

    # --- asking ------------------------------------------------------------------------------------------------

    async def _ask(self, resolver: dns.asyncresolver.Resolver, query: _Query
                   ) -> tuple[frozenset[tuple[str, int, str | None]], float | None, str]:
        """(values, ttl, why-empty) or raises _Failed."""
        if query.rdtype in ("A", "AAAA"):
            answer = await self._resolve(resolver, query.qname, query.rdtype, search=True)
            if answer is None or answer.rrset is None:
                return frozenset(), None, "NXDOMAIN" if answer is None else "no records"
            assert query.port is not None
            return frozenset((rr.address, query.port, None) for rr in answer.rrset), float(answer.rrset.ttl), ""
        answer = await self._resolve(resolver, query.qname, "SRV", search=True)
        if answer is None or answer.rrset is None:
            return frozenset(), None, "NXDOMAIN" if answer is None else "no records"
        ttl = float(answer.rrset.ttl)
        glue: dict[dns.name.Name, set[str]] = {}  # the targets' addresses a server adds (CoreDNS does)
        for rrset in answer.response.additional:
            if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                glue.setdefault(rrset.name, set()).update(rr.address for rr in rrset)
                ttl = min(ttl, float(rrset.ttl))
        records = [(rr.target, rr.port) for rr in answer.rrset if rr.target != dns.name.root]
        missing = sorted({target for target, _ in records if target not in glue})
        found = await asyncio.gather(*(self._addresses(resolver, target) for target in missing))
        glue.update(zip(missing, found))
        values = frozenset((address, port, str(target)) for target, port in records for address in glue[target])
        return values, ttl, "no addresses for its targets"

    async def _addresses(self, resolver: dns.asyncresolver.Resolver, target: dns.name.Name) -> set[str]:
        """An SRV target's addresses. A target that no longer exists has none (its pod went between the two
        answers); a failure of both families is the SRV question's failure."""
        outcomes = await asyncio.gather(*(self._resolve(resolver, target, rdtype, search=False)
                                          for rdtype in ("A", "AAAA")), return_exceptions=True)
        addresses = {rr.address for answer in outcomes
                     if isinstance(answer, dns.resolver.Answer) and answer.rrset is not None for rr in answer.rrset}
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures and not addresses:
            raise _Failed(f"target {target}: {failures[0]}")
        return addresses

    async def _resolve(self, resolver: dns.asyncresolver.Resolver, qname: Any, rdtype: str,
                       search: bool) -> dns.resolver.Answer | None:
        """The answer (rrset None when the name has no such records), None for NXDOMAIN, _Failed otherwise."""
        try:
            return await resolver.resolve(qname, rdtype, search=search and not self.nameservers,
                                          raise_on_no_answer=False)
        except dns.resolver.NXDOMAIN:
            return None
        except dns.resolver.NoNameservers as exc:
            raise _Failed(_server_errors(exc)) from None
        except dns.exception.Timeout:
            raise _Failed(f"no answer within {self.timeout:g} s") from None
        except (dns.exception.DNSException, OSError) as exc:
            raise _Failed(f"{type(exc).__name__}: {exc}") from None

    def _get_resolver(self) -> dns.asyncresolver.Resolver | None:
        """The resolver, made on first use: /etc/resolv.conf may be missing at start and appear later."""
        if self._resolver is None:
            try:
                if self.nameservers:
                    resolver = dns.asyncresolver.Resolver(configure=False)
                    resolver.nameservers = [dns.nameserver.Do53Nameserver(a, p) for a, p in self.nameservers]
                    resolver.domain = dns.name.root  # names are asked as given, never under this host's domain
                else:
                    resolver = dns.asyncresolver.Resolver(filename=self.resolv_conf)
            except (dns.exception.DNSException, OSError) as exc:
                self._resolver_error = f"cannot read {self.resolv_conf}: {exc}"
                return None
            # the whole question within `timeout`, time left for a second nameserver when the first is silent
            resolver.lifetime = self.timeout
            resolver.timeout = self.timeout / max(1, len(resolver.nameservers))
            resolver.use_edns(0, 0, EDNS_PAYLOAD)
            resolver.cache = None  # each cycle asks the server: membership is what the server says now
            self._resolver = resolver
        return self._resolver

    # --- reporting ---------------------------------------------------------------------------------------------

    def _queries(self) -> list[_Query]:
        return [q for name in self.names for q in (*name.queries, *([name.kv] if name.kv else []))]

    def _query_status(self, q: _Query) -> dict[str, Any]:
        return {"role": q.role, "query": q.describe(), "kind": "kv-events" if q.rdtype == "KV" else "instances",
                "records": len(q.values), "state": "failed" if q.error else "ok" if q.answered else "starting",
                "last_error": q.error, "empty_answers": q.empties, "ttl": q.ttl, "last_heard": q.heard}

    def _names_text(self) -> str:
        return ", ".join(f"{n.spec.role} {n.spec.kind} {n.spec.qname}" + (f" port {n.spec.port}" if n.spec.port else "")
                         for n in self.names)

    def _servers_text(self) -> str:
        if not self.nameservers:
            return self.resolv_conf
        return ", ".join(f"[{a}]:{p}" if ":" in a else f"{a}:{p}" for a, p in self.nameservers)

    def _log_failures(self, queries: list[_Query], errors_before: list[str | None]) -> None:
        """One line per failure as it starts or changes (not every cycle), one when the questions answer again."""
        started: dict[str, list[str]] = {}
        recovered = []
        for query, before in zip(queries, errors_before):
            if query.error is not None and query.error != before:
                started.setdefault(query.error, []).append(query.describe())
            elif query.error is None and before is not None:
                recovered.append(query.describe())
        for error, described in started.items():
            log.warning("dns: %s failed (%s); keeping the last known set (%d instance(s))", ", ".join(described),
                        error, len(self._published or ()))
        if recovered:
            log.info("dns: %s answer again", ", ".join(recovered))

    def _log_change(self, desired: frozenset[Member]) -> None:
        before = self._published or frozenset()
        added = sorted(m.key for m in desired - before)
        removed = sorted(m.key for m in before - desired)
        log.info("dns: %d instance(s)%s%s", len(desired),
                 "; in: " + ", ".join(f"{r} {u}" for r, u in added) if added else "",
                 "; out: " + ", ".join(f"{r} {u}" for r, u in removed) if removed else "")


def _server_errors(exc: dns.resolver.NoNameservers) -> str:
    """'SERVFAIL from 10.96.0.10:53' rather than dnspython's sentence about every server."""
    errors = exc.kwargs.get("errors") or []
    parts = []
    for server, _tcp, port, error, *_ in errors:
        what = error if isinstance(error, str) else type(error).__name__ if isinstance(error, Exception) else error
        parts.append(f"{what} from {server.split(':', 1)[-1].split('@')[0]}:{port}")
    return "; ".join(dict.fromkeys(parts)) or str(exc)


def from_settings(settings: Settings) -> DnsSource | None:
    """The DNS source the settings ask for, or None when no DNS name is given."""
    names = dns_queries(settings)
    if not names:
        return None
    return DnsSource(names, nameservers=dns_nameservers(settings), interval=settings.dns_interval)
