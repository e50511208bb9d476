"""A file of instances (YAML or JSON), watched: what llm-d's file discovery and AIBrix's standalone mode do,
for clusters without Kubernetes (Slurm, Ray, bare metal) and for a ConfigMap mounted into the proxy's pod.

The file holds a list of instances, or a mapping of role to a list; an instance is a URL or a mapping:

    prefill:
      - http://10.0.0.1:8100
      - {url: http://10.0.0.2:8100, bootstrap_port: 8998, kv_events_endpoint: "tcp://10.0.0.2:5557"}
    decode:
      - url: http://10.0.0.3:8200

    # or: [{url: ..., role: prefill}, {url: ..., worker_type: decode}, ...]

It is looked at every `interval` seconds and read again when its size, modification time or inode changed:
an edit in place and an atomic rename (a ConfigMap's symlink swap, `mv new file`) both count. A file that
cannot be read or parsed keeps the last good set (and says why in /status and the log): a half-written
file never empties a pool. An entry that is wrong is skipped with a warning naming it; the others apply.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import yaml

from pdproxy.membership.model import DECODE, ROLES, Member, MemberError, Publish, member

log = logging.getLogger("pdproxy.membership.file")

MAX_FILE_BYTES = 4 << 20  # a list of thousands of instances fits many times over
MAX_ENTRIES = 10_000


class FileSource:
    name = "file"

    def __init__(self, path: str, interval: float = 1.0, default_role: str = DECODE) -> None:
        self.path = path
        self.interval = interval
        self.default_role = default_role  # for entries that name none (single mode: every instance decodes)
        self.state = "starting"
        self.last_error: str | None = None
        self.last_read: float | None = None
        self.members = 0
        self.skipped: list[str] = []
        self._seen: tuple[int, int, int] | None = None

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "path": self.path, "members": self.members, "last_read": self.last_read,
                "last_error": self.last_error, "skipped_entries": self.skipped[:10]}

    async def run(self, publish: Publish) -> None:
        while True:
            self.poll(publish)
            await asyncio.sleep(self.interval)

    def poll(self, publish: Publish) -> None:
        try:
            info = os.stat(self.path)
        except OSError as exc:
            self._failed(f"cannot read {self.path}: {exc.strerror}")
            return
        seen = (info.st_ino, info.st_size, info.st_mtime_ns)
        if seen == self._seen:
            return
        try:
            if info.st_size > MAX_FILE_BYTES:
                raise MemberError(f"{self.path} is {info.st_size} bytes, over {MAX_FILE_BYTES}")
            with open(self.path, "rb") as f:
                text = f.read(MAX_FILE_BYTES + 1)
            members, skipped = self.parse(yaml.safe_load(text))
        except (OSError, yaml.YAMLError, MemberError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) else str(exc).replace("\n", " ")
            self._failed(f"cannot use {self.path}: {detail}")
            self._seen = seen  # not read again until it changes
            return
        self._seen = seen
        self.state, self.last_error, self.last_read = "ok", None, time.time()
        self.members, self.skipped = len(members), skipped
        for reason in skipped:
            log.warning("membership file %s: %s (skipped)", self.path, reason)
        log.info("membership file %s: %d instance(s)", self.path, len(members))
        publish(members)

    def _failed(self, reason: str) -> None:
        if reason != self.last_error:
            log.warning("membership file: %s; keeping the last good set (%d instance(s))", reason, self.members)
        self.state, self.last_error = "degraded", reason

    def parse(self, data: Any) -> tuple[list[Member], list[str]]:
        """The members a file's parsed content names, and why each skipped entry was skipped."""
        if data is None:
            return [], []
        entries: list[tuple[str | None, Any, str]] = []
        if isinstance(data, dict):
            unknown = sorted(str(k) for k in data if k not in ROLES)
            if unknown:
                raise MemberError(f"unknown key(s) {', '.join(unknown)}: expected {' and '.join(ROLES)}")
            for role, items in data.items():
                if not isinstance(items, list):
                    raise MemberError(f"{role} must be a list of instances")
                entries += [(role, item, f"{role}[{n}]") for n, item in enumerate(items)]
        elif isinstance(data, list):
            entries = [(None, item, f"entry {n}") for n, item in enumerate(data)]
        else:
            raise MemberError("expected a list of instances, or a mapping of prefill/decode to lists")
        if len(entries) > MAX_ENTRIES:
            raise MemberError(f"{len(entries)} entries, over {MAX_ENTRIES}")
        members, skipped = [], []
        for role, item, where in entries:
            try:
                members.append(self._member(role, item))
            except MemberError as exc:
                skipped.append(f"{where}: {exc}")
        return members, skipped

    def _member(self, role: str | None, item: Any) -> Member:
        if isinstance(item, str):
            return member(role or self.default_role, item)
        if not isinstance(item, dict):
            raise MemberError("an instance is a URL or a mapping with url")
        fields = {str(k).replace("-", "_"): v for k, v in item.items()}
        role_field, type_field = fields.pop("role", None), fields.pop("worker_type", None)
        given = role_field or type_field
        if role is not None and given is not None and given != role:
            raise MemberError(f"role {given!r} inside the {role} list")
        allowed = {"url", "bootstrap_port", "kv_events_endpoint", "kv_events_replay_endpoint"}
        unknown = sorted(set(fields) - allowed)
        if unknown:
            raise MemberError(f"unknown field(s) {', '.join(unknown)}")
        return member(role or given or self.default_role, fields.get("url"),
                      bootstrap_port=fields.get("bootstrap_port"),
                      kv_events_endpoint=fields.get("kv_events_endpoint"),
                      kv_events_replay_endpoint=fields.get("kv_events_replay_endpoint"))


def from_settings(settings: Any) -> FileSource | None:
    path = getattr(settings, "instances_file", None)
    if not path:
        return None
    return FileSource(path, settings.instances_file_interval, "decode")
