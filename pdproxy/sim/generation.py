"""What a simulated instance generates: greedy, and exact under continuation.

The next token id is a deterministic function of the ids before it — the last `CONTEXT` of
(prompt ids + ids generated so far), and the request's `seed` field — so an instance given the
prompt plus the first k generated ids, with `max_tokens` reduced by k, generates exactly the rest
of the uninterrupted run: the property greedy decoding has on real vLLM (facts file, fact 5) and
that request migration relies on. The text is the concatenation of the ids' pieces
(`tokens.piece`), so text and ids always agree.

A decode that read KV blocks which no longer hold its prompt (reused hand-off parameters: fact 2)
generates from a corrupted context: `salt` differs, so does every token.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdproxy.sim.tokens import piece

CONTEXT = 4  # ids the next one depends on
_MASK = (1 << 64) - 1
_STALE_KV = 0x5DEECE66D  # salt of a context read from freed blocks


def next_token(context: Sequence[int], salt: int, vocab_size: int) -> int:
    """splitmix64 over the last CONTEXT ids: cheap, well mixed, and the same on every instance."""
    x = (salt * 0x9E3779B97F4A7C15) & _MASK
    for token in context[-CONTEXT:]:
        x = (x ^ token) * 0xBF58476D1CE4E5B9 & _MASK
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
        x ^= x >> 31
    return x % vocab_size


class Generation:
    """The output ids of one request, computed as far as they are asked for."""

    __slots__ = ("ids", "_context", "_salt", "_vocab")

    def __init__(self, prompt_ids: Sequence[int], seed: int | None, vocab_size: int, stale_kv: bool = False) -> None:
        self.ids: list[int] = []
        self._context = list(prompt_ids[-CONTEXT:])
        self._salt = (seed or 0) ^ (_STALE_KV if stale_kv else 0)
        self._vocab = vocab_size

    def token_ids(self, start: int, stop: int) -> list[int]:
        while len(self.ids) < stop:
            token = next_token(self._context, self._salt, self._vocab)
            self.ids.append(token)
            self._context = self._context[1 - CONTEXT:] + [token]
        return self.ids[start:stop]

    def text(self, start: int, stop: int) -> str:
        return "".join([piece(t) for t in self.token_ids(start, stop)])
