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
(at most TRIES instances, each given an equal share; a try left less than half its share is not made). An instance
whose /tokenize times out, cannot be reached or answers 5xx is backed off (1 s, doubling up to MAX_BACKOFF while it
keeps failing; one request probes it when the back-off ends) and the next one is tried; when every instance is
backed off, requests route without token ids until one is due again, at no cost. The instances are the decode
pool's as they are now (`targets`, asked at every choice: instances come and go), their back-off kept by address.

One client cannot switch this off for everyone: what cannot be counted whole is not asked at all (a chat of more
than MAX_KEY_PARTS messages and parts, text past MAX_PROMPT_CHARS, an ask past MAX_ASK_BYTES), and a timeout is
not charged to the instance when the ask was large for its kind (LARGE_FACTOR times the typical size of the asks
answered) or when the proxy's own loop was held past the try's budget (a big body being parsed): the request
then routes without ids, the instance stays in turn. An answer whose length cannot be the prompt's (`plausible`)
is rejected. Every failure is counted (`pdproxy_tokenize_failures_total{server_address, reason}`) and logged when
an instance goes into back-off or comes back; a failure never fails the request, which then routes by the
approximate index, disaggregated.
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
MAX_ASK_BYTES = 4 * MAX_PROMPT_CHARS  # JSON sent to /tokenize at most (a chat's tools, media URLs, ...)
MAX_LOCAL_CHARS = MAX_KEY_TOKENS * 8  # text tokenized locally at most (a longer one is counted as not whole)
TIMEOUT = 0.5  # s: what routing may wait for token ids, all tries together, before it goes without
TRIES = 2  # instances asked at most per request, each within TIMEOUT / TRIES (a hanging one leaves time for another)
MAX_ANSWER_BYTES = 8 * 1024 * 1024
FIRST_BACKOFF, MAX_BACKOFF = 1.0, 60.0  # s
# an ask over LARGE_FACTOR times the typical size of its kind's answered asks (and LARGE_FLOOR bytes) is large: its
# timeout is its own doing; the typical size is a moving average, each answered ask weighing TYPICAL_WEIGHT
LARGE_FACTOR, LARGE_FLOOR, TYPICAL_WEIGHT = 8.0, 16 << 10, 0.05
LATE = 0.05  # s: a timeout that ended this much past its budget was the proxy's loop held, not the instance
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
# timeout_large_ask and timeout_proxy_late are timeouts not charged to the instance (no back-off)
FAILURE_REASONS = ("timeout", "http_status", "bad_answer", "connection", "timeout_large_ask", "timeout_proxy_late")


class Ask:
    """What to send to /tokenize for one request, and what the answer is checked against."""

    __slots__ = ("body", "whole", "chars", "max_tokens", "kind", "payload")

    def __init__(self, body: dict[str, Any], whole: bool, chars: int, max_tokens: int | None, kind: str) -> None:
        self.body = body
        self.whole = whole  # the answer counts the whole request
        self.chars = chars  # characters of text the answer must cover at least
        self.max_tokens = max_tokens  # ids it can have at most (None: a chat template adds an unknown number)
        self.kind = kind  # "chat" or "text": what its size is compared with
        self.payload = jsonio.dumps(body)  # serialised once, whatever the tries

    def plausible(self, count: int) -> bool:
        return count * MAX_CHARS_PER_TOKEN >= self.chars and (self.max_tokens is None or count <= self.max_tokens)


def tokenize_body(view: RequestView) -> Ask | None:
    """What to ask /tokenize for this request; None when there is nothing to tokenize, or more than can be
    counted whole at a fair cost to the instance (whose API server every other request waits for)."""
    body = view.body
    model = body.get("model")
    base: dict[str, Any] = {"model": model} if isinstance(model, str) else {}
    if view.chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        size = _chat_text_size(messages)
        if size is None or size[0] > MAX_PROMPT_CHARS:
            return None
        ask = {**base, "messages": messages, **{k: body[k] for k in CHAT_FIELDS if body.get(k) is not None}}
        return _within_bytes(Ask(ask, size[1] and not body.get("documents"), size[0], None, "chat"))
    prompt = prompt_of(body)
    if not isinstance(prompt, str) or not prompt or len(prompt) > MAX_PROMPT_CHARS:
        return None
    special = body.get("add_special_tokens", True)
    special = special if isinstance(special, bool) else True
    return _within_bytes(Ask({**base, "prompt": prompt, "add_special_tokens": special}, True, len(prompt),
                             len(prompt.encode("utf-8", "surrogatepass")) + MAX_SPECIAL_TOKENS, "text"))


