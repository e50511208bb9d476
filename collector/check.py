#!/usr/bin/env python3
"""Refuse a collector configuration that exports to the collector's own OTLP receiver.

    python3 collector/check.py [--binary OTELCOL] [--config collector/otelcol.yaml]

Why: with `TEMPO_OTLP_ENDPOINT=localhost:4317` (the collector's own receiver), every tail-sampled
trace comes back in, is counted again by the span-derived metrics and sampled again: the
"computed from traces" counts keep growing with no traffic, and the collector burns CPU. Nothing in
the collector refuses that, so collector/run.sh runs this first.

The configuration is read as the collector resolves it (`otelcol print-config --format=json`:
environment references and defaults applied by the collector itself), so this script needs only the
standard library. An exporter in a pipeline (`otlp_grpc`, `otlp_http`, `load_balancing`'s static
backends) whose host is this machine and whose port is one of the collector's OTLP receivers' is
refused: exit status 2 and one line naming both. Anything else exits 0 without a word.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


def resolved_config(binary: str, config: str) -> dict:
    """The configuration as the collector reads it (raises CalledProcessError with its own message)."""
    r = subprocess.run([binary, "print-config", "--format=json", f"--config={config}"], capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        raise subprocess.CalledProcessError(r.returncode, r.args, r.stdout, r.stderr)
    return json.loads(r.stdout)


def host_port(endpoint: str, default_port: int) -> tuple[str, int] | None:
    """`host:port`, `[v6]:port` or a URL, as (host, port); None when it names no host."""
    parts = urlsplit(endpoint if "://" in endpoint else "//" + endpoint)
    try:
        port = parts.port
    except ValueError:
        return None
    if parts.hostname is None:
        return None
    if port is None:
        port = {"https": 443, "http": 80}.get(parts.scheme, default_port) if parts.scheme else default_port
    return parts.hostname, port


def receivers(cfg: dict) -> list[tuple[str, str, str, int]]:
    """(receiver id, protocol, host, port) of every OTLP receiver the pipelines use."""
    used = {r for p in cfg.get("service", {}).get("pipelines", {}).values() for r in p.get("receivers") or ()}
    out = []
    for rid, body in (cfg.get("receivers") or {}).items():
        if rid.split("/")[0] != "otlp" or rid not in used:
            continue
        for proto, server in ((body or {}).get("protocols") or {}).items():
            default = "localhost:4317" if proto == "grpc" else "localhost:4318"
            found = host_port((server or {}).get("endpoint") or default, 4317 if proto == "grpc" else 4318)
            if found:
                out.append((rid, proto, *found))
    return out


def exporter_targets(cfg: dict) -> list[tuple[str, str, str, int]]:
    """(exporter id, endpoint as written, host, port) of every OTLP destination the pipelines export to."""
    used = {e for p in cfg.get("service", {}).get("pipelines", {}).values() for e in p.get("exporters") or ()}
    out = []
    for eid, body in (cfg.get("exporters") or {}).items():
        kind, body = eid.split("/")[0], body or {}
        if eid not in used:
            continue
        endpoints: list[tuple[str, int]] = []
        if kind in ("otlp_grpc", "otlp"):
            endpoints = [(body.get("endpoint") or "", 4317)]
        elif kind in ("otlp_http", "otlphttp"):
            endpoints = [(body.get(key) or "", 4318) for key in ("endpoint", "traces_endpoint", "metrics_endpoint",
                                                                 "logs_endpoint")]
        elif kind in ("load_balancing", "loadbalancing"):
            static = ((body.get("resolver") or {}).get("static") or {}).get("hostnames") or []
            endpoints = [(h, 4317) for h in static]
        for endpoint, default in endpoints:
            found = host_port(endpoint, default) if endpoint else None
            if found:
                out.append((eid, endpoint, *found))
    return out


def addresses(host: str) -> set[str]:
    host = host.strip("[]")
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return set()  # not resolved here: not this machine


def local(address: str) -> bool:
    """An address of this machine: loopback, a wildcard, or one a socket can bind."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.is_loopback or ip.is_unspecified:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def same_place(exporter_host: str, receiver_host: str) -> bool:
    """Whether a connection to `exporter_host` reaches a listener bound to `receiver_host` on this machine."""
    targets = addresses(exporter_host)
    if receiver_host.strip("[]") in {w.strip("[]") for w in WILDCARDS}:
        return any(local(a) for a in targets)  # a wildcard listener takes every local address
    return bool(targets & addresses(receiver_host))


def loops(cfg: dict) -> list[str]:
    """One sentence per exporter that sends to this collector's own OTLP receiver."""
    found = []
    own = receivers(cfg)
    for eid, endpoint, host, port in exporter_targets(cfg):
        for rid, proto, rhost, rport in own:
            if port == rport and same_place(host, rhost):
                found.append(f"exporter {eid} sends to {endpoint}, which is this collector's own {rid} receiver "
                             f"({proto} on {rhost}:{rport}): everything it exports would come back in and be "
                             "counted and sampled again")
                break
    return found


def default_binary() -> str:
    return str(REPO / ".tools" / "otelcol-pdproxy" / "otelcol-pdproxy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", default=default_binary(), help="the collector (default: collector/build.sh's)")
    parser.add_argument("--config", default=str(REPO / "collector" / "otelcol.yaml"))
    args = parser.parse_args(argv)
    try:
        cfg = resolved_config(args.binary, args.config)
    except FileNotFoundError:
        print(f"collector/check.py: error: no collector at {args.binary} (build it: collector/build.sh)",
              file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        sys.stderr.write(exc.stderr or exc.stdout or "")  # the collector's own word on a broken configuration
        return exc.returncode or 1
    problems = loops(cfg)
    for problem in problems:
        print(f"collector/check.py: error: {problem}. Point it at the trace store (e.g. TEMPO_OTLP_ENDPOINT: "
              "Tempo, or Jaeger on ports of its own; collector/README.md)", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
