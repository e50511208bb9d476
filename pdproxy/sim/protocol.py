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
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from collections.abc import Mapping

from pdproxy.sim import tokens
from pdproxy.sim.tokens import prompt_seed

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
    prompt_ids: list[int] | None = None  # the prompt as the model sees it (template and BOS included)
    sampling_seed: int | None = None  # the request's `seed` field (pdproxy/sim/generation.py)
    return_token_ids: bool = False  # vLLM 0.23: ids on every choice, the prompt's on the first chunk

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
    model = _check_model(body, served_model)
    if kind == "completion":
        prompt_ids, material = completion_prompt(body.get("prompt"), vocab_size,
                                                 _optional_bool(body, "add_special_tokens", True))
    else:
        prompt_ids, material = chat_prompt(body.get("messages"), _optional_bool(body, "add_generation_prompt", True))
    prompt_tokens = len(prompt_ids)

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
    return_token_ids = _optional_bool(body, "return_token_ids", False)

    max_tokens = _optional_int(body, "max_tokens", minimum=1)
    if kind == "chat":
        max_completion = _optional_int(body, "max_completion_tokens", minimum=1)
        max_tokens = max_completion if max_completion is not None else max_tokens
    elif max_tokens is None and "max_tokens" not in body:
        max_tokens = 16  # vLLM's CompletionRequest default
    min_tokens = _optional_int(body, "min_tokens", minimum=0) or 0

    if prompt_tokens >= max_model_len and max_tokens is None:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"request has {prompt_tokens} input tokens. Please reduce the length of the input "
                            f"prompt. (parameter=input_tokens, value={prompt_tokens})", "input_tokens")
    if max_tokens is None:
        max_tokens = max_model_len - prompt_tokens
    if prompt_tokens + max_tokens > max_model_len:  # vLLM 0.23's words (research/vllm023-api-shapes.md)
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {max_tokens} output tokens and your prompt contains at least "
                            f"{prompt_tokens} input tokens, for a total of at least {prompt_tokens + max_tokens} "
                            "tokens. Please reduce the length of the input prompt or the number of requested "
                            f"output tokens. (parameter=input_tokens, value={prompt_tokens})", "input_tokens")
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
        external_id=external, internal_id=internal, prompt_ids=prompt_ids, sampling_seed=seed_field,
        return_token_ids=return_token_ids,
    )
    return req, target, reason


def completion_prompt(prompt: Any, vocab_size: int, add_special_tokens: bool = True) -> tuple[list[int], str]:
    """A completion's prompt as token ids (text is tokenized, BOS first unless `add_special_tokens` is
    false, as vLLM does) and the material its output words are seeded from."""
    if prompt is None:
        raise APIError(400, "prompt: Field required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise APIError(400, "batched prompts (a list of prompts) are not supported by the simulator; send one "
                            "prompt per request", "prompt")
    if isinstance(prompt, str):
        ids = tokens.encode(prompt)
        if not ids:
            raise APIError(400, "Prompt cannot be empty", "prompt")
        return ([tokens.BOS] if add_special_tokens else []) + ids, prompt
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "Prompt cannot be empty", "prompt")
        for tok in prompt:
            if _not_int(tok):
                raise APIError(400, "prompt: token ids must be integers", "prompt")
            if not 0 <= tok < vocab_size:
                raise APIError(400, f"Token id {tok} is out of vocabulary", "prompt")
        return prompt, "ids:" + ",".join(map(str, prompt))
    raise APIError(400, "prompt: Input should be a string or a list of token ids", "prompt")


def chat_prompt(messages: Any, add_generation_prompt: bool = True) -> tuple[list[int], str]:
    """Chat messages through the template (`tokens.Tokenizer.encode_chat`), and the output seed material."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: a non-empty list of messages is required", "messages")
    parts: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise APIError(400, f"messages[{i}]: each message needs a string 'role'", "messages")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise APIError(400, f"messages[{i}].content: Input should be a string or a list of parts", "messages")
        parts.append(msg["role"] + ":" + (content if isinstance(content, str) else json.dumps(content)))
    return tokens.tokenizer().encode_chat(messages, add_generation_prompt), "\n".join(parts)


def parse_tokenize(body: Any, served_model: str, vocab_size: int) -> tuple[list[int], bool]:
    """vLLM's `POST /tokenize` body: `prompt` (+ `add_special_tokens`, default true) or `messages`
    (+ `add_generation_prompt`, default true); returns the ids and whether `token_strs` are wanted."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    _check_model(body, served_model)
    strs = _optional_bool(body, "return_token_strs", False)
    if "messages" in body:
        return chat_prompt(body["messages"], _optional_bool(body, "add_generation_prompt", True))[0], strs
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise APIError(400, "prompt: Field required (a string), or give messages", "prompt")
    ids = tokens.encode(prompt)
    return ([tokens.BOS] if _optional_bool(body, "add_special_tokens", True) else []) + ids, strs


def parse_detokenize(body: Any, served_model: str, vocab_size: int) -> list[int]:
    """vLLM's `POST /detokenize` body: `tokens`, a list of ids in the vocabulary."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    _check_model(body, served_model)
    ids = body.get("tokens")
    if not isinstance(ids, list) or any(_not_int(t) for t in ids):
        raise APIError(400, "tokens: Input should be a list of integers", "tokens")
    for t in ids:
        if not 0 <= t < vocab_size:
            raise APIError(400, f"Token id {t} is out of vocabulary", "tokens")
    return ids


def _check_model(body: dict[str, Any], served_model: str) -> str:
    """vLLM's `_check_model`: no model, or an empty name, is served by the served model."""
    model = body.get("model")
    if model is None or model == "":
        return served_model
    if not isinstance(model, str):
        raise APIError(400, "model: Input should be a valid string", "model")
    if model != served_model:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")
    return model


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
