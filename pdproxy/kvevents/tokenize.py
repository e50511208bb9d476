"""A text or chat prompt's token ids from an instance's own `/tokenize`, where no local tokenizer.json is given.

The served model's tokenizer and chat template are the instance's: vLLM's `POST /tokenize` takes the completion's
`prompt` (with `add_special_tokens`) or the chat's `messages` (with `add_generation_prompt`) and answers the ids
the engine will hash, so the precise index and the selective-disaggregation rule match what the engine caches.
It costs one round trip to an instance before routing (measured by benchmarks/kv_events.py): asked only for
text and chat prompts, bounded by `timeout`, at most MAX_PROMPT_CHARS of text; any failure leaves the request
without token ids (routed by the approximate index, disaggregated), never fails it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from pdproxy import jsonio
from pdproxy.policies.request import MAX_KEY_CHARS, RequestView

log = logging.getLogger("pdproxy.kvevents")

MAX_PROMPT_CHARS = MAX_KEY_CHARS
TIMEOUT = 0.5  # s: what routing may wait for token ids before it goes by the approximate index
MAX_ANSWER_BYTES = 8 * 1024 * 1024


def tokenize_body(view: RequestView) -> dict[str, Any] | None:
    """What to ask /tokenize for this request; None when it has token ids already or nothing to tokenize."""
    body = view.body
    model = body.get("model")
    base = {"model": model} if isinstance(model, str) else {}
    if view.chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        size = sum(len(m.get("content")) for m in messages if isinstance(m, Mapping) and isinstance(m.get("content"), str))
        if size > MAX_PROMPT_CHARS:
            return None
        add = body.get("add_generation_prompt", True)
        return {**base, "messages": messages, "add_generation_prompt": add if isinstance(add, bool) else True}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt or len(prompt) > MAX_PROMPT_CHARS:
        return None
    special = body.get("add_special_tokens", True)
    return {**base, "prompt": prompt, "add_special_tokens": special if isinstance(special, bool) else True}


class RemoteTokenizer:
    def __init__(self, session: aiohttp.ClientSession, urls: Sequence[str], headers: dict[str, str],
                 timeout: float = TIMEOUT) -> None:
        self.session, self.headers = session, headers
        self._urls = itertools.cycle(list(urls))
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.asked = self.failed = 0

    async def prepare(self, view: RequestView) -> None:
        """Set `view.token_ids` from an instance's /tokenize for a text or chat prompt (left None on failure)."""
        ask = tokenize_body(view)
        if ask is None:
            return
        self.asked += 1
        url = next(self._urls)
        try:
            async with self.session.post(url + "/tokenize", json=ask, headers=self.headers,
                                         timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                raw = await resp.content.read(MAX_ANSWER_BYTES + 1)
                if len(raw) > MAX_ANSWER_BYTES:
                    raise ValueError("answer too large")
            ids = jsonio.loads(raw).get("tokens")
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise ValueError("no list of token ids")
            view.token_ids = ids
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError) as exc:
            self.failed += 1
            if self.failed == 1 or self.failed % 1000 == 0:
                log.warning("cannot tokenize through %s/tokenize (%s); such requests route by the approximate "
                            "index (%d failures)", url, str(exc) or type(exc).__name__, self.failed)
