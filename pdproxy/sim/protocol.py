"""The OpenAI-compatible request side: validation, token counts, ids and error bodies.

Validation follows what vLLM answers, so a proxy sees the same statuses from the simulator as
from a real instance: 404 for a model it does not serve, 400 for malformed fields, for
`n != 1` (not simulated), for `min_tokens > max_tokens`, and for prompt + max_tokens over
max-model-len. Every failure is an `APIError`, rendered as
``{"error": {"message", "type", "param", "code"}}``; nothing reaches the client as a traceback.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from collections.abc import Mapping

from pdproxy.sim.tokens import CHAT_TOKENS_PER_MESSAGE, chat_content_words, prompt_seed

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 408: "TimeoutError", 409: "ConflictError", 410: "GoneError",
               422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
               502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or error_type(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.err_type)


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "Error"


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type or error_type(status), "param": param, "code": status}}


@dataclass
class GenerationRequest:
    """A validated `/v1/completions` or `/v1/chat/completions` request."""

    kind: str  # "completion" or "chat"
    model: str
    prompt_tokens: int
    seed: int  # for the output words
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    kv_transfer_params: dict[str, Any] | None
    external_id: str  # the response id: cmpl-<X-Request-Id> / chatcmpl-<X-Request-Id>
    internal_id: str  # the engine's id: external id (+ "-0" for completions) + "-<8 hex>"
    prompt_units: list[Any] = field(default_factory=list)  # one per prompt token: what prefix caching hashes

    @property
    def do_remote_decode(self) -> bool:
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"))

    @property
    def do_remote_prefill(self) -> bool:
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_prefill"))


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or an APIError(400) that says why not."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None


def parse_generation(kind: str, body: Any, headers: Mapping[str, str], served_model: str, max_model_len: int,
                     vocab_size: int, eos_after_tokens: int = 0) -> tuple[GenerationRequest, int, str]:
    """Validate a request; returns it with the number of tokens to generate and the finish reason then."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = served_model
    elif not isinstance(model, str):
        raise APIError(400, "model: Input should be a valid string", "model")
    elif model != served_model:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")

    if kind == "completion":
        prompt_tokens, material, units = _completion_prompt(body.get("prompt"), vocab_size)
    else:
        prompt_tokens, material, units = _chat_prompt(body.get("messages"))

    n = body.get("n")
    if n is not None and (_not_int(n) or n != 1):
        raise APIError(400, "n: only n=1 is supported by the simulator", "n")
    stream = _optional_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise APIError(400, "stream_options: Input should be a valid dictionary", "stream_options")
        if not stream:
            raise APIError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    options = options or {}
    include_usage = _optional_bool(options, "include_usage", False, "stream_options.")
    continuous_usage = _optional_bool(options, "continuous_usage_stats", False, "stream_options.")
    ignore_eos = _optional_bool(body, "ignore_eos", False)

    max_tokens = _optional_int(body, "max_tokens", minimum=1)
    if kind == "chat":
        max_completion = _optional_int(body, "max_completion_tokens", minimum=1)
        max_tokens = max_completion if max_completion is not None else max_tokens
    elif max_tokens is None and "max_tokens" not in body:
        max_tokens = 16  # vLLM's CompletionRequest default
    min_tokens = _optional_int(body, "min_tokens", minimum=0) or 0

    if prompt_tokens >= max_model_len and max_tokens is None:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"request has {prompt_tokens} input tokens. Please reduce the length of the input.")
    if max_tokens is None:
        max_tokens = max_model_len - prompt_tokens
    if prompt_tokens + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                            f"{max_tokens} in the completion). Please reduce the length of the messages or "
                            "completion.")
    if min_tokens > max_tokens:
        raise APIError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
                       "min_tokens")

    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise APIError(400, "kv_transfer_params: Input should be a valid dictionary", "kv_transfer_params")
    seed_field = body.get("seed")
    if seed_field is not None and _not_int(seed_field):
        raise APIError(400, "seed: Input should be a valid integer", "seed")

    base = headers.get("x-request-id") or body.get("request_id")
    if base is not None and not isinstance(base, str):
        raise APIError(400, "request_id: Input should be a valid string", "request_id")
    base = base or uuid.uuid4().hex
    suffix = uuid.uuid4().hex[:8]
    if kind == "completion":
        external, internal = f"cmpl-{base}", f"cmpl-{base}-0-{suffix}"
    else:
        external, internal = f"chatcmpl-{base}", f"chatcmpl-{base}-{suffix}"

    target, reason = max_tokens, "length"
    if eos_after_tokens > 0 and not ignore_eos:
        stop_at = max(eos_after_tokens, min_tokens)
        if stop_at < max_tokens:
            target, reason = stop_at, "stop"

    req = GenerationRequest(
        kind=kind, model=model, prompt_tokens=prompt_tokens, seed=prompt_seed(material, seed_field),
        max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, stream=stream,
        include_usage=include_usage, continuous_usage=continuous_usage, kv_transfer_params=kv,
        external_id=external, internal_id=internal, prompt_units=units,
    )
    return req, target, reason


def _completion_prompt(prompt: Any, vocab_size: int) -> tuple[int, str, list[Any]]:
    if prompt is None:
        raise APIError(400, "prompt: Field required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise APIError(400, "batched prompts (a list of prompts) are not supported by the simulator; send one "
                            "prompt per request", "prompt")
    if isinstance(prompt, str):
        words = prompt.split()  # the simulator's tokens (pdproxy/sim/tokens.py)
        if not words:
            raise APIError(400, "Prompt cannot be empty", "prompt")
        return len(words), prompt, words
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "Prompt cannot be empty", "prompt")
        for tok in prompt:
            if _not_int(tok):
                raise APIError(400, "prompt: token ids must be integers", "prompt")
            if not 0 <= tok < vocab_size:
                raise APIError(400, f"Token id {tok} is out of vocabulary", "prompt")
        return len(prompt), "ids:" + ",".join(map(str, prompt)), prompt
    raise APIError(400, "prompt: Input should be a string or a list of token ids", "prompt")


def _chat_prompt(messages: Any) -> tuple[int, str, list[Any]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: a non-empty list of messages is required", "messages")
    words = 0
    parts: list[str] = []
    units: list[Any] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise APIError(400, f"messages[{i}]: each message needs a string 'role'", "messages")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise APIError(400, f"messages[{i}].content: Input should be a string or a list of parts", "messages")
        words += chat_content_words(content)
        # the template's tokens around each message, then its text (as chat_content_words counts it)
        units += [f"<|{msg['role']}|>", "<|header|>", "<|eot|>", "\n"][:CHAT_TOKENS_PER_MESSAGE]
        texts = [content] if isinstance(content, str) else [
            p["text"] for p in content or () if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)]
        units += [w for t in texts for w in t.split()]
        parts.append(msg["role"] + ":" + (content if isinstance(content, str) else json.dumps(content)))
    return words + CHAT_TOKENS_PER_MESSAGE * len(messages), "\n".join(parts), units


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _optional_int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if _not_int(value):
        raise APIError(400, f"{name}: Input should be a valid integer", name)
    if value < minimum:
        raise APIError(400, f"{name} must be at least {minimum}, got {value}.", name)
    return value


def _optional_bool(body: Mapping[str, Any], name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{prefix}{name}: Input should be a valid boolean", prefix + name)
    return value
