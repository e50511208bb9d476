"""What the instances serve, read from their `GET /v1/models`: the model names and each one's `max_model_len`.

Why: a request for a model no instance serves, or asking for more tokens than the model's context
holds, is refused by vLLM with 404 or 400 — in P/D only after a prefill was spent on it, and the
decode's refusal left the prefill's KV blocks held until vLLM's abort timeout. The proxy answers
those itself, with vLLM 0.23's own status and error body, before the prefill.

The listing is read at start and refreshed in the background (never on a request's path); until an
instance has answered, nothing is checked. Only vLLM's listings are checked against: one whose entries
lack vLLM's `max_model_len` comes from another OpenAI-compatible server (some serve any name asked
for while listing one), and turns the checks off. A name counts as served when any instance lists it
or the operator gave it (`--served-model-name`, `--model`); its `max_model_len` is the largest an
instance gives (refused is only what no instance could serve). Also the one reader of the listings: each listed name is learnt by the telemetry's bounded
`ModelNames` (pdproxy/telemetry/models.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp

from pdproxy import jsonio
from pdproxy.errors import VllmError
from pdproxy.telemetry.models import MIN_REFRESH_SECONDS, ModelNames

MAX_MODELS = 100  # listed names kept for the check; a listing beyond it is not checked against


class ServedModels:
    """The served names and their context lengths, and the check of a parsed request against them."""

    def __init__(self, names: ModelNames, given: Iterable[str] = ()) -> None:
        self.names = names
        self.given = frozenset(name for name in given if name)
        self.context: dict[str, int] = {}  # listed name -> the largest max_model_len listed for it
        self.listed = False  # an instance has answered: checks apply from now on
        self.foreign = False  # a listing not vLLM's (no max_model_len): nothing is checked

    def update(self, entries: list[dict[str, Any]]) -> None:
        """One instance's listing."""
        for entry in entries:
            name, length = entry.get("id"), entry.get("max_model_len")
            if not isinstance(name, str) or not name:
                continue
            self.names.learn(name)
            if name not in self.context and len(self.context) >= MAX_MODELS:
                continue
            if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
                self.foreign = True
                continue
            self.context[name] = max(self.context.get(name, length), length)
        self.listed = True

    def check(self, body: dict[str, Any], chat: bool) -> None:
        """Raise vLLM's refusal of a request no instance can serve: an unknown model (404) or more
        tokens than the model's context (400). Decided from the parsed (validated) body alone."""
        if not self.listed or self.foreign or len(self.context) >= MAX_MODELS:
            return
        model = body.get("model")
        if model is None:
            return  # vLLM serves it with its own model
        if model not in self.context:
            if model in self.given:
                return
            raise VllmError(404, f"The model `{model}` does not exist.", "NotFoundError", "model",
                            error_type="model_not_found")
        limit = self.context[model]
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

    def describe(self) -> dict[str, Any]:
        """For `/status`."""
        return {"checked": self.listed and not self.foreign, "max_model_len": dict(sorted(self.context.items()))}

    # -- asking the instances -----------------------------------------------------------------

    async def refresh(self, session: aiohttp.ClientSession, urls: Iterable[str], headers: Mapping[str, str],
                      timeout: float) -> bool:
        """Read every instance's listing; an instance that does not answer is skipped. True when every
        instance answered with one."""
        results = await asyncio.gather(*(listing(session, url, headers, timeout) for url in urls))
        for entries in results:
            if entries is not None:
                self.update(entries)
        return all(entries is not None for entries in results)

    async def watch(self, session: aiohttp.ClientSession, urls: list[str], headers: Mapping[str, str],
                    interval: float, timeout: float) -> None:
        """Refresh now, then every `interval` seconds but at most every MIN_REFRESH_SECONDS; with `interval`
        0 (health checks off) only until every instance has answered once: an instance that came up
        after the proxy would otherwise never be asked. Run as a task."""
        while True:
            everyone = await self.refresh(session, urls, headers, timeout)
            if interval <= 0 and everyone:
                return
            await asyncio.sleep(max(interval, MIN_REFRESH_SECONDS))


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
