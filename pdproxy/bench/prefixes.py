"""Prompts that share prefixes, as real traffic does: a few system prompts in front of many users'
questions, and multi-turn conversations whose every turn repeats the ones before it.

Both shapes exist to measure prefix-cache reuse (vLLM's automatic prefix caching, and routing that
keeps a prefix on the instance that cached it). They wrap the class's own prompt draw, and every
length is in the target's tokens, like the class's `prompt` (bench/prompts.py sizes the words):

* `shared_prefixes: N` (with `prefix_len`, in tokens): each request starts with one of N fixed system
  prompts, drawn at random; the class's `prompt` tokens follow it. The request asks for both: its
  `prompt_tokens_requested` is the prefix's tokens plus the class's, which is what the server counts.
* `sessions: S` (with `turns`): S conversations run side by side; request i is turn (i // S) % turns of
  conversation i % S, and a conversation that has had its turns is replaced by a new one. Turn t's
  prompt is turn t-1's prompt plus a stand-in answer (ANSWER_TOKENS) and the new question, so each
  turn's prompt is a prefix of the next, and it asks for all of their tokens. The request carries the
  conversation as `user` (for `consistent_hash` routing).

Every synthetic prompt is the lead word (BOS and the template come with it) followed by words: the
shapes put their words right after the lead, so the tokens add up exactly where the bench sizes
prompts exactly (`tokenize`), and the shared part (lead and system prompt) is the same in every
request. A corpus prompt has no lead word: the system prompt goes in front of it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdproxy.bench.prompts import LEAD, Prompts
from pdproxy.bench.workload import PROMPT_PRESETS, LengthDist, Workload

ANSWER_TOKENS = 64  # the stand-in for the previous answer in a conversation's history


@dataclass
class PrefixShaper:
    seed: int
    class_index: int
    prompts: Prompts
    shared_prefixes: int = 0
    prefix_len: Any = None  # a workload.LengthDist of tokens: each system prompt's length is drawn from it
    sessions: int = 0
    turns: int = 1
    _prefixes: list[tuple[str, int]] = field(default_factory=list)  # (words, tokens)
    _history: dict[int, tuple[str, int]] = field(default_factory=dict)  # slot -> (words after the lead, tokens)

    @classmethod
    def of(cls, wl: Workload, class_index: int, prompts: Prompts) -> "PrefixShaper":
        c = wl.classes[class_index]
        return cls(wl.seed, class_index, prompts, c.shared_prefixes,
                   LengthDist.parse(c.prefix_len, PROMPT_PRESETS, "prefix_len"), c.sessions, c.turns)

    def __post_init__(self) -> None:
        rng = np.random.default_rng([self.seed, self.class_index, 2])
        self._prefixes = [self._content(rng, self.prefix_len.draw(rng)) for _ in range(self.shared_prefixes)]
        self._rng = np.random.default_rng([self.seed, self.class_index, 3])

    def _content(self, rng: np.random.Generator, tokens: int) -> tuple[str, int]:
        return " ".join(self.prompts.words(rng, tokens, "prefix")), tokens

    def wrap(self, i: int, text: str, words: int, tokens: int | None,
             body: dict[str, Any]) -> tuple[dict[str, Any], int, int | None]:
        """Request i's body with its prompt shaped (unchanged for a class without either shape), its words
        and the prompt tokens it asks for (None where the class's own are not known: a corpus)."""
        if not (self.shared_prefixes or self.sessions):
            return body, words, tokens
        shaped, asked, conversation = self.shape(i, text, tokens)
        if "messages" in body:
            body["messages"] = [{"role": "user", "content": shaped}]
        else:
            body["prompt"] = shaped
        if conversation is not None:
            body["user"] = conversation
        return body, len(shaped.split()), asked

    def shape(self, i: int, text: str, tokens: int | None) -> tuple[str, int | None, str | None]:
        """The prompt of request i built around the class's own draw `text` (of `tokens`), the tokens the
        whole prompt asks for, and its conversation (or None)."""
        lead = text.startswith(LEAD + " ")
        rest = text[len(LEAD) + 1:] if lead else text
        after_lead = self.prompts.lead_tokens if lead else 0
        content = None if tokens is None else tokens - after_lead  # the tokens of `rest`
        if self.shared_prefixes:
            words, prefix = self._prefixes[int(self._rng.integers(self.shared_prefixes))]
            rest, content = f"{words} {rest}", _plus(content, prefix)
        conversation = None
        if self.sessions:
            slot, turn = i % self.sessions, (i // self.sessions) % self.turns
            conversation = f"conversation-{slot + self.sessions * ((i // self.sessions) // self.turns)}"
            if turn:
                history, before = self._history[slot]
                answer, answered = self._content(self._rng, ANSWER_TOKENS)
                rest, content = f"{history} {answer} {rest}", _plus(_plus(content, before), answered)
            self._history[slot] = (rest, content)
        return (f"{LEAD} {rest}" if lead else rest), _plus(content, after_lead), conversation


def _plus(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b
