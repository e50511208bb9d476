"""Where each request goes: one owner for the whole decision.

Public face: `build` (from the settings, for the server's lifecycle), `Router.place` (a request's `Placement`:
its decode, its prefill or none, the disaggregation verdict, each leg's decision) and `Router.next_prefill` /
`next_decode` (the next instance for a leg run again). Inside: tokens (a prompt's token ids: given, a local
tokenizer.json, an instance's /tokenize with its back-off), selective (selective disaggregation), placement
(the order: token ids, decode, verdict, prefill). The policies that choose within a pool are pdproxy/policies;
the engines' KV events they read are pdproxy/kvevents.
"""

from __future__ import annotations

import logging
from typing import Any

from pdproxy.routing.placement import Placement, Router
from pdproxy.routing.selective import Verdict

log = logging.getLogger("pdproxy.routing")

# why an event-based decision fell back to the approximate index (`pd.route.fallback_reason`, a bounded label)
FALLBACK_REASONS = ("events_off", "events_not_flowing", "no_block_stored", "no_token_ids", "tokenize_failed",
                    "block_size_mismatch")
EVENT_POLICIES = ("precise_prefix",)

__all__ = ["FALLBACK_REASONS", "Placement", "Router", "Verdict", "build"]


def build(settings: Any, session: Any, prefill: Any, decode: Any, events: Any, metrics: Any,
          headers: dict[str, str]) -> Router:
    """The router for these pools (pdproxy.pool.Pool; `prefill` None without a prefill pool): selective
    disaggregation when --pd-min-prefill-tokens is set, token ids when a rule routes by them (`events`: the
    KV-event subscriptions, None when off; `metrics`: telemetry.Metrics, which counts /tokenize failures). Says
    at start what routes each pool and warns about what cannot work as configured."""
    pools = [p for p in (prefill, decode) if p is not None]  # (empty at start when found at run time)
    selective = None
    if settings.pd_min_prefill_tokens > 0 and prefill is not None:
        from pdproxy.routing.selective import SelectiveDisaggregation

        selective = SelectiveDisaggregation(settings.pd_min_prefill_tokens, events)
    by_events = [p.role for p in pools if p.policy.name in EVENT_POLICIES]
    tokens: Any = None
    source = "none needed"
    if selective is not None or by_events and events is not None:
        from pdproxy.routing import tokens as t

        if settings.tokenizer_file:
            tokens, source = t.LocalTokenizer(settings.tokenizer_file), f"text through {settings.tokenizer_file}"
        else:  # text and chat through the served model's own tokenizer and chat template
            tokens = t.RemoteTokenizer(session, lambda: [(i.url, i.address) for i in decode.instances], headers,
                                       metrics.tokenize_failure)
            source = "text and chat through the decode instances' /tokenize"
    log.info("routing: %s; selective disaggregation %s; token ids: %s",
             ", ".join(f"{p.role} pool ({len(p)}) by {p.policy.name}" for p in pools),
             f"at {settings.pd_min_prefill_tokens} uncached tokens" if selective is not None else "off", source)
    if events is None and by_events:
        log.warning("--policy precise_prefix (%s) without KV events (no --kv-events-* flag): every decision falls "
                    "back to the approximate index (fallback reason events_off)", " and ".join(by_events))
    if events is None and selective is not None:
        log.warning("--pd-min-prefill-tokens without KV events (no --kv-events-* flag): nothing is known to be held "
                    "on a decode, so only prompts of at most %d tokens in all go straight to it",
                    settings.pd_min_prefill_tokens)
    if settings.pd_min_prefill_tokens > 0 and selective is None:
        log.warning("--pd-min-prefill-tokens has no effect without prefill instances")
    return Router(prefill, decode, tokens, selective)
