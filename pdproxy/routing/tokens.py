"""A prompt's token ids for routing: given in the request, from a local tokenizer.json, or an instance's /tokenize.

Precise-prefix routing and selective disaggregation both need them, and find them on the request view
(`RequestView.token_ids`), set here. A completion's token-id prompt has them (`given`); a text prompt gets them
from `--tokenizer-file` (the served model's tokenizer.json) when one is given; otherwise text and chat go to an
instance's own `POST /tokenize`, which applies the served model's tokenizer and chat template and answers the ids
the engine will hash. A chat asks with every field of vLLM's chat tokenize request the client sent (tools, chat
template and its arguments, ...), so the count is the one the engine will compute; parts /tokenize cannot count
(media content parts, `documents`) leave the ids usable for a prefix match but not for a count (`RequestView.whole`
false).

/tokenize costs one round trip before routing (benchmarks/kv_events.py), within TIMEOUT for all tries of a request
(at most TRIES instances, each given an equal share). An instance whose /tokenize times out, cannot be reached or
answers 5xx is backed off (1 s, doubling up to MAX_BACKOFF while it keeps failing; one request probes it when the
back-off ends) and the next one is tried; when every instance is backed off, requests route without token ids until
one is due again, at no cost. An answer whose length cannot be the prompt's (`plausible`) is rejected. Every
failure is counted (`pdproxy_tokenize_failures_total{server_address, reason}`) and logged when an instance goes
into back-off or comes back; a failure never fails the request, which then routes by the approximate index,
disaggregated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

from pdproxy import jsonio
from pdproxy.policies.request import MAX_KEY_CHARS, MAX_KEY_PARTS, MAX_KEY_TOKENS, RequestView, prompt_of

log = logging.getLogger("pdproxy.routing")

MAX_PROMPT_CHARS = MAX_KEY_CHARS  # text sent to /tokenize at most; a longer prompt routes without ids
MAX_LOCAL_CHARS = MAX_KEY_TOKENS * 8  # text tokenized locally at most (a longer one is counted as not whole)
TIMEOUT = 0.5  # s: what routing may wait for token ids, all tries together, before it goes without
TRIES = 2  # instances asked at most per request, each within TIMEOUT / TRIES (a hanging one leaves time for another)
MAX_ANSWER_BYTES = 8 * 1024 * 1024
FIRST_BACKOFF, MAX_BACKOFF = 1.0, 60.0  # s
# vLLM 0.23's TokenizeChatRequest, beside `messages`: what changes the ids when a chat request carries it
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
               "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "tools")
# A token covers on average far fewer characters than this in any real tokenizer (English prose about 4, code
# about 3; the longest single tokens of common BPE vocabularies are runs of spaces or punctuation of a few dozen):
# fewer ids than characters / MAX_CHARS_PER_TOKEN cannot be the prompt's. Each id covers at least one byte (byte-
# level BPE, SentencePiece byte fallback), so a text prompt has at most its UTF-8 bytes plus a few special tokens.
MAX_CHARS_PER_TOKEN = 128
MAX_SPECIAL_TOKENS = 16
WARN_EVERY = 60.0  # s: refused answers of one instance are logged at most this often (all are counted)
FAILURE_REASONS = ("timeout", "http_status", "bad_answer", "connection")


class Ask:
    """What to send to /tokenize for one request, and what the answer is checked against."""

    __slots__ = ("body", "whole", "chars", "max_tokens")

    def __init__(self, body: dict[str, Any], whole: bool, chars: int, max_tokens: int | None) -> None:
        self.body = body
        self.whole = whole  # the answer counts the whole request
        self.chars = chars  # characters of text the answer must cover at least
        self.max_tokens = max_tokens  # ids it can have at most (None: a chat template adds an unknown number)

    def plausible(self, count: int) -> bool:
        return count * MAX_CHARS_PER_TOKEN >= self.chars and (self.max_tokens is None or count <= self.max_tokens)


def tokenize_body(view: RequestView) -> Ask | None:
    """What to ask /tokenize for this request; None when there is nothing to tokenize (or too much)."""
    body = view.body
    model = body.get("model")
    base: dict[str, Any] = {"model": model} if isinstance(model, str) else {}
    if view.chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        chars, whole = _chat_text_size(messages)
        if chars > MAX_PROMPT_CHARS:
            return None
        ask = {**base, "messages": messages, **{k: body[k] for k in CHAT_FIELDS if body.get(k) is not None}}
        return Ask(ask, whole and not body.get("documents"), chars, None)
    prompt = prompt_of(body)
    if not isinstance(prompt, str) or not prompt or len(prompt) > MAX_PROMPT_CHARS:
        return None
    special = body.get("add_special_tokens", True)
    special = special if isinstance(special, bool) else True
    return Ask({**base, "prompt": prompt, "add_special_tokens": special}, True, len(prompt),
               len(prompt.encode("utf-8", "surrogatepass")) + MAX_SPECIAL_TOKENS)


def _chat_text_size(messages: list[Any]) -> tuple[int, bool]:
    """The characters of the messages' text, and whether text is all they hold (no image, audio, file parts); at
    most MAX_KEY_PARTS messages and parts are looked at (a chat of more is not counted whole)."""
    chars, visited = 0, 0
    for message in messages:
        visited += 1
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                visited += 1
                text = part.get("text") if isinstance(part, Mapping) else None
                if not isinstance(text, str) or part.get("type", "text") != "text" or visited > MAX_KEY_PARTS:
                    return chars, False  # a media part: /tokenize does not count what the engine makes of it
                chars += len(text)
        if visited > MAX_KEY_PARTS:
            return chars, False
    return chars, True


def token_id_prompt(body: Mapping[str, Any]) -> list[int] | None:
    """A completion's prompt given as token ids (alone or as a batch of one), whole; None for any other."""
    prompt = prompt_of(body)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt[:MAX_KEY_TOKENS]):
        return prompt
    return None


