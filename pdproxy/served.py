"""What the instances serve, read from their `GET /v1/models`: the model names and each one's `max_model_len`.

Why: a request for a model no instance serves, or asking for more tokens than the model's context
holds, is refused by vLLM with 404 or 400 — in P/D only after a prefill was spent on it, and the
decode's refusal left the prefill's KV blocks held until vLLM's abort timeout. The proxy answers
those itself, with vLLM 0.23's own status and error body, before the prefill; and refuses nothing vLLM
would serve.

The listings are read at start and refreshed in the background, of the instances there are at each refresh
(`urls`, asked every time: instances come and go), each instance's last listing standing for it until it
answers again or is gone; a name no instance lists any more is forgotten. Until an instance has answered,
nothing is checked. Only vLLM's listings are checked against: one whose base entries lack vLLM's
`max_model_len` comes from another OpenAI-compatible server (some serve any name asked for while listing
one), and turns the checks off while it is listed. A LoRA adapter's entry has a `parent` and no
`max_model_len` (vLLM's ModelCard): its context is its parent's. A name counts as served when any instance lists
it or the operator gave it (`--served-model-name`, `--model`); its `max_model_len` is the largest an instance
gives (refused is only what no instance could serve).

vLLM serves more than it lists (its `_check_model`): a request without a model or with `"model": ""` gets its
first served model (checked here against that model's context); an adapter its LoRA resolver loads on the first
request for it; any name at all under `VLLM_SKIP_MODEL_NAME_VALIDATION`. So a name nobody lists is refused only
once the listings were read again (at most every RELIST_SECONDS) and the instances were asked: a `POST /detokenize`
of no tokens for that name goes through vLLM's own model check (loading a resolver's adapter as the request
would), and only when every instance answers vLLM's 404 is the request refused. A name served that way is taken
for CONFIRMED_SECONDS, a refused one refused for REFUSED_SECONDS without asking again; an instance that does
not answer, or answers anything else, lets the request through (vLLM decides). Also the one reader of the
listings: each listed name is learnt by the telemetry's bounded `ModelNames` (pdproxy/telemetry/models.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import aiohttp

from pdproxy import jsonio
from pdproxy.errors import VllmError
from pdproxy.telemetry.models import MAX_NAME_LENGTH, MIN_REFRESH_SECONDS, ModelNames

MAX_MODELS = 100  # listed names kept for the check; a listing beyond it is not checked against
RELIST_SECONDS = 1.0  # an unknown name re-reads the listings at most this often
CONFIRMED_SECONDS, REFUSED_SECONDS = 30.0, 2.0  # an asked name's answer stands this long
MAX_ASKING = 8  # names being asked at once; an unknown name beyond them is decided by the listings alone


class Listing:
    """One instance's answer to /v1/models: its names, their contexts, and its default model's."""

    __slots__ = ("context", "default", "foreign")

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        self.context: dict[str, int | None] = {}  # name -> max_model_len (None: an adapter of an unknown parent)
        self.default: int | None = None  # the first base model's: what a request without a model gets
        self.foreign = False  # a base entry without max_model_len: not vLLM's listing
        adapters: list[tuple[str, str]] = []
        for entry in entries:
            name, length, parent = entry.get("id"), entry.get("max_model_len"), entry.get("parent")
            if not isinstance(name, str) or not name:
                continue
            if isinstance(parent, str) and parent:
                adapters.append((name, parent))  # vLLM lists an adapter with its base model as parent
            elif not isinstance(length, int) or isinstance(length, bool) or length <= 0:
                self.foreign = True
            else:
                self.context[name] = max(self.context.get(name) or length, length)
                self.default = length if self.default is None else self.default
        for name, parent in adapters:
            self.context.setdefault(name, self.context.get(parent))


class ServedModels:
    """The served names and their context lengths, and the check of a parsed request against them."""

    def __init__(self, names: ModelNames, given: Iterable[str] = ()) -> None:
        self.names = names
        self.given = frozenset(name for name in given if name)
        self.listings: dict[str, Listing] = {}  # instance URL -> its last listing
        self.context: dict[str, int | None] = {}  # listed name -> the largest max_model_len listed for it
        self.default: int | None = None  # the largest context of the instances' default models
        self.listed = False  # an instance has answered: checks apply from now on
        self.foreign = False  # a listing not vLLM's (no max_model_len): nothing is checked
        self.asked: dict[str, tuple[bool, float]] = {}  # name -> (served, until when), as the instances answered
        self._asking: dict[str, asyncio.Future[bool | None]] = {}
        self._relisting: asyncio.Future[None] | None = None
        self._listed_at = float("-inf")  # monotonic: the last refresh began
        self._source: tuple[aiohttp.ClientSession, Callable[[], Sequence[str]], Mapping[str, str], float] | None = None

    def update(self, url: str, entries: list[dict[str, Any]]) -> None:
        """One instance's listing, standing for it from now on."""
        for entry in entries:
            self.names.learn(entry.get("id"))
        self.listings[url] = Listing(entries)
        self._merge()

    def keep_only(self, urls: Iterable[str]) -> None:
        """Forget the listings of instances that are gone."""
        current = set(urls)
        if self.listings.keys() - current:
            self.listings = {url: listing for url, listing in self.listings.items() if url in current}
            self._merge()

    def _merge(self) -> None:
        context: dict[str, int | None] = {}
        for listing in self.listings.values():
            for name, length in listing.context.items():
                known = context.get(name)
                context[name] = length if known is None else max(known, length or 0)
        self.context = context if len(context) <= MAX_MODELS else {}
        self.foreign = len(context) > MAX_MODELS or any(listing.foreign for listing in self.listings.values())
        defaults = [listing.default for listing in self.listings.values() if listing.default is not None]
        self.default = max(defaults) if defaults else None
        self.listed = bool(self.listings)

    def check(self, body: dict[str, Any], chat: bool) -> Awaitable[None] | None:
        """Raise vLLM's refusal of a request no instance can serve: an unknown model (404) or more tokens than
        the model's context (400). Decided from the parsed (validated) body and the listings; for a name no
        instance lists, returns what to await instead (the instances are asked; it raises the 404)."""
        if not self.listed or self.foreign:
            return None
        model = body.get("model")
        if not model:  # vLLM serves it with its first served model
            if self.default is not None:
                _check_length(body, chat, self.default)
            return None
        if model in self.context:
            limit = self.context[model]
            if limit is not None:
                _check_length(body, chat, limit)
            return None
        if model in self.given:
            return None
        return self._confirm(model, body, chat)

    async def _confirm(self, model: str, body: dict[str, Any], chat: bool) -> None:
        """A name no instance lists: the listings read again, then the instances asked; 404 when none serves it."""
        answer = self.asked.get(model)
        if answer is not None and answer[1] > time.monotonic():
            if answer[0]:
                return
            raise _not_found(model)
        await self._relist()
        if self.foreign:
            return
        if model in self.context:
            limit = self.context[model]
            if limit is not None:
                _check_length(body, chat, limit)
            return
        served = await self._ask(model)
        if served is False:
            raise _not_found(model)

    async def _relist(self) -> None:
        """Read the listings again, unless that was done less than RELIST_SECONDS ago (concurrent callers share it)."""
        if self._relisting is not None:
            await asyncio.shield(self._relisting)
            return
        if self._source is None or time.monotonic() - self._listed_at < RELIST_SECONDS:
            return
        self._relisting = asyncio.get_running_loop().create_future()
        try:
            await self.refresh(*self._source)
        finally:
            self._relisting.set_result(None)
            self._relisting = None

    async def _ask(self, model: str) -> bool | None:
        """Whether the instances serve `model`: True when one does, False when every one refused it as vLLM does,
        None when that is not known (no answer, another answer, or too many names being asked)."""
        if model in self._asking:
            return await asyncio.shield(self._asking[model])
        if self._source is None or len(self._asking) >= MAX_ASKING:
            return False  # a flood of unknown names: decided by the listings, read just now
        asking = self._asking[model] = asyncio.get_running_loop().create_future()
        served: bool | None = None
        try:
            session, urls, headers, timeout = self._source
            served = await _served_by_any(session, list(urls()), headers, timeout, model)
        finally:
            del self._asking[model]
            asking.set_result(served)
        if served is not None and len(model) <= MAX_NAME_LENGTH:  # (a longer one is asked each time: no memory)
            if len(self.asked) >= MAX_MODELS:
                del self.asked[next(iter(self.asked))]  # the oldest answer
            self.asked[model] = (served, time.monotonic() + (CONFIRMED_SECONDS if served else REFUSED_SECONDS))
        return served

    def describe(self) -> dict[str, Any]:
        """For `/status`."""
        now = time.monotonic()
        return {"checked": self.listed and not self.foreign,
                "max_model_len": dict(sorted(self.context.items())),
                "served_when_asked": sorted(name for name, (served, until) in self.asked.items()
                                            if served and until > now)}

    # -- asking the instances -----------------------------------------------------------------

    async def refresh(self, session: aiohttp.ClientSession, urls: Callable[[], Sequence[str]],
                      headers: Mapping[str, str], timeout: float) -> bool:
        """Read the listing of every instance there is now; one that does not answer keeps its last listing. True
        when every instance answered with one."""
        self._listed_at = time.monotonic()
        current = list(urls())
        results = await asyncio.gather(*(listing(session, url, headers, timeout) for url in current))
        for url, entries in zip(current, results):
            if entries is not None:
                self.update(url, entries)
        self.keep_only(urls())
        return all(entries is not None for entries in results)

    async def watch(self, session: aiohttp.ClientSession, urls: Callable[[], Sequence[str]],
                    headers: Mapping[str, str], interval: float, timeout: float) -> None:
        """Refresh now, then every `interval` seconds but at most every MIN_REFRESH_SECONDS (and every
        MIN_REFRESH_SECONDS with health checks off, `interval` 0), of the instances `urls()` gives at each
        refresh; a name nobody lists also refreshes them, at most every RELIST_SECONDS. Run as a task."""
        self._source = (session, urls, headers, timeout)
        while True:
            await self._relist_now()
            await asyncio.sleep(max(interval, MIN_REFRESH_SECONDS))

    async def _relist_now(self) -> None:
        assert self._source is not None
        while self._relisting is not None:
            await asyncio.shield(self._relisting)
        self._listed_at = float("-inf")
        await self._relist()


