"""Prompts that share prefixes, as real traffic does: a few system prompts in front of many users'
questions, and multi-turn conversations whose every turn repeats the ones before it.

Both shapes exist to measure prefix-cache reuse (vLLM's automatic prefix caching, and routing that
keeps a prefix on the instance that cached it). They wrap the class's own prompt draw:

* `shared_prefixes: N` (with `prefix_len`, in words): each request starts with one of N fixed system
  prompts, drawn at random; the class's `prompt` (sized in tokens by bench/prompts.py) follows it.
* `sessions: S` (with `turns`): S conversations run side by side; request i is turn (i // S) % turns of
  conversation i % S, and a conversation that has had its turns is replaced by a new one. Turn t's
  prompt is turn t-1's prompt plus a stand-in answer and the new question, so each turn's prompt is a
  prefix of the next. The request carries the conversation as `user` (for `consistent_hash` routing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdproxy.bench.workload import PROMPT_PRESETS, VOCAB, LengthDist, Workload

ANSWER_WORDS = 32  # the stand-in for the previous answer in a conversation's history


@dataclass
class PrefixShaper:
    seed: int
    class_index: int
    vocab: list[str]
    shared_prefixes: int = 0
    prefix_len: Any = None  # a workload.LengthDist: each system prompt's length is drawn from it
    sessions: int = 0
    turns: int = 1
    _prefixes: list[str] = field(default_factory=list)
    _history: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, wl: Workload, class_index: int) -> "PrefixShaper":
        c = wl.classes[class_index]
        return cls(wl.seed, class_index, VOCAB, c.shared_prefixes, LengthDist.parse(c.prefix_len, PROMPT_PRESETS,
                   "prefix_len"), c.sessions, c.turns)

    def wrap(self, i: int, text: str, words: int, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Request i's body with its prompt shaped (unchanged for a class without either shape), and its words."""
        if not (self.shared_prefixes or self.sessions):
            return body, words
        shaped, conversation = self.shape(i, text)
        if "messages" in body:
            body["messages"] = [{"role": "user", "content": shaped}]
        else:
            body["prompt"] = shaped
        if conversation is not None:
            body["user"] = conversation
        return body, len(shaped.split())

    def __post_init__(self) -> None:
        rng = np.random.default_rng([self.seed, self.class_index, 2])
        self._prefixes = [self._words(rng, self.prefix_len.draw(rng)) for _ in range(self.shared_prefixes)]
        self._rng = np.random.default_rng([self.seed, self.class_index, 3])

    def _words(self, rng: np.random.Generator, n: int) -> str:
        return " ".join(self.vocab[j] for j in rng.integers(0, len(self.vocab), n))

    def shape(self, i: int, text: str) -> tuple[str, str | None]:
        """The prompt of request i built around the class's own draw `text`, and its conversation (or None)."""
        if self.shared_prefixes:
            text = f"{self._prefixes[int(self._rng.integers(self.shared_prefixes))]} {text}"
        if not self.sessions:
            return text, None
        slot, turn = i % self.sessions, (i // self.sessions) % self.turns
        conversation = slot + self.sessions * ((i // self.sessions) // self.turns)
        if turn:
            text = f"{self._history[slot]} {self._words(self._rng, ANSWER_WORDS)} {text}"
        self._history[slot] = text
        return text, f"conversation-{conversation}"
