"""Which endpoint each instance publishes its KV events on: pdproxy's settings (config.kv_event_endpoints)."""

from __future__ import annotations

from pdproxy.config import Settings, kv_event_endpoints
from pdproxy.kvevents.subscriber import Source


def sources_of(settings: Settings) -> list[Source]:
    """One `Source` per prefill and decode instance that has an endpoint (none: events are off)."""
    return [Source(address, endpoint, replay, settings.kv_events_topic or "")
            for address, endpoint, replay in kv_event_endpoints(settings)]
