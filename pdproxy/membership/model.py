"""What a membership source says: the instances it wants in the pools, one `Member` each.

Every source (the flags, the admin API, a file, DNS, Kubernetes) gives its whole desired set each
time it changes (level-triggered, never a delta): a source that loses its connection keeps its last
set by not publishing, so an outage of the API server or the resolver never empties a pool.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
# sources, in the order their details win when two name one instance (the flags and the operator's own
# word before discovery's)
SOURCES = ("flags", "admin", "file", "kubernetes", "dns")


_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")  # a DNS name or an IPv4 address


class MemberError(ValueError):
    """A member that cannot be used, with the reason (an admin request's 400, a file entry's warning)."""


@dataclass(frozen=True, slots=True)
class Member:
    """One instance as a source describes it.

    `identity` tells two incarnations at one URL apart (a pod's UID): a new one restarts its event
    stream's index. `ready` False keeps the instance (its event index, its series) but out of rotation
    (a pod whose readiness probe fails: it may pass again in a second). `terminating` drains it: no new
    requests, those in flight finish (a pod in its grace period)."""

    role: str
    url: str
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    bootstrap_port: int | None = None
    identity: str | None = None
    ready: bool = True
    terminating: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return self.role, self.url

    @property
    def address(self) -> str:
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname or ""
        return f"{host}:{port}"


# publish(members): a source's whole desired set, replacing what it said before
Publish = Callable[[Iterable[Member]], None]


class Source(Protocol):
    """A membership source: runs until cancelled, publishing its whole set whenever it changes."""

    name: str  # one of SOURCES

    async def run(self, publish: Publish) -> None: ...

    def status(self) -> dict[str, Any]:
        """For /status: at least `state` ("ok", "starting", "degraded": serving its last known set, with
        `last_error`), and when it last heard from what it watches."""
        ...


def member(role: Any, url: Any, *, kv_events_endpoint: Any = None, kv_events_replay_endpoint: Any = None,
           bootstrap_port: Any = None, identity: Any = None, ready: bool = True,
           terminating: bool = False) -> Member:
    """A validated `Member` (`url` normalised to scheme://host:port), or MemberError saying what is wrong."""
    if role not in ROLES:
        raise MemberError(f"role {role!r} is not one of {', '.join(ROLES)}")
    return Member(role, normalise_url(url), _endpoint(kv_events_endpoint, "kv_events_endpoint"),
                  _endpoint(kv_events_replay_endpoint, "kv_events_replay_endpoint"), port_number(bootstrap_port, "bootstrap_port"),
                  None if identity is None else str(identity), bool(ready), bool(terminating))


def normalise_url(url: Any) -> str:
    """`http://host:port` from a URL or `host:port`: no credentials, path, query or fragment."""
    if not isinstance(url, str) or not url.strip():
        raise MemberError("url must be a non-empty string such as http://10.0.0.5:8000")
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise MemberError(f"url {url!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise MemberError(f"url {url!r}: scheme must be http or https")
    if not parts.hostname:
        raise MemberError(f"url {url!r} has no host")
    if "@" in parts.netloc:
        raise MemberError(f"url {url!r} carries credentials, which pdproxy does not send (use --upstream-api-key)")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise MemberError(f"url {url!r} must be scheme://host:port only (no path, query or fragment)")
    host = parts.hostname
    if not _HOST.fullmatch(host):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise MemberError(f"url {url!r}: {host!r} is neither a host name nor an IP address") from None
    if ":" in host:
        host = f"[{host}]"
    port = port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{host}:{port}"


def _endpoint(value: Any, what: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise MemberError(f"{what} {value!r} is not a ZMQ endpoint (tcp://HOST:PORT)")
    return value


def port_number(value: Any, what: str) -> int | None:
    """A port (1-65535) from a number or its text (None for nothing given), or MemberError naming `what`."""
    if value is None or value == "" or value == "none":
        return None
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise MemberError(f"{what} {value!r} is not a port number") from None
    if isinstance(value, bool) or not 0 < port < 65536:
        raise MemberError(f"{what} {value!r} is not a port number (1-65535)")
    return port
