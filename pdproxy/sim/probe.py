"""A minimal measuring client for simulated (or real) instances: timed requests and P→D by hand.

Used by benchmarks/sim_calibration.py and the simulator's tests; it is not the bench
(`pdproxy bench`), just enough client to observe TTFT, per-chunk gaps and per-token rates,
all timed on this process's `time.perf_counter()`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Timed:
    """One request as the client saw it."""

    status: int = 0
    sent_at: float = 0.0
    headers_at: float | None = None
    done_at: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # token-bearing chunks only
    chunk_tokens: list[int] = field(default_factory=list)  # cumulative completion tokens at each of them
    body: Any = None  # JSON body (non-streaming or error)
    events: list[dict[str, Any]] = field(default_factory=list)  # every parsed SSE event (if kept)
    final: dict[str, Any] | None = None  # the chunk carrying finish_reason
    usage: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    done: bool = False  # saw data: [DONE]
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def gaps(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def max_gap(self) -> float | None:
        g = self.gaps
        return max(g) if g else None

    @property
    def per_token_itl(self) -> float | None:
        """(last chunk - first chunk) / tokens between them: the token rate, whatever the chunking."""
        if len(self.chunk_times) < 2 or not self.chunk_tokens:
            return None
        tokens = self.chunk_tokens[-1] - self.chunk_tokens[0]
        return (self.chunk_times[-1] - self.chunk_times[0]) / tokens if tokens > 0 else None


def _tokens_in(event: dict[str, Any]) -> tuple[bool, int]:
    """(carries generated text, number of words in it)."""
    choices = event.get("choices") or []
    if not choices:
        return False, 0
    c = choices[0]
    text = c.get("text")
    if text is None:
        text = (c.get("delta") or {}).get("content")
    if not text:
        return False, 0
    return True, len(text.split())


async def timed_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                        headers: dict[str, str] | None = None, keep_events: bool = False) -> Timed:
    """POST and read the whole answer (SSE or JSON), stamping every token-bearing chunk."""
    out = Timed(sent_at=time.perf_counter())
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            out.status = resp.status
            out.headers_at = time.perf_counter()
            if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                raw = await resp.read()
                out.done_at = time.perf_counter()
                try:
                    out.body = json.loads(raw)
                except ValueError:
                    out.body = raw.decode(errors="replace")
                    out.error = "invalid JSON body"
                if isinstance(out.body, dict):
                    out.usage = out.body.get("usage")
                    out.metrics = out.body.get("metrics")
                    if "error" in out.body:
                        out.error = out.body["error"].get("message", "error")
                return out
            tokens = 0
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    out.done = True
                    break
                now = time.perf_counter()
                try:
                    event = json.loads(payload)
                except ValueError:
                    out.error = f"malformed chunk: {payload[:80]!r}"
                    continue
                if keep_events:
                    out.events.append(event)
                if "error" in event:
                    out.error = event["error"].get("message", "error")
                    continue
                has_text, words = _tokens_in(event)
                if event.get("usage"):
                    out.usage = event["usage"]
                if event.get("metrics"):
                    out.metrics = event["metrics"]
                if has_text:
                    u = event.get("usage")
                    tokens = u["completion_tokens"] if u else tokens + words
                    out.chunk_times.append(now)
                    out.chunk_tokens.append(tokens)
                choices = event.get("choices") or []
                if choices and choices[0].get("finish_reason"):
                    out.final = event
            out.done_at = time.perf_counter()
            if not out.done and out.error is None:
                out.error = "stream ended without [DONE]"
    except (aiohttp.ClientError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        out.done_at = time.perf_counter()
    return out


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's NIXL toy proxy sends to the prefill instance."""
    p = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    p.update(max_tokens=1, stream=False,
             kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None})
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    return p


@dataclass
class PDResult:
    prefill: Timed
    decode: Timed | None
    sent_at: float

    @property
    def ok(self) -> bool:
        return self.prefill.ok and self.decode is not None and self.decode.ok

    @property
    def ttft(self) -> float | None:
        if self.decode is None or not self.decode.chunk_times:
            return None
        return self.decode.chunk_times[0] - self.sent_at


async def pd_request(session: aiohttp.ClientSession, prefill_url: str, decode_url: str, path: str,
                     body: dict[str, Any], request_id: str, keep_events: bool = False) -> PDResult:
    """Prefill leg, then the decode leg with the prefill's kv_transfer_params (as the toy proxy does)."""
    headers = {"X-Request-Id": request_id}
    pre = await timed_request(session, prefill_url + path, prefill_body(body), headers)
    result = PDResult(prefill=pre, decode=None, sent_at=pre.sent_at)
    if not pre.ok or not isinstance(pre.body, dict):
        return result
    decode_body = dict(body, kv_transfer_params=pre.body.get("kv_transfer_params"))
    result.decode = await timed_request(session, decode_url + path, decode_body, headers, keep_events)
    return result


def metric_samples(exposition: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Samples of one metric (exact sample name, e.g. `vllm:prompt_tokens_total`) from /metrics text."""
    return [(sample.labels, sample.value) for family in text_string_to_metric_families(exposition)
            for sample in family.samples if sample.name == name]


def metric_value(exposition: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for lbl, v in metric_samples(exposition, name) if all(lbl.get(k) == x for k, x in labels.items()))
