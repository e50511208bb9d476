"""A real DNS server for the DNS membership tests: Debian's dnsmasq (package dnsmasq-base), as a plain process
on 127.0.0.1 and a high port, with records a test changes while it runs.

A and AAAA records live in a hosts file, re-read on SIGHUP; SRV records are flags (`--srv-host`), which dnsmasq
reads only at start, so changing them restarts the server on the same port (a moment with no server, as a DNS
pod's restart). Every change of the hosts file carries a generation record, `gN.generation.test`, and waits
until the server answers it: the change is then in force, without sleeping for it.

Faults, each a real server's own behaviour:
- `stop()`: nothing listens (the kernel refuses the datagrams);
- `pause()`: SIGSTOP, the socket stays and nobody answers (timeouts);
- `servfail()`: the server restarts as a DNSSEC-validating forwarder to a second dnsmasq that holds the
  records unsigned; it cannot prove them insecure and answers SERVFAIL;
- `refuse()`: the server restarts knowing none of the test's domains and answers REFUSED.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import dns.exception
import dns.message
import dns.query
import dns.rcode
import pytest

import procs
from procs import HOST, Proc
from waits import scaled

DOMAIN = "test"  # every name a test uses ends in .test (RFC 2606): local to dnsmasq, NXDOMAIN when unknown
ROOT_ANCHOR = ".,20326,8,2,E06D44B80B8F1D39A95C0B0D7C65D08458E880409BBC683457104237C7F8EC8D"  # IANA's KSK-2017


def dnsmasq_binary() -> str:
    """dnsmasq's path; skipped on a developer's machine without it, a failure in CI (CI=true)."""
    sbin = [p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if os.access(p, os.X_OK)]  # off a user's PATH
    found = shutil.which("dnsmasq") or next(iter(sbin), None)
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("dnsmasq is not installed (Debian package dnsmasq-base; .ci/run installs it)")
    pytest.skip("dnsmasq is not installed (apt-get install dnsmasq-base)")


class Dnsmasq:
    """One dnsmasq on 127.0.0.1:`port`, answering for *.test from `hosts` (name -> addresses) and `srv`
    (`--srv-host` values: 'SRVNAME,TARGET,PORT')."""

    def __init__(self, hosts: dict[str, Iterable[str]] | None = None, srv: Iterable[str] = (), local_ttl: int = 0):
        self.exe = dnsmasq_binary()
        self.port = procs.free_port()
        self.dir = procs.FILES.scratch("dnsmasq")
        self.hosts_file = self.dir / "hosts"
        self.local_ttl = local_ttl
        self.hosts: dict[str, list[str]] = {k: list(v) for k, v in (hosts or {}).items()}
        self.srv = list(srv)
        self.generation = 0
        self.proc: Proc | None = None
        self._upstream: Proc | None = None
        self._write_hosts()
        self.start()

    @property
    def server(self) -> str:
        return f"{HOST}:{self.port}"

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """The normal server: the records of `hosts` and `srv`."""
        self._launch(self._records_args(self.port))

    def stop(self) -> None:
        for proc in (self.proc, self._upstream):
            if proc is not None:
                if proc.popen.poll() is None:
                    os.kill(proc.popen.pid, signal.SIGCONT)  # a paused server takes its SIGTERM only once resumed
                proc.stop()
        self.proc = self._upstream = None

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.popen.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.popen.pid, signal.SIGCONT)

    def servfail(self) -> None:
        """Restart as a validating forwarder whose upstream (the records, unsigned) it cannot validate."""
        self.stop()
        upstream_port = procs.free_port()
        self._upstream = Proc([self.exe, *self._records_args(upstream_port)], name="dnsmasq-upstream")
        self._wait_answering(upstream_port)
        self._launch(["--no-daemon", f"--port={self.port}", f"--listen-address={HOST}", "--bind-interfaces",
                      "--no-resolv", "--no-hosts", "--log-facility=-", "--dnssec", f"--trust-anchor={ROOT_ANCHOR}",
                      f"--server={HOST}#{upstream_port}"])

    def refuse(self) -> None:
        """Restart knowing no domain at all (no upstream, no records): REFUSED for every question."""
        self.stop()
        self._launch(["--no-daemon", f"--port={self.port}", f"--listen-address={HOST}", "--bind-interfaces",
                      "--no-resolv", "--no-hosts", "--log-facility=-"])

    # --- records ------------------------------------------------------------------------------------------------

    def set_hosts(self, hosts: dict[str, Iterable[str]]) -> None:
        """Replace the A/AAAA records and wait until the server answers from the new file."""
        self.hosts = {k: list(v) for k, v in hosts.items()}
        self._write_hosts()
        assert self.proc is not None
        os.kill(self.proc.popen.pid, signal.SIGHUP)
        self._wait_generation()

    def set_srv(self, srv: Iterable[str]) -> None:
        """Replace the SRV records: dnsmasq reads them only at start, so it restarts on the same port."""
        self.srv = list(srv)
        self.stop()
        self.start()

    # --- internals ----------------------------------------------------------------------------------------------

    def _records_args(self, port: int) -> list[str]:
        return ["--no-daemon", f"--port={port}", f"--listen-address={HOST}", "--bind-interfaces", "--no-resolv",
                "--no-hosts", f"--addn-hosts={self.hosts_file}", f"--local=/{DOMAIN}/", f"--local-ttl={self.local_ttl}",
                "--log-facility=-", "--log-queries", *(f"--srv-host={s}" for s in self.srv)]

    def _launch(self, args: list[str]) -> None:
        self.proc = Proc([self.exe, *args], name="dnsmasq")
        self._wait_answering(self.port)

    def _write_hosts(self) -> None:
        self.generation += 1
        lines = [f"127.0.0.1 g{self.generation}.generation.{DOMAIN}"]
        lines += [f"{address} {name}" for name, addresses in self.hosts.items() for address in addresses]
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.hosts_file)

    def ask(self, name: str, rdtype: str = "A", port: int | None = None, timeout: float = 0.5) -> dns.message.Message:
        query = dns.message.make_query(name, rdtype)
        return dns.query.udp(query, HOST, port=port or self.port, timeout=timeout)

    def _wait_answering(self, port: int) -> None:
        deadline = time.monotonic() + scaled(10)
        while time.monotonic() < deadline:
            assert self.proc is None or self.proc.popen.poll() is None, self.proc.output()
            try:
                # any answer, even SERVFAIL or REFUSED: it is up (a datagram before it bound is lost: ask again soon)
                self.ask(f"g1.generation.{DOMAIN}", port=port, timeout=0.05)
                return
            except (OSError, dns.exception.Timeout):
                time.sleep(0.02)
        raise TimeoutError(f"dnsmasq on port {port} does not answer")

    def _wait_generation(self) -> None:
        name = f"g{self.generation}.generation.{DOMAIN}"
        deadline = time.monotonic() + scaled(10)
        while time.monotonic() < deadline:
            if self.ask(name).rcode() == dns.rcode.NOERROR:
                return
            time.sleep(0.02)
        raise TimeoutError(f"dnsmasq did not re-read {self.hosts_file}")

