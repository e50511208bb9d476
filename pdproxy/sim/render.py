"""The response side of the wire format: vLLM-shaped JSON bodies and SSE chunks.

Content chunks are the hot path (one per step per stream, and thousands per second with the
instant preset), so their JSON is a per-request template with only the text spliced in; the
rare chunks (role, finish, usage) are built as dicts.
"""

from __future__ import annotations

import json
from typing import Any

from pdproxy.sim.engine import Sequence
from pdproxy.sim.protocol import GenerationRequest

DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def request_metrics(seq: Sequence) -> dict[str, float]:
    """vLLM's `--enable-per-request-metrics` object (milliseconds).

    time_to_first_token_ms: scheduled -> first token; queue_time_ms: queued -> scheduled
    (on a decode this includes the KV pull); generation_time_ms: first -> last token;
    mean_itl_ms: generation time / (tokens - 1); tokens_per_second: tokens / (scheduled -> last token).
    """
    scheduled = seq.scheduled_at if seq.scheduled_at is not None else seq.queued_at
    first = seq.first_token_at if seq.first_token_at is not None else scheduled
    last = seq.last_token_at if seq.last_token_at is not None else first
    n = seq.num_generated
    generation = last - first
    running = last - scheduled
    return {
        "time_to_first_token_ms": round((first - scheduled) * 1000, 3),
        "generation_time_ms": round(generation * 1000, 3),
        "queue_time_ms": round((scheduled - seq.queued_at) * 1000, 3),
        "mean_itl_ms": round(generation * 1000 / (n - 1), 3) if n > 1 else 0.0,
        "tokens_per_second": round(n / running, 3) if running > 0 else 0.0,
    }


class Renderer:
    """All bodies and chunks of one request."""

    def __init__(self, req: GenerationRequest, created: int) -> None:
        self.req = req
        self.chat = req.kind == "chat"
        self.created = created
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        head = json.dumps({"id": req.external_id, "object": self.chunk_object, "created": created,
                           "model": req.model}, separators=(",", ":"))[:-1]
        if self.chat:
            self._head = "data: " + head + ',"choices":[{"index":0,"delta":{"content":'
            self._tail = '},"logprobs":null,"finish_reason":null'
        else:
            self._head = "data: " + head + ',"choices":[{"index":0,"text":'
            self._tail = ',"logprobs":null,"finish_reason":null,"stop_reason":null'

    def _ids(self, token_ids: list[int] | None, prompt_ids: list[int] | None = None) -> dict[str, Any]:
        """vLLM 0.23's `return_token_ids` fields of a choice: completions always carry both keys (null
        without the flag), chat carries `token_ids` only with the flag (the prompt's go top-level)."""
        if self.chat:
            return {} if token_ids is None else {"token_ids": token_ids}
        return {"prompt_token_ids": prompt_ids, "token_ids": token_ids}

    # ---- streaming -------------------------------------------------------------------------
    def content_chunk(self, text: str, usage_obj: dict[str, Any] | None = None, token_ids: list[int] | None = None,
                      prompt_ids: list[int] | None = None) -> bytes:
        extra = "" if usage_obj is None else ',"usage":' + json.dumps(usage_obj, separators=(",", ":"))
        ids = "".join(f',"{k}":{json.dumps(v, separators=(",", ":"))}'
                      for k, v in self._ids(token_ids, prompt_ids).items())
        return (self._head + json.dumps(text) + self._tail + ids + "}]" + extra + "}\n\n").encode()

    def role_chunk(self, usage_obj: dict[str, Any] | None = None, prompt_ids: list[int] | None = None) -> bytes:
        chunk = self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
        if prompt_ids is not None:
            chunk["prompt_token_ids"], chunk["prompt_text"] = prompt_ids, None
        if usage_obj is not None:
            chunk["usage"] = usage_obj
        return _sse(chunk)

    def final_chunk(self, text: str, finish_reason: str, usage_obj: dict[str, Any] | None,
                    kv_params: dict[str, Any] | None, metrics: dict[str, Any] | None = None,
                    token_ids: list[int] | None = None, prompt_ids: list[int] | None = None) -> bytes:
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None}
        choice.update(self._ids(token_ids, prompt_ids))
        chunk = self._chunk([choice])
        if usage_obj is not None:
            chunk["usage"] = usage_obj
        if kv_params is not None:
            chunk["kv_transfer_params"] = kv_params
        if metrics is not None:
            chunk["metrics"] = metrics
        return _sse(chunk)

    def usage_chunk(self, usage_obj: dict[str, Any], metrics: dict[str, Any] | None) -> bytes:
        chunk = self._chunk([])
        chunk["usage"] = usage_obj
        if metrics is not None:
            chunk["metrics"] = metrics
        return _sse(chunk)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.req.external_id, "object": self.chunk_object, "created": self.created,
                "model": self.req.model, "choices": choices}

    # ---- non-streaming ---------------------------------------------------------------------------
    def body(self, text: str, finish_reason: str, usage_obj: dict[str, Any], kv_params: dict[str, Any] | None,
             metrics: dict[str, Any] | None, token_ids: list[int] | None = None,
             prompt_ids: list[int] | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                              "tool_calls": [], "reasoning_content": None},
                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None, "token_ids": token_ids, "prompt_logprobs": None,
                      "prompt_token_ids": prompt_ids}
            obj = "text_completion"
        if self.chat and token_ids is not None:
            choice["token_ids"] = token_ids
        out: dict[str, Any] = {"id": self.req.external_id, "object": obj, "created": self.created,
                               "model": self.req.model, "choices": [choice], "usage": usage_obj,
                               "system_fingerprint": None, "kv_transfer_params": kv_params}
        if self.chat and prompt_ids is not None:
            out["prompt_token_ids"] = prompt_ids
        if metrics is not None:
            out["metrics"] = metrics
        return out


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
