"""Token counting and output text without a tokenizer.

The rule (also in docs/sim.md), chosen so that load generators can size prompts exactly:

* A text prompt has one token per whitespace-separated word: ``len(text.split())``.
  "a b  c" is 3 tokens; an empty or all-whitespace prompt is 0 tokens (rejected like vLLM).
* A token-id prompt (a list of integers) has one token per id.
* A chat request has, per message, the words of its text content (a string, or the ``text``
  of ``{"type": "text"}`` parts; other parts count nothing) plus ``CHAT_TOKENS_PER_MESSAGE``
  (4: role header and end-of-turn markers, as Llama-3's template adds).
* Output token i is one word from a fixed list, written with a leading space, so the
  completion text has exactly ``completion_tokens`` words. The words depend only on the
  prompt (and the request's ``seed`` field), so the same request always gets the same text,
  and a P/D pair produces the same text as a single instance.
"""

from __future__ import annotations

import hashlib
from typing import Any

CHAT_TOKENS_PER_MESSAGE = 4

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


def count_text(text: str) -> int:
    return len(encode(text))


# The tokenizer interface the simulator codes against (encode, decode, piece). This minimal one keeps the
# word rule: a word's id is its index in WORDS, or a hash above them for any other word; ids map back
# to the piece " " + word, so decode(ids) is the text those ids stand for in an answer.
_WORD_IDS = {w: i for i, w in enumerate(WORDS)}
_VOCAB = 128256


def encode(text: str) -> list[int]:
    """The ids of a text: one per whitespace-separated word."""
    return [_WORD_IDS.get(w) if w in _WORD_IDS else _word_hash(w) for w in text.split()]


def piece(token_id: int) -> str:
    """The text one output token adds."""
    return " " + WORDS[token_id % len(WORDS)]


def decode(ids: list[int]) -> str:
    return "".join([piece(i) for i in ids])


def _word_hash(word: str) -> int:
    digest = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return len(WORDS) + int.from_bytes(digest, "little") % (_VOCAB - len(WORDS))


def chat_content_words(content: Any) -> int:
    """Words in a message's content: a string or a list of content parts (text parts only)."""
    if content is None:
        return 0
    if isinstance(content, str):
        return count_text(content)
    words = 0
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            words += count_text(part["text"])
    return words


def prompt_seed(material: str, extra: Any = None) -> int:
    """A 64-bit seed from the prompt (and the request's seed field): same request, same words."""
    h = hashlib.blake2b(material.encode("utf-8", "surrogatepass"), digest_size=8)
    if extra is not None:
        h.update(repr(extra).encode())
    return int.from_bytes(h.digest(), "little")


class OutputText:
    """Deterministic words for output tokens [start, stop) of one request."""

    __slots__ = ("_seed",)
    _MUL = 6364136223846793005
    _MASK = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        self._seed = seed

    def word(self, i: int) -> str:
        x = ((self._seed + (i + 1) * 0x9E3779B97F4A7C15) * self._MUL) & self._MASK
        return WORDS[(x >> 33) % len(WORDS)]

    def text(self, start: int, stop: int) -> str:
        word = self.word
        return "".join([" " + word(i) for i in range(start, stop)])