def _not_found(model: str) -> VllmError:
    return VllmError(404, f"The model `{model}` does not exist.", "NotFoundError", "model",
                     error_type="model_not_found")


def _check_length(body: dict[str, Any], chat: bool, limit: int) -> None:
    """vLLM's 400 for more tokens than the model's context, from what the body alone says."""
    wanted = body.get("max_completion_tokens") if chat else None
    if wanted is None:
        wanted = body.get("max_tokens", None if chat else 16)  # vLLM's CompletionRequest default
    if not isinstance(wanted, int):
        return  # chat without a limit: vLLM fills the context, whatever the prompt
    prompt = _prompt_tokens_at_least(body, chat)
    if prompt + wanted > limit:  # vLLM 0.23's words (its serving_engine's length check)
        raise VllmError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{wanted} output tokens and your prompt contains at least {prompt} input tokens, "
                             f"for a total of at least {prompt + wanted} tokens. Please reduce the length of "
                             "the input prompt or the number of requested output tokens. "
                             f"(parameter=input_tokens, value={prompt})", "BadRequestError", "input_tokens",
                        error_type="context_length_exceeded")


def _prompt_tokens_at_least(body: dict[str, Any], chat: bool) -> int:
    """A lower bound of the prompt's tokens without a tokenizer: exact for token ids, else one for any
    non-empty prompt (no tokenizer makes zero tokens of text; a chat template adds its own)."""
    if chat:
        return 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return max(len(p) for p in prompt)  # a batch: vLLM refuses it when one of its prompts is too long
    return 1 if prompt else 0