def _within_bytes(ask: Ask) -> Ask | None:
    return ask if len(ask.payload) <= MAX_ASK_BYTES else None


def _chat_text_size(messages: list[Any]) -> tuple[int, bool] | None:
    """The characters of the messages' text, and whether text is all they hold (no image, audio, file parts); None
    for more than MAX_KEY_PARTS messages and content parts in all: not sent to /tokenize (what routing keys is
    within that many anyway), so no chat of millions of messages holds an instance's API server."""
    if len(messages) > MAX_KEY_PARTS:
        return None
    chars, visited, whole = 0, len(messages), True
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            visited += len(content)
            if visited > MAX_KEY_PARTS:
                return None
            for part in content:
                text = part.get("text") if isinstance(part, Mapping) else None
                if isinstance(text, str) and part.get("type", "text") == "text":
                    chars += len(text)
                else:
                    whole = False  # a media part: /tokenize does not count what the engine makes of it
    return chars, whole


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
    """Token ids from the instances' /tokenize, taken in turn, each backed off while it fails.

    `targets`: the instances as they are now, `(url, address)` pairs, asked at every choice (the decode pool's
    instances come and go); each one's back-off is kept by address, and forgotten once it is no longer listed."""

    def __init__(self, session: aiohttp.ClientSession, targets: Callable[[], Sequence[tuple[str, str]]],
                 headers: dict[str, str], count: Callable[[str, str], None] = lambda address, reason: None,
                 timeout: float = TIMEOUT) -> None:
        self.session, self.count = session, count
        self.headers = {**headers, "Content-Type": "application/json"}
        self.targets = targets
        self.state: dict[str, Target] = {}  # address -> its /tokenize and back-off, for the instances listed
        self.timeout = timeout
        self.typical = {"chat": 0.0, "text": 0.0}  # bytes of an answered ask, a moving average per kind
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
            share = self.timeout / len(ready)
            left = min(deadline - loop.time(), share)
            if left < share / 2:
                return  # too little left for a fair try (the loop was held): not made, so not charged
            if not target.ready(time.monotonic()):
                continue  # another request went to probe it meanwhile
            started = loop.time()
            ids, reason, detail, its_fault = await self._ask(target, ask, left)
            if ids is not None:
                view.token_ids, view.whole = ids, ask.whole
                typical = self.typical[ask.kind]
                self.typical[ask.kind] = typical + TYPICAL_WEIGHT * (len(ask.payload) - typical) if typical \
                    else float(len(ask.payload))
                return
            if reason == "timeout":
                late = loop.time() - started - left
                if late > LATE:
                    reason, its_fault = "timeout_proxy_late", False
                    detail += f", the proxy's own loop {late:.2f}s late"
                elif len(ask.payload) > max(LARGE_FLOOR, LARGE_FACTOR * self.typical[ask.kind]):
                    reason, its_fault = "timeout_large_ask", False
                    detail += f" for {len(ask.payload)} bytes, large for a {ask.kind} ask"
            self._failed(target, reason, detail, its_fault)
            if not its_fault:
                return  # the request's own doing (a 4xx, an odd prompt): another instance would answer the same

    def _ready(self) -> list[Target]:
        """The instances listed now that are not backed off, starting with the next in turn."""
        state, targets = self.state, []
        for url, address in self.targets():
            target = state.get(address)
            if target is None or target.url != url:
                target = state[address] = Target(url, address)
            targets.append(target)
        if len(state) > len(targets):  # instances gone: their back-off with them
            listed = {t.address for t in targets}
            for address in [a for a in state if a not in listed]:
                del state[address]
        n = len(targets)
        if not n:
            return []
        now = time.monotonic()
        self._turn = (self._turn + 1) % n
        return [t for k in range(n) if (t := targets[(self._turn + k) % n]).ready(now)]

    async def _ask(self, target: Target, ask: Ask, timeout: float) -> tuple[list[int] | None, str, str, bool]:
        """The ids, or why not: a failure reason (FAILURE_REASONS), what happened, and whether the fault is the
        instance's (no answer, any status but a 4xx) rather than the request's (a 4xx, an answer that cannot be
        its prompt's)."""
        target.probing = target.failures > 0
        try:
            async with self.session.post(target.url + "/tokenize", data=ask.payload, headers=self.headers,
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
