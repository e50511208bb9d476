"""The simulator's tokenizer: a deterministic sub-word rule with a vocabulary that round-trips.

Real models make ~2.3 tokens of a short made-up word (Llama-3's tokenizer on the bench's words,
research/real-vllm-h200.md), so a simulator that counted one token per word hid every
words-vs-tokens mistake. The rule (also in docs/reference/sim.md):

* Text is cut into *words*: a run of non-whitespace with at most one leading space attached
  (`" ?\\S+"`); every other whitespace character is a token of its own.
* A word of L characters has k tokens: k = floor(M) or ceil(M) (M = `--tokens-per-word`, 2.3 by
  default; which one is decided by a CRC-32 of the word, so that on average a word has M), then
  kept within [ceil(L / 3), L]: one-letter words are one token, long words have a token per 3
  letters. The word is cut into k nearly equal parts; the first carries the space.
* A part is one token when it is in the vocabulary: 1-2 printable ASCII characters, 3 lower-case
  letters, or an upper-case letter and 2 lower-case ones, each with or without a leading space.
  Any other part (non-ASCII, mixed 3-character runs) falls back to one token per UTF-8 byte,
  as byte-level BPE does, so every text round-trips: ``decode(encode(t)) == t``.
* Completions add `<|begin_of_text|>` (id 128000) unless `add_special_tokens` is false; chat
  messages go through a Llama-3-like template (`encode_chat`).

Ids: 0-255 bytes, 256-88423 the pieces above (numbered arithmetically, no table), then filler
pieces (a space and four letters) up to 127999, and Llama-3's special tokens at 128000-128255,
so any id below 128256 decodes to something.

Output: output token i of a request comes from a stream of words chosen by a hash of the prompt
(and the request's `seed`) and the word's index, each word tokenized by the rule above, so the
same request always gets the same text, a P/D pair answers what a single instance answers, and
re-tokenizing a complete answer gives back its ids.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import zlib
from typing import Any

VOCAB_SIZE = 128256
DEFAULT_TOKENS_PER_WORD = 2.3
BOS, EOS, START_HEADER, END_HEADER, EOT = 128000, 128001, 128006, 128007, 128009
SPECIAL_BASE = 128000
_SPECIAL_NAMES = {BOS: "<|begin_of_text|>", EOS: "<|end_of_text|>", START_HEADER: "<|start_header_id|>",
                  END_HEADER: "<|end_header_id|>", EOT: "<|eot_id|>"}

# --- the vocabulary, numbered arithmetically --------------------------------------------------
_ASCII = [chr(c) for c in range(33, 127)]  # printable, non-space
_ASCII_INDEX = {c: i for i, c in enumerate(_ASCII)}
_LOWER = "abcdefghijklmnopqrstuvwxyz"
_LOWER_INDEX = {c: i for i, c in enumerate(_LOWER)}
_N1, _N2, _N3 = len(_ASCII), len(_ASCII) ** 2, 26 ** 3
_PER_PREFIX = _N1 + _N2 + 2 * _N3  # 1 char, 2 chars, 3 lower, Upper+2 lower
_PIECE_BASE = 256
_WS_BASE = _PIECE_BASE + 2 * _PER_PREFIX
_WHITESPACE = (" ", "\n", "\t", "\r")
_FILLER_BASE = _WS_BASE + len(_WHITESPACE)

_WORD = re.compile(r" ?\S+|\s")


def _piece_id(part: str, spaced: bool) -> int | None:
    """The id of one vocabulary piece (`part`, with a leading space when `spaced`), or None."""
    base = _PIECE_BASE + (_PER_PREFIX if spaced else 0)
    n = len(part)
    if n == 1:
        i = _ASCII_INDEX.get(part)
        return None if i is None else base + i
    if n == 2:
        a, b = _ASCII_INDEX.get(part[0]), _ASCII_INDEX.get(part[1])
        return None if a is None or b is None else base + _N1 + a * _N1 + b
    if n == 3:
        y, z = _LOWER_INDEX.get(part[1]), _LOWER_INDEX.get(part[2])
        if y is None or z is None:
            return None
        x = _LOWER_INDEX.get(part[0])
        if x is not None:
            return base + _N1 + _N2 + x * 676 + y * 26 + z
        if "A" <= part[0] <= "Z":
            return base + _N1 + _N2 + _N3 + (ord(part[0]) - 65) * 676 + y * 26 + z
    return None


def piece(token_id: int) -> str:
    """The text of one token id (a byte token above 127 alone is `<0xNN>`: it needs its neighbours)."""
    if not 0 <= token_id < VOCAB_SIZE:
        raise ValueError(f"token id {token_id} is out of vocabulary (0..{VOCAB_SIZE - 1})")
    if token_id < _PIECE_BASE:
        return chr(token_id) if token_id < 128 else f"<0x{token_id:02X}>"
    if token_id < _WS_BASE:
        i = token_id - _PIECE_BASE
        prefix = " " if i >= _PER_PREFIX else ""
        i %= _PER_PREFIX
        if i < _N1:
            return prefix + _ASCII[i]
        i -= _N1
        if i < _N2:
            return prefix + _ASCII[i // _N1] + _ASCII[i % _N1]
        i -= _N2
        upper = i >= _N3
        i %= _N3
        first = _LOWER[i // 676]
        return prefix + (first.upper() if upper else first) + _LOWER[i // 26 % 26] + _LOWER[i % 26]
    if token_id < _FILLER_BASE:
        return _WHITESPACE[token_id - _WS_BASE]
    if token_id < SPECIAL_BASE:
        i = token_id - _FILLER_BASE
        return " " + "".join(_LOWER[i // 26 ** e % 26] for e in (3, 2, 1, 0))
    return _SPECIAL_NAMES.get(token_id, f"<|reserved_special_token_{token_id - SPECIAL_BASE}|>")


class Tokenizer:
    """The rule above for one mean number of tokens per word."""

    def __init__(self, tokens_per_word: float = DEFAULT_TOKENS_PER_WORD) -> None:
        if not 1.0 <= tokens_per_word <= 3.0:
            raise ValueError(f"tokens per word must be between 1 and 3, got {tokens_per_word:g}")
        self.tokens_per_word = tokens_per_word
        self._low = math.floor(tokens_per_word)
        self._frac = tokens_per_word - self._low
        # words repeat (a prompt is made of a vocabulary): their ids are kept, a bounded number of them
        self._word = functools.lru_cache(maxsize=1 << 16)(self._encode_word)

    def encode_word(self, word: str) -> tuple[int, ...]:
        """The ids of one word (at most one leading space, no other whitespace), as `encode` gives them."""
        return self._word(word)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        word = self._word
        for m in _WORD.finditer(text):
            out.extend(word(m.group()))
        return out

    def count(self, text: str) -> int:
        word = self._word
        return sum(len(word(m.group())) for m in _WORD.finditer(text))

    def _encode_word(self, word: str) -> tuple[int, ...]:
        if len(word) == 1 and word.isspace():
            return (_WS_BASE + _WHITESPACE.index(word),) if word in _WHITESPACE else tuple(word.encode())
        spaced = word[0] == " "
        body = word[1:] if spaced else word
        n = len(body)
        k = self._low + (zlib.crc32(body.encode("utf-8", "surrogatepass")) < self._frac * 2 ** 32)
        k = min(max(k, -(-n // 3)), n)
        q, r = divmod(n, k)
        ids: list[int] = []
        start = 0
        for i in range(k):
            end = start + q + (i < r)
            part = body[start:end]
            first = spaced and i == 0
            pid = _piece_id(part, first)
            if pid is None:
                ids.extend((" " + part if first else part).encode("utf-8", "surrogatepass"))
            else:
                ids.append(pid)
            start = end
        return tuple(ids)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Llama-3's template: BOS, then per message `<|start_header_id|>role<|end_header_id|>\\n\\n`
        content `<|eot_id|>`, then the assistant's header when a generation prompt is asked for."""
        ids = [BOS]
        for msg in messages:
            ids += [START_HEADER, *self.encode(str(msg.get("role", ""))), END_HEADER,
                    *self.encode("\n\n" + message_text(msg.get("content"))), EOT]
        if add_generation_prompt:
            ids += [START_HEADER, *self.encode("assistant"), END_HEADER, *self.encode("\n\n")]
        return ids


