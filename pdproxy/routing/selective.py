"""Selective disaggregation: skip the prefill leg when the decode has little left to compute.

A request whose prompt, after the leading blocks its decode instance already holds in its KV cache (from the
decode's own KV events, pdproxy/kvevents), leaves at most `--pd-min-prefill-tokens` tokens to compute goes
straight to the decode: no prefill leg, no KV transfer, the decode computes the rest itself (as vLLM's P/D
routers do for short prompts: a transfer costs more than computing a few tokens). Off by default (0).

The prompt is counted in token ids (pdproxy/routing/tokens.py): a token-id prompt as given; a text prompt
through `--tokenizer-file`; else text and chat through an instance's `/tokenize` (the served model's own
tokenizer and chat template). The count is the whole prompt's length less what the decode holds; only the
key hashed to look it up is capped (`MAX_KEY_TOKENS`). Without flowing events for the decode nothing is known
to be held there and the whole prompt counts. A request is disaggregated when it has no token ids (chat with
a local tokenizer.json, which has no chat template; /tokenize failed or is backed off: `no_token_ids`) or
when its ids leave part of it out (media content parts, `documents`, a text cut before tokenizing:
`not_countable`): a decode must never be handed a long prompt it was told was short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdproxy.policies.request import RequestView

DISAGGREGATED, DECODE_ONLY = "disaggregated", "decode_only"
# why: few tokens left to compute / too many / no token ids to count them with / ids that leave part of it out
REASONS = ("short_uncached", "long_uncached", "no_token_ids", "not_countable")


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: str  # DISAGGREGATED or DECODE_ONLY
    reason: str  # one of REASONS (a bounded label)
    uncached_tokens: int | None = None  # what the decode would compute itself
    held_tokens: int | None = None  # of the prompt, already in the decode's cache (None: events not flowing)

    @property
    def decode_only(self) -> bool:
        return self.decision == DECODE_ONLY


class SelectiveDisaggregation:
    def __init__(self, min_prefill_tokens: int, events: Any = None) -> None:
        self.min_prefill_tokens = min_prefill_tokens
        self.events = events  # pdproxy.kvevents.KVEvents or None

    def decide(self, request: RequestView, decode_address: str) -> Verdict:
        tokens = request.token_ids
        if tokens is None:
            return Verdict(DISAGGREGATED, "no_token_ids")
        if not request.whole:
            return Verdict(DISAGGREGATED, "not_countable")
        sub = self.events.get(decode_address) if self.events is not None else None
        held = None
        if sub is not None and sub.flowing:
            size = sub.index.block_size
            held = sub.index.matched_blocks(request.block_keys(size)) * size if size else 0
        uncached = len(tokens) - (held or 0)
        if uncached <= self.min_prefill_tokens:
            return Verdict(DECODE_ONLY, "short_uncached", uncached, held)
        return Verdict(DISAGGREGATED, "long_uncached", uncached, held)