def given(view: RequestView) -> bool:
    """Take a completion's token-id prompt as the request's ids; whether it had one."""
    ids = None if view.chat else token_id_prompt(view.body)
    if ids is not None:
        view.token_ids, view.whole = ids, True
    return ids is not None


class LocalTokenizer:
    """Text prompts through the served model's tokenizer.json (`--tokenizer-file`); chat has no template here."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(path)

    async def fill(self, view: RequestView) -> None:
        self.tokenize(view)

    def tokenize(self, view: RequestView) -> None:
        if given(view) or view.chat:
            return
        prompt = prompt_of(view.body)
        if isinstance(prompt, str) and prompt:
            view.token_ids = self.tokenizer.encode(prompt[:MAX_LOCAL_CHARS]).ids
            view.whole = len(prompt) <= MAX_LOCAL_CHARS


class Target:
    """One instance's /tokenize and its back-off."""

    __slots__ = ("url", "address", "failures", "until", "probing", "warned")

    def __init__(self, url: str, address: str) -> None:
        self.url, self.address = url, address
        self.failures = 0  # in a row
        self.until = 0.0  # monotonic: backed off until then
        self.probing = False  # one request is trying it after its back-off
        self.warned = -WARN_EVERY  # monotonic: when an answer it gave was last logged as refused

    def ready(self, now: float) -> bool:
        return now >= self.until and not self.probing


class RemoteTokenizer:
    """Token ids from the instances' /tokenize, taken in turn, each backed off while it fails."""

    def __init__(self, session: aiohttp.ClientSession, instances: Sequence[tuple[str, str]], headers: dict[str, str],
                 count: Callable[[str, str], None] = lambda address, reason: None, timeout: float = TIMEOUT) -> None:
        self.session, self.headers, self.count = session, headers, count
        self.targets = [Target(url, address) for url, address in instances]
        self.timeout = timeout
        self._turn = 0

    async def fill(self, view: RequestView) -> None:
        """Set `view.token_ids` for a text or chat prompt; on failure leave them None and say why (`view.no_ids`)."""
        if given(view):
            return
        ask = tokenize_body(view)
        if ask is None:
            return
        view.no_ids = "tokenize_failed"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        ready = self._ready()[:TRIES]
        for target in ready:
            left = min(deadline - loop.time(), self.timeout / len(ready))
            if left <= 0:
                return
            if not target.ready(time.monotonic()):
                continue  # another request went to probe it meanwhile
            ids, reason, detail, its_fault = await self._ask(target, ask, left)
            if ids is not None:
                view.token_ids, view.whole = ids, ask.whole
                return
            self._failed(target, reason, detail, its_fault)
            if not its_fault:
                return  # the request's own doing (a 4xx, an odd prompt): another instance would answer the same

    def _ready(self) -> list[Target]:
        """The instances not backed off, starting with the next in turn."""
        now = time.monotonic()
        n = len(self.targets)
        self._turn = (self._turn + 1) % n
        return [t for k in range(n) if (t := self.targets[(self._turn + k) % n]).ready(now)]

    async def _ask(self, target: Target, ask: Ask, timeout: float) -> tuple[list[int] | None, str, str, bool]:
        """The ids, or why not: a failure reason (FAILURE_REASONS), what happened, and whether the fault is the
        instance's (no answer, any status but a 4xx) rather than the request's (a 4xx, an answer that cannot be
        its prompt's)."""
        target.probing = target.failures > 0
        try:
            async with self.session.post(target.url + "/tokenize", json=ask.body, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    return None, "http_status", f"HTTP {resp.status}", not 400 <= resp.status < 500
                raw = await resp.content.read(MAX_ANSWER_BYTES + 1)
        except (asyncio.TimeoutError, TimeoutError):
            return None, "timeout", f"no answer within {timeout:.2f}s", True
        except (aiohttp.ClientError, OSError) as exc:
            return None, "connection", str(exc) or type(exc).__name__, True
        finally:
            target.probing = False
        try:
            ids = jsonio.loads(raw).get("tokens") if len(raw) <= MAX_ANSWER_BYTES else None
        except (ValueError, AttributeError):
            ids = None
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            return None, "bad_answer", "no list of token ids", False
        if not ask.plausible(len(ids)):
            return None, "bad_answer", f"{len(ids)} ids for {ask.chars} characters", False
        if target.failures:
            log.info("%s/tokenize answers again; text and chat prompts route by token ids", target.url)
        target.failures, target.until = 0, 0.0
        return ids, "", "", False

    def _failed(self, target: Target, reason: str, detail: str, its_fault: bool) -> None:
        """Count it; back the instance off (and say so) when the fault is its own."""
        self.count(target.address, reason)
        if not its_fault:
            now = time.monotonic()
            if now - target.warned >= WARN_EVERY:
                target.warned = now
                log.warning("%s/tokenize: %s (%s); such requests route without token ids (routing fallback "
                            "tokenize_failed; counted in pdproxy_tokenize_failures_total, logged at most every "
                            "%.0fs)", target.url, reason, detail, WARN_EVERY)
            return
        target.failures += 1
        backoff = min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (target.failures - 1))
        target.until = time.monotonic() + backoff
        log.warning("%s/tokenize failed (%s: %s), %d time(s) in a row; not asked for %.0fs, meanwhile text and chat "
                    "prompts route by another instance's /tokenize or without token ids (routing fallback "
                    "tokenize_failed)", target.url, reason, detail, target.failures, backoff)
