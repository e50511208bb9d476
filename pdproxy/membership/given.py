"""Instances given by a person: the command-line flags, and the admin HTTP API.

Both are sets only their owner changes: discovery never removes what they hold. The flags' set is the
start-up configuration; the admin API puts and withdraws members one at a time (and may withdraw a
flags instance, as vllm-router's `/remove_worker` does: both are the operator's own word).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pdproxy.config import Settings, kv_event_endpoints
from pdproxy.membership.model import DECODE, PREFILL, Member, Publish, member


class Given:
    """A set of members kept as given, published whole on every change."""

    def __init__(self, name: str, members: Iterable[Member] = ()) -> None:
        self.name = name
        self.members: dict[tuple[str, str], Member] = {m.key: m for m in members}
        self._publish: Publish | None = None
        self.changed_at: float | None = None

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        publish(list(self.members.values()))

    def put(self, new: Member) -> bool:
        """Add or replace a member; False when it was there already, unchanged."""
        if self.members.get(new.key) == new:
            return False
        self.members[new.key] = new
        self._changed()
        return True

    def withdraw(self, key: tuple[str, str]) -> bool:
        if self.members.pop(key, None) is None:
            return False
        self._changed()
        return True

    def _changed(self) -> None:
        self.changed_at = time.time()
        if self._publish is not None:
            self._publish(list(self.members.values()))

    def status(self) -> dict[str, Any]:
        return {"state": "ok", "members": len(self.members), "last_change": self.changed_at}


def flags(settings: Settings) -> Given:
    """The instances of the command line (and its environment and config file), with the KV-event endpoints
    the --kv-events-* flags give them."""
    endpoints = {address: (pub, replay) for address, pub, replay in kv_event_endpoints(settings)}
    members = []
    for role, urls in ((PREFILL, settings.prefill_urls), (DECODE, settings.decode_urls)):
        for url in urls:
            bare = member(role, url)
            pub, replay = endpoints.get(bare.address, (None, None))
            members.append(member(role, url, kv_events_endpoint=pub, kv_events_replay_endpoint=replay,
                                  bootstrap_port=settings.bootstrap_ports.get(url)))
    return Given("flags", members)