def decode(ids: list[int]) -> str:
    """The text of a list of token ids; byte tokens are joined and decoded as UTF-8 (invalid → U+FFFD)."""
    out: list[str] = []
    pending = bytearray()
    for t in ids:
        if 0 <= t < _PIECE_BASE:
            pending.append(t)
            continue
        if pending:
            out.append(pending.decode("utf-8", "replace"))
            pending.clear()
        out.append(piece(t))
    if pending:
        out.append(pending.decode("utf-8", "replace"))
    return "".join(out)


def message_text(content: Any) -> str:
    """A message's text: a string, or its `{"type": "text"}` parts joined by newlines (others dropped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content
                     if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))


_default = Tokenizer()


def configure(tokens_per_word: float) -> Tokenizer:
    """Set the process's tokenizer (one simulated instance per process); returns it."""
    global _default
    if tokens_per_word != _default.tokens_per_word:
        _default = Tokenizer(tokens_per_word)
    return _default


def tokenizer() -> Tokenizer:
    return _default


def encode(text: str) -> list[int]:
    """Token ids of `text` (no special tokens) with the process's tokenizer."""
    return _default.encode(text)


# --- output --------------------------------------------------------------------------------------

# Short, distinct, JSON-safe words: output text needs no escaping beyond what json.dumps does.
WORDS: tuple[str, ...] = tuple(
    """the of and to in is it that for on with as was at by this be from or have an are not
    but had his they you were her she which one all their there been has when who will more no
    if out so said what up its about into than them can only other new some could time these
    two may then do first any my now such like our over man me even most made after also did
    many before must through back years where much your way well down should because each just
    those people how too little state good very make world still own see men work long get here
    between both life being under never day same another know while last might us great old year
    off come since against go came right used take three""".split()
)


def prompt_seed(material: str, extra: Any = None) -> int:
    """A 64-bit seed from the prompt (and the request's seed field): same request, same words."""
    h = hashlib.blake2b(material.encode("utf-8", "surrogatepass"), digest_size=8)
    if extra is not None:
        h.update(repr(extra).encode())
    return int.from_bytes(h.digest(), "little")


class OutputText:
    """Deterministic output tokens of one request: words from WORDS, each tokenized by the rule."""

    __slots__ = ("_seed", "_ids", "_words", "_tok")
    _MUL = 6364136223846793005
    _MASK = (1 << 64) - 1

    def __init__(self, seed: int, tok: Tokenizer | None = None) -> None:
        self._seed = seed
        self._ids: list[int] = []
        self._words = 0
        self._tok = tok or _default

    def word(self, j: int) -> str:
        x = ((self._seed + (j + 1) * 0x9E3779B97F4A7C15) * self._MUL) & self._MASK
        return WORDS[(x >> 33) % len(WORDS)]

    def ids(self, start: int, stop: int) -> list[int]:
        while len(self._ids) < stop:
            self._ids.extend(self._tok.encode_word(" " + self.word(self._words)))
            self._words += 1
        return self._ids[start:stop]

    def text(self, start: int, stop: int) -> str:
        return "".join([piece(t) for t in self.ids(start, stop)])
