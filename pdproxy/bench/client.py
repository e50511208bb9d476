"""One streamed request, timed on the client like `vllm bench serve` does.

Definitions (research/vllm-proxy.md §7), all measured on this process's monotonic clock:

* start: just before the POST is sent;
* TTFT: start → first *token-bearing* SSE message. Completions: any message with `choices`
  (even empty text). Chat: a delta with `content`, `reasoning(_content)` or `tool_calls`; the
  role-only opening chunk does not count (an empty-string content without `role` does);
* chunk gaps: time between consecutive token-bearing messages (one sample per chunk);
* token counts per chunk: from `usage.completion_tokens` when the server streams usage on every
  chunk (`stream_options.continuous_usage_stats`), else unknown;
* E2E: start → last token-bearing message (the trailing usage chunk and `[DONE]` excluded);
* failed: HTTP status ≠ 200, an exception (connect error, timeout, broken stream), an `error`
  object inside the stream, or no token-bearing message at all; each with a reason.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Outcome:
    """What the client saw for one request; times are seconds relative to `start`."""

    status: int | None = None
    error: str | None = None
    error_detail: str | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] | None = None
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    end: float | None = None  # last byte of the response (incl. usage chunk / [DONE])
    text: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def new_traceparent() -> tuple[str, str, str]:
    """A fresh W3C traceparent (sampled) and its trace and span ids."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _token_bearing(obj: dict[str, Any], chat: bool) -> bool:
    choices = obj.get("choices")
    if not choices:
        return False
    if not chat:
        return True
    for ch in choices:
        delta = ch.get("delta") or {}
        if delta.get("reasoning") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
        content = delta.get("content")
        if content or (content == "" and "role" not in delta):
            return True
    return False


def _text_of(obj: dict[str, Any], chat: bool) -> str:
    out = []
    for ch in obj.get("choices") or []:
        out.append(((ch.get("delta") or {}).get("content") or "") if chat else (ch.get("text") or ""))
    return "".join(out)


def _error_reason(status: int) -> str:
    return f"http_{status}"


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    *,
    chat: bool,
    timeout: float,
    save_text: bool = False,
) -> tuple[float, Outcome]:
    """POST one streaming request; returns (start on the monotonic clock, outcome)."""
    out = Outcome()
    usage_tokens: list[int | None] = []
    last_usage: int | None = None
    texts: list[str] = []
    start = time.perf_counter()
    try:
        async with session.post(
            url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            out.status = resp.status
            if resp.status != 200:
                raw = await resp.read()
                out.error = _error_reason(resp.status)
                out.error_detail = _short_error(raw)
                out.end = time.perf_counter() - start
                return start, out
            data_lines: list[str] = []
            done = False
            async for raw_line in resp.content:
                line = raw_line.decode("utf-8", "replace").rstrip("\r\n")
                if line:
                    if line.startswith(":"):
                        continue  # SSE comment / keep-alive
                    if line.startswith("data:"):
                        data_lines.append(line[5:].lstrip(" "))
                    continue
                if not data_lines:
                    continue
                payload = "\n".join(data_lines)
                data_lines = []
                now = time.perf_counter() - start
                if payload.strip() == "[DONE]":
                    done = True
                    break
                try:
                    obj = json.loads(payload)
                except ValueError:
                    out.error, out.error_detail = "bad_sse_json", payload[:120]
                    break
                if not isinstance(obj, dict):
                    continue
                if obj.get("error"):
                    out.error = "stream_error"
                    out.error_detail = _short_error(json.dumps(obj).encode())
                    break
                usage = obj.get("usage") or None
                if usage and usage.get("prompt_tokens") is not None:
                    out.prompt_tokens = int(usage["prompt_tokens"])
                if usage and usage.get("completion_tokens") is not None:
                    last_usage = int(usage["completion_tokens"])
                for ch in obj.get("choices") or []:
                    if ch.get("finish_reason"):
                        out.finish_reason = ch["finish_reason"]
                if _token_bearing(obj, chat):
                    out.chunk_times.append(now)
                    usage_tokens.append(last_usage if usage else None)
                    if save_text:
                        texts.append(_text_of(obj, chat))
            out.end = time.perf_counter() - start
            if out.error is None and not out.chunk_times:
                out.error = "no_token"
                out.error_detail = "stream ended without a token-bearing message"
            elif out.error is None and not done and body.get("stream"):
                # vLLM always ends a stream with [DONE]; without it the stream was cut.
                out.error = "incomplete_stream"
                out.error_detail = "stream closed before data: [DONE]"
    except asyncio.TimeoutError:
        out.error, out.error_detail = "timeout", f"no complete response within {timeout:g}s"
    except aiohttp.ClientConnectorError as e:
        out.error, out.error_detail = "connect_error", str(e)[:200]
    except (aiohttp.ClientError, ConnectionError) as e:
        out.error, out.error_detail = "stream_broken", f"{type(e).__name__}: {str(e)[:160]}"
    if out.end is None:
        out.end = time.perf_counter() - start
    out.output_tokens = last_usage if last_usage is not None else (len(out.chunk_times) or None)
    if usage_tokens and all(u is not None for u in usage_tokens):
        counts = [int(usage_tokens[0])]  # type: ignore[arg-type]
        counts += [int(b) - int(a) for a, b in zip(usage_tokens, usage_tokens[1:])]  # type: ignore[arg-type]
        out.chunk_tokens = counts if all(c >= 0 for c in counts) else None
    if save_text:
        out.text = "".join(texts)
    return start, out


def _short_error(raw: bytes) -> str:
    """The error message an OpenAI-style server returned, shortened (never the prompt)."""
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message") if isinstance(err, dict) else str(err)
        return str(msg)[:200]
    except ValueError:
        return raw[:200].decode("utf-8", "replace")