async def listing(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str],
                  timeout: float) -> list[dict[str, Any]] | None:
    """The entries an instance lists in /v1/models; None when it gave no listing."""
    try:
        async with session.get(url + "/v1/models", headers=dict(headers),
                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                return None
            body = await resp.json(content_type=None, loads=jsonio.loads)  # deep nesting: ValueError
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


async def _served_by_any(session: aiohttp.ClientSession, urls: list[str], headers: Mapping[str, str],
                         timeout: float, model: str) -> bool | None:
    """Ask each instance's model check about `model`: True as soon as one passes it, False when every one
    refused it as vLLM refuses an unknown model, else None."""
    if not urls:
        return None
    asks = [asyncio.ensure_future(_model_check(session, url, headers, timeout, model)) for url in urls]
    refused = 0
    try:
        for done in asyncio.as_completed(asks):
            verdict = await done
            if verdict is True:
                return True
            refused += verdict is False
    finally:
        for ask in asks:
            ask.cancel()
    return False if refused == len(urls) else None


async def _model_check(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str], timeout: float,
                       model: str) -> bool | None:
    """One instance's model check of `model`, by `POST /detokenize` of no tokens (vLLM checks the model first,
    and its LoRA resolver loads an adapter there as for a request): True when it passed (any answer but a 404),
    False for vLLM's 404 of an unknown model, None for no answer or another 404 (a server without the route)."""
    try:
        async with session.post(url + "/detokenize", data=jsonio.dumps({"model": model, "tokens": []}),
                                headers={**headers, "Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 404:
                return resp.status < 500 or None
            body = await resp.json(content_type=None, loads=jsonio.loads)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return False if isinstance(error, dict) and error.get("type") == "NotFoundError" else None
