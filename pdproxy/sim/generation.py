"""What a simulated instance generates: greedy, and exact under continuation.

The next token id is a deterministic function of the ids before it (prompt ids, then the ids
generated so far) and the request's `seed` field, so an instance given the prompt plus the first k
generated ids, with `max_tokens` reduced by k, generates exactly the rest of the uninterrupted run:
the property greedy decoding has on real vLLM (facts file, fact 5) and that request migration
relies on. The text is the concatenation of the ids' pieces (`tokens.piece`).

The rule works in words so that an answer re-tokenizes to its own ids (pdproxy/sim/tokens.py):
the ids since the last one that starts a word (its piece begins with a space) are a word in
progress when they begin the tokenization of the word chosen for that position — then the next id
is that word's next token; otherwise a new word starts, chosen by a hash of the last `CONTEXT` ids.

A decode that read KV blocks which no longer hold its prompt (reused hand-off parameters: fact 2)
generates from a corrupted context: `salt` differs, so does every word.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdproxy.sim.tokens import WORDS, piece, tokenizer

CONTEXT = 8  # ids a new word depends on (about three words of the tokenizer's)
_LOOK_BACK = 8  # the longest word in progress looked for (WORDS have at most 3 tokens)
_MASK = (1 << 64) - 1
_STALE_KV = 0x5DEECE66D  # salt of a context read from freed blocks


def _word(before: Sequence[int], salt: int) -> tuple[int, ...]:
    """The ids of the word that starts after `before` (splitmix64 over its last CONTEXT ids)."""
    x = (salt * 0x9E3779B97F4A7C15) & _MASK
    for token in before[-CONTEXT:]:
        x = (x ^ token) * 0xBF58476D1CE4E5B9 & _MASK
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
        x ^= x >> 31
    return tokenizer().encode_word(" " + WORDS[x % len(WORDS)])


def next_token(context: Sequence[int], salt: int) -> int:
    """The id that follows `context`."""
    for start in range(len(context) - 1, max(-1, len(context) - 1 - _LOOK_BACK), -1):
        if piece(context[start]).startswith(" "):
            word, done = _word(context[:start], salt), tuple(context[start:])
            if len(done) < len(word) and word[:len(done)] == done:
                return word[len(done)]
            break
    return _word(context, salt)[0]


class Generation:
    """The output ids of one request, computed as far as they are asked for."""

    __slots__ = ("ids", "_context", "_salt")

    def __init__(self, prompt_ids: Sequence[int], seed: int | None, stale_kv: bool = False) -> None:
        self.ids: list[int] = []
        self._context = list(prompt_ids[-(CONTEXT + _LOOK_BACK):])
        self._salt = (seed or 0) ^ (_STALE_KV if stale_kv else 0)

    def token_ids(self, start: int, stop: int) -> list[int]:
        while len(self.ids) < stop:
            token = next_token(self._context, self._salt)
            self.ids.append(token)
            self._context = self._context[-(CONTEXT + _LOOK_BACK) + 1:] + [token]
        return self.ids[start:stop]

    def text(self, start: int, stop: int) -> str:
        return "".join([piece(t) for t in self.token_ids(start, stop)])
