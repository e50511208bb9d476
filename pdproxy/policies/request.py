"""What a routing policy may read of a request, taken from the parsed body once and only when asked.

The prefix key is the request's prompt as token ids when it has them (a `prompt` of integers), else
as text (`prompt`, or the chat `messages` with their roles). It is cut into blocks (16 tokens, or 64
characters: about 16 tokens of English) and hashed as a chain at a sparse set of block counts
(`CHECKPOINTS`: 1, 2, 3, 4, then 1.5x and 2x of each power of two), so a prompt of any length costs
a dozen or two hashes and index entries, and a match is known to within a third of its length. That is the
"approximate" in an approximate prefix index: enough to tell which instance most likely holds a
prompt's KV blocks, never a claim about them.

Nothing here raises: a body of any shape either yields a key within `MAX_KEY_TOKENS` /
`MAX_KEY_CHARS` (longer prompts are keyed by their first part) or no key at all, and then the
request is routed by load. The work is bounded by the body's structure as well as its text: a chat
key looks at no more than `MAX_KEY_PARTS` messages and content parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdproxy.blocks import chain_hashes

TOKEN_BLOCK, CHAR_BLOCK = 16, 64
MAX_KEY_TOKENS, MAX_KEY_CHARS = 65_536, 262_144
MAX_KEY_PARTS = 4096  # chat messages and content parts looked at for a key (a body's structure, not its text)
MAX_FIELD_CHARS = 256  # a consistent-hash key longer than this is cut (it is hashed anyway)


def _checkpoints(limit: int) -> tuple[int, ...]:
    points = [1, 2, 3, 4]
    octave = 4
    while octave < limit:
        points += [octave * 3 // 2, octave * 2]
        octave *= 2
    return tuple(p for p in points if p <= limit)


CHECKPOINTS = _checkpoints(MAX_KEY_TOKENS // TOKEN_BLOCK)


@dataclass(frozen=True, slots=True)
class PrefixKey:
    unit: str  # "tokens" or "chars"
    length: int  # units of the prompt that were keyed
    lengths: tuple[int, ...]  # prefix lengths in units, ascending (whole blocks at the checkpoints)
    hashes: tuple[int, ...]  # the chained hash of each of those prefixes


class RequestView:
    """A request as policies see it; every property is computed on first use and kept."""

    __slots__ = ("body", "headers", "chat", "_prefix", "_done", "token_ids", "whole", "no_ids", "_keys")

    def __init__(self, body: Mapping[str, Any] | None = None, headers: Mapping[str, str] | None = None,
                 chat: bool = False) -> None:
        self.body = body if isinstance(body, dict) or isinstance(body, Mapping) else {}  # a dict: no ABC check
        self.headers = headers if headers is not None else {}
        self.chat = chat
        self._prefix: PrefixKey | None = None
        self._done = False
        # the prompt's token ids, set by pdproxy/routing before a policy chooses (as given, from a local
        # tokenizer.json or an instance's /tokenize); `whole`: they count the whole request (no media part,
        # nothing cut off); `no_ids`: why there are none, a routing fallback reason (routing.FALLBACK_REASONS)
        self.token_ids: list[int] | None = None
        self.whole = False
        self.no_ids = "no_token_ids"
        self._keys: tuple[int, list[int]] | None = None  # (block size, block_keys of it)

    @property
    def prefix(self) -> PrefixKey | None:
        if not self._done:
            self._done = True
            try:
                self._prefix = _prefix_key(self.body, self.chat)
            except (TypeError, ValueError, RecursionError):
                self._prefix = None  # unhashable or odd parts: not indexed, routed by load
        return self._prefix

    def block_keys(self, block_size: int) -> list[int]:
        """The chained keys of the token ids' first `MAX_KEY_TOKENS` in blocks of `block_size` (the engines'),
        as their KV events key what they hold: hashed once per request, however many rules look them up (the
        decode's and the prefill's precise choice, selective disaggregation)."""
        if self._keys is None or self._keys[0] != block_size:
            ids = self.token_ids if self.token_ids is not None else []
            self._keys = (block_size, chain_hashes(ids, block_size, limit=MAX_KEY_TOKENS // block_size))
        return self._keys[1]

    def header(self, name: str) -> str | None:
        value = self.headers.get(name)
        return value[:MAX_FIELD_CHARS] if isinstance(value, str) and value else None

    def field(self, name: str) -> str | None:
        value = self.body.get(name)
        if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
            return None
        return str(value)[:MAX_FIELD_CHARS]


def prompt_of(body: Mapping[str, Any]) -> Any:
    """A completion's `prompt`, a batch of one taken as its one prompt (text or token ids); anything else as is."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


def _prefix_key(body: Mapping[str, Any], chat: bool) -> PrefixKey | None:
    if chat:
        return _chain(_chat_text(body.get("messages")), "chars")
    prompt = prompt_of(body)
    if isinstance(prompt, str):
        return _chain(prompt, "chars")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list)):
        return _chain(prompt, "tokens")
    return None


def _chat_text(messages: Any) -> str | None:
    """The roles and text of the first messages: at most `MAX_KEY_CHARS` of text and `MAX_KEY_PARTS` messages
    and content parts visited, so a body of millions of empty messages costs what a short chat does."""
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    size = visited = 0
    for message in messages[:MAX_KEY_PARTS]:
        visited += 1
        if not isinstance(message, Mapping):
            continue
        role, content = message.get("role"), message.get("content")
        parts.append(f"\x1e{role if isinstance(role, str) else ''}\x1f")
        size += len(parts[-1])
        if isinstance(content, str):
            parts.append(content)
            size += len(content)
        elif isinstance(content, list):
            for part in content[:MAX_KEY_PARTS - visited]:
                visited += 1
                text = part.get("text") if isinstance(part, Mapping) else None
                if isinstance(text, str):
                    parts.append(text)
                    size += len(text)
        if size >= MAX_KEY_CHARS or visited >= MAX_KEY_PARTS:
            break
    return "".join(parts)


def _chain(material: Any, unit: str) -> PrefixKey | None:
    """Chained hashes of `material` (a str or a list of token ids) at the checkpoint block counts."""
    if not material:
        return None
    block, limit = (TOKEN_BLOCK, MAX_KEY_TOKENS) if unit == "tokens" else (CHAR_BLOCK, MAX_KEY_CHARS)
    length = min(len(material), limit)
    blocks = length // block
    lengths: list[int] = []
    hashes: list[int] = []
    h, start = hash(unit), 0
    for count in CHECKPOINTS:
        if count > blocks:
            break
        end = count * block
        piece = material[start:end]
        h = hash((h, piece if unit == "chars" else tuple(piece)))
        lengths.append(end)
        hashes.append(h)
        start = end
    return PrefixKey(unit, length, tuple(lengths), tuple(hashes)) if hashes else None
