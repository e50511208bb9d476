"""Send a prompt to the instance that holds the longest prefix of it in its KV cache, as the engine itself says.

The engines' KV-cache events (pdproxy/kvevents) give each instance's cached blocks; every pdproxy process that
subscribes builds the same index, so replicas and workers agree without sharing anything (llm-d's precise
prefix-cache scorer and Dynamo's KV router work this way). A prompt's token ids (a token-id prompt as it is; a
text prompt through `--tokenizer-file`, the served model's tokenizer.json; else text and chat through an
instance's `/tokenize`, pdproxy/kvevents/tokenize.py) are cut into blocks of the engines'
block size and hashed as the index is (`kvevents.chain_hashes`); then:

* load is imbalanced (as cache_aware: `max - min > balance_abs_threshold` and `max > balance_rel_threshold ×
  min`, load being in-flight requests plus the engine's own queue where /metrics is read, as load_aware): the
  least loaded instance (`imbalanced`);
* otherwise the instance holding the most leading blocks, least loaded among equals (`prefix_match`), or, when
  none holds any, the least loaded (`cache_miss`).

When a candidate's events are not flowing (not configured, not connected, resynchronising) or the prompt has no
token ids here (chat with a local tokenizer.json, which has no chat template; /tokenize failed), the request is routed by
cache_aware's approximate index instead (`approximate`, counted and on the span), which also learns every
precise choice so that it is ready when needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import aiohttp

from pdproxy.kvevents import chain_hashes
from pdproxy.policies.base import Decision, Instance, Rotation
from pdproxy.policies.cache_aware import CacheAware
from pdproxy.policies.load_aware import LoadAware
from pdproxy.policies.request import MAX_KEY_TOKENS, RequestView


def prompt_token_ids(request: RequestView, tokenizer: Any | None) -> list[int] | None:
    """The prompt as token ids: given as such, tokenized by an instance (kvevents.tokenize), or a text
    completion prompt through the local tokenizer."""
    if request.token_ids is not None:
        return request.token_ids[:MAX_KEY_TOKENS]
    if request.chat:
        return None  # the chat template is the model's: not applied here
    prompt = request.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt[:MAX_KEY_TOKENS]):
        return prompt[:MAX_KEY_TOKENS]
    if isinstance(prompt, str) and prompt and tokenizer is not None:
        return tokenizer.encode(prompt[:MAX_KEY_TOKENS * 8]).ids[:MAX_KEY_TOKENS]
    return None


def load_tokenizer(path: str | None) -> Any | None:
    if not path:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


class PrecisePrefix:
    name: ClassVar[str] = "precise_prefix"
    reasons: ClassVar[tuple[str, ...]] = ("prefix_match", "cache_miss", "imbalanced", "approximate")

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 18,
                 load_metrics_interval: float = 2.0, tokenizer_file: str | None = None) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.approximate = CacheAware(cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_size)
        self.engine_load = LoadAware(load_metrics_interval)
        self.tokenizer = load_tokenizer(tokenizer_file)
        self.events: Any = None  # pdproxy.kvevents.KVEvents, given by kvevents.start
        self.rotation = Rotation()
        self.fallbacks = 0

    def use_events(self, events: Any) -> None:
        self.events = events

    def start(self, instances: Sequence[Instance], session: aiohttp.ClientSession, headers: dict[str, str]) -> None:
        self.engine_load.start(instances, session, headers)

    async def stop(self) -> None:
        await self.engine_load.stop()

    def _loads(self, instances: Sequence[Instance]) -> list[float]:
        readings = self.engine_load.readings
        out: list[float] = []
        for i in instances:
            reading = readings.get(i.url)
            out.append(i.inflight + (reading.score if reading is not None else 0.0))
        return out

    def choose(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]:
        subs: list[Any] = []  # each candidate's event subscription, when all of them are flowing
        if self.events is not None and request is not None:
            subs = [self.events.get(i.address) for i in instances]
            if not all(s is not None and s.flowing for s in subs):
                subs = []
        tokens = prompt_token_ids(request, self.tokenizer) if subs and request is not None else None
        # the engines' block size, from their events (none stored anything yet: nothing to match either)
        block_size = next((s.index.block_size for s in subs if s.index.block_size), None) if subs else None
        if tokens is None or block_size is None or any(s.index.block_size not in (None, block_size) for s in subs):
            return self._approximate(instances, request)
        load = self._loads(instances)
        low, high = min(load), max(load)
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            chosen = self.rotation.least(instances, load)
            decision = Decision(self.name, "imbalanced", compared=instances, values=load)
        else:
            keys = chain_hashes(tokens, block_size)
            matched = [s.index.matched_blocks(keys) for s in subs]
            best = max(matched)
            if best:
                holders = [k for k, m in enumerate(matched) if m == best]
                chosen = self.rotation.least([instances[k] for k in holders], [load[k] for k in holders])
                reason = "prefix_match"
            else:
                chosen, reason = self.rotation.least(instances, load), "cache_miss"
            decision = Decision(self.name, reason, best * block_size, "tokens", instances,
                                [m * block_size for m in matched])
        self.approximate.choose([chosen], request)  # the approximate index learns it too
        return chosen, decision

    def _approximate(self, instances: Sequence[Instance], request: RequestView | None) -> tuple[Instance, Decision]:
        self.fallbacks += 1
        chosen, inner = self.approximate.choose(instances, request)
        return chosen, Decision(self.name, "approximate", inner.matched, inner.unit, inner.compared, inner.values)

    def status(self, instances: Sequence[Instance]) -> dict[str, dict[str, Any]]:
        out = {}
        for i in instances:
            sub = self.events.get(i.address) if self.events is not None else None
            out[i.address] = {"inflight": i.inflight, "events": "flowing" if sub is not None and sub.flowing
                              else "off" if sub is None else "not flowing",
                              "event_index_blocks": len(sub.index) if sub is not None else 0,
                              "approximate_fallbacks": self.fallbacks}
        return out
