"""Mid-stream continuation (--migrate-mid-stream): which streams can be continued exactly on another
decode, the continuation request, and the tap that reads, checks and splices a stream's token ids."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pdproxy import jsonio
from pdproxy.policies.request import prompt_of
from pdproxy.stream import CR, LF

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


def arm(body: dict[str, Any], chat: bool) -> tuple[Continuation | None, TokenTap | None, str | None]:
    """With --migrate-mid-stream, a stream that can be continued exactly elsewhere gets its token ids read as it
    goes (its continuation and tap); any other says why not (the refusal), and stays a plain relay."""
    if not body.get("stream"):
        return None, None, None
    continuation = Continuation(body, chat)
    refusal = continuation.refusal()
    return (None, None, refusal) if refusal else (continuation, continuation.tap(), None)


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
        prompt = prompt_of(self.body)  # a batch of one as its prompt
        given_ids = prompt if isinstance(prompt, list) and prompt else None
        text = self.body if self.chat else prompt  # chat: all the template may render (messages, documents, ...)
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
        body, kept, limit, prompt_ids = self.body, tap.kept, self.limit, tap.prompt_ids
        assert prompt_ids is not None  # `obstacle` said so before
        cont = {k: body[k] for k in _CONTINUED_FIELDS if k in body}
        cont.update(prompt=prompt_ids + tap.output_ids[:kept], stream=True, return_token_ids=True)
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
        if CR in buffer:
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
        if not event.startswith(b"data: {") or LF in event:
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
        choices = obj.get("choices")
        if not isinstance(choices, list):
            choices = []
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
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            delta = {}
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
