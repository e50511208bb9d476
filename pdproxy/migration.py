"""Request migration: a decode that fails is replaced by another, at no cost to the client.

The rules (docs/protocol.md, "Retries and migration", says what a client may observe):

* **Before the first token nothing is committed.** The client's status line goes out with the first
  token-bearing event of a stream (`read_head`), so a decode that fails before it — connect error,
  reset, 5xx, a stream that ends or errors without a token, silence past `--first-token-timeout` —
  is retried on another decode instance and the client never knows.
* **Which KV the next decode uses** follows vLLM 0.23 with NIXL (facts file, fact 2): hand-off
  parameters whose blocks another decode may have pulled still answer 200 on a second decode,
  which then streams from blocks that may hold someone else's KV. So the same parameters are
  reused only when the failed decode provably never got the request (`Handoff.reusable`); in every
  other case the prefill runs again and the new parameters go to the new decode. The abandoned
  hand-off's blocks stay held on the prefill until vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`.
* **Mid-stream** (`--migrate-mid-stream`): a decode that dies after tokens reached the client is
  continued on another one by prefilling the prompt's ids plus the ids already delivered (vLLM's
  `return_token_ids`), with `max_tokens` reduced by as many, and the new stream is rewritten into
  the old one (`TokenTap`): same id, no repeated or missing text, usage that adds up, one `[DONE]`.
  That is exact for greedy decoding of one text prompt only: `Continuation.refusal` names the requests
  that are not armed, `Continuation.obstacle` the streams whose ids cannot be trusted to continue from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from pdproxy import jsonio
from pdproxy.errors import DECODE, ProxyError
from pdproxy.pool import Instance
from pdproxy.stream import ResponseScan, read_stream
from pdproxy.upstream import Response

BEFORE_FIRST_TOKEN, MID_STREAM = "before_first_token", "mid_stream"  # the stages a migration happens in
# mid-stream failures a continuation can repair: the decode went away. An error event is the instance's
# answer (relayed), and after a malformed event the client's stream cannot be trusted to continue.
MIGRATABLE = frozenset({"stream_broken", "timeout", "stream_truncated"})
# bounds on the ids a stream reports, past which it is not continued: a step's tokens in one event
# (several with speculative decoding), the output when the request sets no limit (a long context),
# and what a chat template adds to the messages' text
MAX_IDS_PER_EVENT = 64
MAX_OUTPUT_IDS = 1 << 20
TEMPLATE_TOKENS = 4096
# sampling fields that mean the same on /v1/completions as on the client's route: what a continuation keeps
_CONTINUED_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "stop_token_ids",
                     "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "stream_options",
                     "logit_bias", "allowed_token_ids", "bad_words", "priority", "user", "include_stop_str_in_output")


@dataclass
class Handoff:
    """The KV coordinates the next decode attempt gets, and whether they are still safe to give."""

    params: dict[str, Any] | None
    prefill: Instance | None  # the instance holding the blocks (None: single-instance mode)
    reusable: bool = True  # False once a decode may have pulled them

    def spent(self, used: bool) -> str | None:
        """Record a failed attempt; the prefill instance's address when its parameters were abandoned
        (the blocks stay held there).

        `used`: the decode may have read them. Only a request that never reached its decode
        (connection refused, not accepted in time) or that was turned away as busy (429, 503 with
        Retry-After: vLLM refuses those before its engine sees them) leaves them usable."""
        if self.params is None or self.prefill is None or not used or not self.reusable:
            return None
        self.reusable = False
        return self.prefill.address


@dataclass
class Attempt:
    """A decode answer at its commit point: the client may be answered from it now."""

    instance: Instance
    response: Response
    head: bytes  # read before the commit point: the first events of a stream, or a whole body
    streamed: bool
    tap: TokenTap | None = None  # rewrites a stream armed for mid-stream migration
    closed: bool = False

    def close(self) -> None:
        """An answer not read to its end is closed, not pooled: that aborts it on the instance."""
        if not self.closed:
            self.closed = True
            self.response.release() if self.response.at_eof else self.response.close()
            self.instance.inflight -= 1


@dataclass
class Budget:
    """How many more decode attempts a request may start, and until when (--decode-retries, --decode-deadline)."""

    retries: int
    deadline: float  # time.monotonic()
    used: int = 0

    @classmethod
    def start(cls, retries: int, seconds: float) -> Budget:
        return cls(retries, time.monotonic() + seconds if seconds else float("inf"))

    def take(self) -> bool:
        """Spend one more attempt; False when none is left."""
        if self.used >= self.retries or time.monotonic() >= self.deadline:
            return False
        self.used += 1
        return True


# What a decode may send before its first token, all held until then (the client's status line waits for
# it): vLLM sends a role-only delta (chat), a few events whose text the detokenizer holds back, and with
# return_token_ids the prompt's ids in its first event (~7 bytes an id: 16 MiB is a 2M-token prompt).
MAX_HEAD_EVENTS = 1024
MAX_HEAD_BYTES = 16 * 1024 * 1024


async def read_head(response: Response, scan: ResponseScan, tap: TokenTap | None) -> bytes:
    """Read a stream up to its commit point: its first token-bearing event (or its finish). Anything
    else first — the end of the stream, an error event, a malformed event, a broken connection, more
    than MAX_HEAD_EVENTS events or MAX_HEAD_BYTES bytes without a token — is a `ProxyError` the caller
    may retry, since not one byte of it has reached the client.
    (A continuation's scan already holds the delivered stream: its own events are the new ones.)"""
    parts = []
    tokens, finishes, malformed = len(scan.chunk_times), len(scan.finish_reasons), scan.malformed
    received = events = 0
    while True:
        data = await read_stream(response, "before its first token")
        if not data:
            raise ProxyError(502, "decode instance ended the stream before its first token",
                             error_type="stream_truncated", stage=DECODE)
        received += len(data)
        events += data.count(b"\n\n") + data.count(b"\r\n\r\n")
        if received > MAX_HEAD_BYTES or events > MAX_HEAD_EVENTS:
            raise ProxyError(502, f"decode instance sent {events} events ({received} bytes) and no token",
                             error_type="no_first_token", stage=DECODE)
        if tap is not None:
            data = tap.feed(data)
        scan.feed(data, time.monotonic_ns())
        parts.append(data)
        if scan.malformed > malformed:
            raise ProxyError(502, "decode instance sent a malformed stream event (not a JSON object)",
                             error_type="malformed_stream", stage=DECODE)
        if len(scan.chunk_times) > tokens or len(scan.finish_reasons) > finishes:
            return b"".join(parts)
        if scan.error is not None or scan.done:
            message = str((scan.error or {}).get("message", "stream ended without a token"))[:300]
            raise ProxyError(502, f"decode instance failed before its first token: {message}",
                             error_type="stream_error", stage=DECODE)


def first_token_timeout(seconds: float) -> ProxyError:
    return ProxyError(504, f"decode instance sent no token within {seconds:g}s (--first-token-timeout)",
                      error_type="first_token_timeout", stage=DECODE)


# -- mid-stream ----------------------------------------------------------------------------------


@dataclass
class Continuation:
    """What a stream armed for mid-stream migration needs: the client's body and its shape."""

    body: dict[str, Any]
    chat: bool

    def refusal(self) -> str | None:
        """Why continuing this request elsewhere could not give what an uninterrupted run gives; None: it can.

        Exact only for greedy decoding of one prompt: a sampled stream continues differently; logprobs,
        n > 1, stop strings (one may straddle the cut), penalties over output tokens, echo, suffix and
        constrained output (tools, response_format, guided decoding) restart their state; a batch of
        prompts streams several choices; images, audio and embeddings are not in the prompt's ids."""
        body = self.body

        def given(*keys: str) -> bool:
            return any(body.get(k) not in (None, False, 0, "", [], {}) for k in keys)

        if not body.get("stream"):
            return "not_streamed"
        if body.get("temperature") != 0:
            return "sampling"  # vLLM's default temperature (the model's, often 0.6–1) samples
        if _asked(body.get("logprobs")) or _asked(body.get("prompt_logprobs")) or given("top_logprobs"):
            return "logprobs"  # vLLM returns logprobs for `logprobs: 0` and `prompt_logprobs: 0` too
        if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
            return "n"
        if _batched(body.get("prompt")):
            return "batched"
        if given("stop"):
            return "stop_strings"
        if given("presence_penalty", "frequency_penalty"):
            return "penalties"
        if given("echo", "suffix"):
            return "echo"
        if given("tools", "functions", "response_format", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "structured_outputs"):
            return "constrained"
        if given("prompt_embeds", "multi_modal_data") or _multimodal(body.get("messages")):
            return "multimodal"
        return None

    def tap(self) -> TokenTap:
        """The tap that reads this stream's ids, bounded by what the request can have produced."""
        prompt = self.body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch of one
        given_ids = prompt if isinstance(prompt, list) and prompt else None
        text = self.body.get("messages") if self.chat else prompt
        # a token stands for at least one byte of text, plus what the chat template adds
        prompt_bound = len(given_ids) if given_ids else len(jsonio.dumps(text)) + TEMPLATE_TOKENS
        limit = self.limit
        return TokenTap(self.chat, keep_ids=self.body.get("return_token_ids") is True, given_ids=given_ids,
                        max_prompt_ids=prompt_bound, max_output_ids=limit if limit is not None else MAX_OUTPUT_IDS)

    @property
    def limit(self) -> int | None:
        """The request's output token limit as vLLM reads it; None: the rest of the context."""
        body = self.body
        limit = (body.get("max_completion_tokens") or body.get("max_tokens")) if self.chat else body.get("max_tokens", 16)
        return limit if isinstance(limit, int) and not isinstance(limit, bool) else None

    def body_after(self, tap: TokenTap) -> dict[str, Any]:
        """The continuation request, in the completions form (exact for chat too: the prompt ids are the
        rendered chat template): the prompt's ids plus the ids delivered, max_tokens reduced by as many."""
        body, kept, limit = self.body, tap.kept, self.limit
        cont = {k: body[k] for k in _CONTINUED_FIELDS if k in body}
        cont.update(prompt=tap.prompt_ids + tap.output_ids[:kept], stream=True, return_token_ids=True)
        cont["max_tokens"] = None if limit is None else limit - kept  # null: the rest of the context, as chat's default
        if isinstance(body.get("min_tokens"), int):
            cont["min_tokens"] = max(0, body["min_tokens"] - kept)
        return cont

    def obstacle(self, tap: TokenTap) -> str | None:
        """Why this stream cannot be continued now; None: tokens are still due, and the stream told us,
        in ids that add up, what a continuation needs."""
        if tap.untrusted:
            return tap.untrusted
        if tap.prompt_ids is None:
            return "no_token_ids"
        if tap.finished or tap.done:
            return "finished"
        limit = self.limit
        return "finished" if limit is not None and limit <= tap.kept else None


def _asked(value: Any) -> bool:
    """Set to anything but null or false (0 asks for logprobs in vLLM: `0 == False` must not hide it)."""
    return value is not None and value is not False


def _batched(prompt: Any) -> bool:
    """Several prompts in one completions request (each its own choice), not one prompt given as ids."""
    return isinstance(prompt, list) and len(prompt) > 1 and not all(type(t) is int for t in prompt)


def _multimodal(messages: Any) -> bool:
    """A chat message with a part that is not text (image, audio, video, file)."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            return True
    return False


@dataclass
class TokenTap:
    """Reads every event of an armed stream: keeps the prompt's and the delivered tokens' ids, hides
    them unless the client asked for them, and, on a continuation, rewrites the events into the
    original stream (`splice`). Only whole events come out, so what the client got is what was kept;
    nothing after `[DONE]` comes out.

    The ids are the instance's word, so they are checked against what was delivered before a
    continuation is built from them: one choice, at most MAX_IDS_PER_EVENT ids an event, no more
    than the request can have (the prompt's text, `max_tokens`), the count `usage` reports; and a
    chat stream's tokens all content (reasoning and tool-call deltas have no completions form).
    Anything else makes the stream `untrusted`: it is not continued, and no more ids are kept."""

    chat: bool
    keep_ids: bool  # the client asked for return_token_ids itself
    given_ids: list[int] | None = None  # the client's prompt, when it sent ids
    max_prompt_ids: int = 0
    max_output_ids: int = MAX_OUTPUT_IDS
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    kept: int = 0  # output ids up to the last event with text: a continuation starts after them
    template: dict[str, Any] | None = None  # id, object, created, model of the original stream
    splice: bool = False  # rewriting a continuation (completions form) into the original stream
    offset: int = 0  # completion tokens delivered before the continuation
    prompt_tokens: int = 0
    finished: bool = False  # a finish reason went by: nothing is left to continue
    done: bool = False  # `[DONE]` went by: the stream is over
    untrusted: str | None = None  # why the ids cannot be continued from (a `pd.migration.ineligible` value)
    _buffer: bytes = b""

    def fresh(self) -> TokenTap:
        """The same tap for another attempt at the same stream (a failed attempt's events never count)."""
        return replace(self, output_ids=list(self.output_ids), _buffer=b"")

    def continued(self) -> TokenTap:
        """The tap for the next decode's stream, which goes on where this one stopped."""
        return replace(self, output_ids=self.output_ids[:self.kept], splice=True, offset=self.kept,
                       prompt_tokens=len(self.prompt_ids or ()), _buffer=b"")

    def feed(self, data: bytes) -> bytes:
        buffer = self._buffer + data
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            self._buffer = buffer
            return b""
        self._buffer = buffer[cut + 2:]
        return b"".join(self._event(e) for e in buffer[:cut].split(b"\n\n"))

    def _event(self, event: bytes) -> bytes:
        if self.done:
            return b""  # nothing after [DONE] is the client's
        if event.startswith(b"data:") and event[5:].strip() == b"[DONE]":
            self.done = True
        if not event.startswith(b"data: {") or b"\n" in event:
            return event + b"\n\n"  # [DONE], comments, unusual framing: as they are (the scanner judges them)
        try:
            obj = jsonio.loads(event[6:])
        except ValueError:
            return event + b"\n\n"
        if not isinstance(obj, dict) or "error" in obj:
            return event + b"\n\n"
        original = not self.splice
        prompt = obj.get("prompt_token_ids")  # chat: top-level on the first chunk
        if not (self.keep_ids and original):
            obj.pop("prompt_token_ids", None)
            obj.pop("prompt_text", None)
        if self.template is None:
            self.template = {k: obj.get(k) for k in ("id", "object", "created", "model")}
        choices = obj.get("choices") if isinstance(obj.get("choices"), list) else []
        for i, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            prompt = choice.get("prompt_token_ids") or prompt  # completions: on the first chunk's choice
            self.finished = self.finished or bool(choice.get("finish_reason"))
            self._check(choice, ids)
            if isinstance(ids, list) and not self.untrusted:
                self.output_ids.extend(ids)
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    self.kept = len(self.output_ids)
            if self.splice and self.chat:
                choice = _as_chat_choice(choice)
            choices[i] = self._shown(choice, ids if isinstance(ids, list) else None)
        if prompt is not None and self.prompt_ids is None:
            self._take_prompt(prompt)
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            if usage["completion_tokens"] + self.offset != len(self.output_ids) and not self.untrusted:
                self.untrusted = "token_ids"  # ids went missing, or came from nowhere
        if self.splice:
            obj.update(self.template)
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                usage["prompt_tokens"] = self.prompt_tokens
                usage["completion_tokens"] += self.offset
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return b"data: " + jsonio.dumps(obj) + b"\n\n"

    def _check(self, choice: dict[str, Any], ids: Any) -> None:
        """Mark the stream untrusted when this choice's ids cannot be continued from exactly."""
        if self.untrusted:
            return
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        if choice.get("index", 0) != 0:
            self.untrusted = "batched"
        elif delta.get("reasoning_content") or delta.get("reasoning"):
            self.untrusted = "reasoning"  # a completions continuation would send it again as content
        elif delta.get("tool_calls"):
            self.untrusted = "constrained"
        elif ids is not None and (not isinstance(ids, list) or len(ids) > MAX_IDS_PER_EVENT
                                  or len(self.output_ids) + len(ids) > self.max_output_ids
                                  or not all(type(t) is int for t in ids)):
            self.untrusted = "token_ids"

    def _take_prompt(self, prompt: Any) -> None:
        """The prompt's ids, if they are what the client sent (or could have: no more than its text allows)."""
        if self.untrusted:
            return
        if (not isinstance(prompt, list) or len(prompt) > self.max_prompt_ids
                or (self.given_ids is not None and prompt != self.given_ids)
                or not all(type(t) is int for t in prompt)):
            self.untrusted = "token_ids"
            return
        self.prompt_ids = list(prompt)

    def _shown(self, choice: dict[str, Any], ids: list[int] | None) -> dict[str, Any]:
        """The choice as the client would have had it from vLLM: ids only when it asked for them
        (completions: both keys, null, as vLLM 0.23 sends them without the flag)."""
        if self.chat:
            choice.pop("token_ids", None)
            if self.keep_ids and ids is not None:
                choice["token_ids"] = ids
        else:
            choice["token_ids"] = ids if self.keep_ids else None
            choice["prompt_token_ids"] = choice.get("prompt_token_ids") if self.keep_ids and not self.splice else None
        return choice


def _as_chat_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """A completions-form choice as the chat stream's delta."""
    out = {"index": choice.get("index", 0), "delta": {"content": choice.get("text") or ""},
           "logprobs": None, "finish_reason": choice.get("finish_reason")}
    if choice.get("finish_reason"):
        out["stop_reason"] = choice.get("stop_reason")
    return out

