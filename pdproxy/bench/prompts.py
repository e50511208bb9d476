"""Prompts of an exact number of tokens of the target's tokenizer, learned from its `/tokenize`.

A prompt length means tokens as the server counts them (`usage.prompt_tokens`: BOS and the chat
template included), never words. Before the run the bench asks the server (`prepare`):

1. `/tokenize` of one fixed lead word, as a completion prompt and as a chat message: the tokens
   every prompt starts with (BOS, the template, the lead word), and the server's `max_model_len`;
2. `/tokenize` of the whole word list (in slices) with `return_token_strs`: each word's tokens,
   told apart by the word-start marker of its first piece (`Ġ` byte-level BPE, `▁` SentencePiece,
   a space). Tokenizers that split text at spaces first (Llama-3, GPT, Mistral, the simulator)
   count a text of words as the sum of its words, so a prompt is the lead word plus random words
   whose counts add up exactly to what is left;
3. `/tokenize` of each class's shortest and longest prompt, checked against the sum (and of a
   corpus' prompts, checked against `max_model_len`).

Where that works the method is `tokenize`: every prompt is exact. Where the pieces show no word
boundaries or the check fails, the method is `ratio`: the measured tokens per word size the
prompts (±1-2 %). Without `/tokenize` at all it is `usage`: prompts start at 2.3 tokens per word
(Llama-3 on these words) and the ratio is refitted from the answers' `usage.prompt_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from pdproxy.bench.workload import (OUTPUT_PRESETS, PROMPT_PRESETS, VOCAB, LengthDist, PlannedRequest, Workload,
                                    WorkloadError, load_corpus)

LEAD = VOCAB[0]  # every synthetic prompt starts with it, so the template's tokens are the same in all
WORD_STARTS = (" ", "Ġ", "▁")
GUESS_TOKENS_PER_WORD = 2.3  # Llama-3's tokenizer on these words (research/real-vllm-h200.md)
SLICE = 200  # words per /tokenize call while learning: fits any max_model_len in use
FIT_SAMPLES = 200  # answers kept to refit the ratio from usage
CORPUS_CHECKED = 1000  # corpus prompts counted against max_model_len before a run


@dataclass
class Prompts:
    """How this run's prompts are built, and the facts learned from the server."""

    endpoint: str
    method: str  # "tokenize" (exact), "ratio" (measured tokens per word) or "usage" (refitted from answers)
    lead_tokens: int  # BOS + template + the lead word
    tokens_per_word: float
    max_model_len: int | None = None
    word_tokens: list[int] | None = None  # per VOCAB word (with its leading space), in "tokenize" mode
    notes: list[str] = field(default_factory=list)
    _seen: list[tuple[int, int]] = field(default_factory=list)  # (words, usage.prompt_tokens), "usage" mode

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "lead_tokens": self.lead_tokens, "tokens_per_word": self.tokens_per_word,
                "max_model_len": self.max_model_len, "notes": self.notes}

    def make(self, req: PlannedRequest) -> tuple[str, int]:
        """The prompt text of a planned request and its number of words."""
        if req.text is not None:
            return req.text, len(req.text.split())
        rng = np.random.default_rng(req.seed)
        words = [LEAD, *self.words(rng, req.prompt_tokens - self.lead_tokens, f"class {req.cls!r}")]
        return " ".join(words), len(words)

    def words(self, rng: np.random.Generator, tokens: int, what: str) -> list[str]:
        """Random words that come to `tokens` tokens after the lead word: exactly (±1) where the words'
        tokens are known, else at the measured tokens per word. Shared prefixes are sized with it too."""
        if self.word_tokens is not None:
            picks = next((p for p in (fill(rng, n, self.word_tokens) for n in (tokens, tokens + 1, tokens - 1))
                          if p is not None), None)  # exact, else one token off
            if picks is None:
                raise WorkloadError(f"{what}: {tokens} tokens cannot be reached (±1) with this tokenizer's words")
        else:
            picks = list(rng.integers(0, len(VOCAB), max(0, round(tokens / self.tokens_per_word))))
        return [VOCAB[i] for i in picks]

    def observe(self, words: int, prompt_tokens: int | None) -> None:
        """`usage` mode: refit tokens = lead + per_word × (words - 1) from the answers so far."""
        if self.method != "usage" or not prompt_tokens or len(self._seen) >= FIT_SAMPLES:
            return
        self._seen.append((words, prompt_tokens))
        w = np.array([x for x, _ in self._seen], dtype=float)
        t = np.array([y for _, y in self._seen], dtype=float)
        if len(set(w)) > 1:
            slope, intercept = np.polyfit(w, t, 1)
            if slope > 0:
                self.tokens_per_word, self.lead_tokens = float(slope), max(0, round(intercept + slope))
        elif w[0] > 1:
            self.tokens_per_word = float((t[0] - self.lead_tokens) / (w[0] - 1)) or self.tokens_per_word


def fill(rng: np.random.Generator, tokens: int, counts: list[int]) -> list[int] | None:
    """Random word indices whose token counts add up to `tokens` exactly (None: no such choice)."""
    if tokens < 0:
        return None
    by_count: dict[int, list[int]] = {}
    for i, c in enumerate(counts):
        if c > 0:
            by_count.setdefault(c, []).append(i)
    if not by_count:
        return None
    biggest = max(by_count)
    picks: list[int] = []
    left = tokens
    while left > 2 * biggest:
        i = int(rng.integers(0, len(counts)))
        if counts[i] > 0:
            picks.append(i)
            left -= counts[i]
    while True:
        combo = _exact(left, sorted(by_count))
        if combo is not None:
            picks += [by_count[c][int(rng.integers(0, len(by_count[c])))] for c in combo]
            rng.shuffle(picks)
            return picks
        if not picks:
            return None
        left += counts[picks.pop()]


def _exact(total: int, sizes: list[int]) -> list[int] | None:
    """Fewest sizes (with repetition) summing to `total`, by dynamic programming; None if impossible."""
    best: list[list[int] | None] = [[]] + [None] * total
    for t in range(1, total + 1):
        for s in sizes:
            prev = best[t - s] if s <= t else None
            if prev is not None and (best[t] is None or len(prev) + 1 < len(best[t])):  # type: ignore[arg-type]
                best[t] = prev + [s]
    return best[total]


# -- learning from the server ---------------------------------------------------------------------

class _Server:
    def __init__(self, session: aiohttp.ClientSession, url: str, headers: dict[str, str], model: str,
                 timeout: float) -> None:
        self.session, self.url, self.headers, self.model = session, url.rstrip("/"), headers, model
        self.timeout = aiohttp.ClientTimeout(total=min(timeout, 60))

    async def tokenize(self, **body: Any) -> dict[str, Any] | None:
        """The server's answer, or None when it has no /tokenize; other refusals are the user's to fix."""
        try:
            async with self.session.post(self.url + "/tokenize", json={**({"model": self.model} if self.model else {}),
                                                                       **body},
                                         headers=self.headers, timeout=self.timeout) as r:
                raw = await r.read()
                try:
                    obj = await r.json(content_type=None)
                except ValueError:
                    obj = None
                error = obj.get("error") if isinstance(obj, dict) and isinstance(obj.get("error"), dict) else {}
                if r.status in (404, 405, 501) and error.get("param") != "model":
                    return None  # no such route (a model it does not serve is the user's to fix, below)
                if r.status != 200:
                    message = error.get("message")
                    raise WorkloadError(f"{self.url}/tokenize answered HTTP {r.status}: "
                                        f"{message or raw[:200].decode('utf-8', 'replace')}")
                if not isinstance(obj, dict) or not isinstance(obj.get("count"), int):
                    return None
                return obj
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def max_model_len(self) -> int | None:
        """vLLM lists it in /v1/models."""
        try:
            async with self.session.get(self.url + "/v1/models", headers=self.headers, timeout=self.timeout) as r:
                obj = await r.json(content_type=None)
            for m in obj.get("data") or []:
                if isinstance(m.get("max_model_len"), int) and m.get("id") == (self.model or m.get("id")):
                    return int(m["max_model_len"])
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError):
            pass
        return None

    async def count(self, endpoint: str, text: str) -> dict[str, Any] | None:
        if endpoint == "chat":
            return await self.tokenize(messages=[{"role": "user", "content": text}])
        return await self.tokenize(prompt=text)


async def served_model(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                       timeout: float = 60.0) -> str:
    """The first model the target lists in /v1/models, for a run given no --model; "" when it lists none
    (the requests then name no model: vLLM serves them with its own)."""
    try:
        async with session.get(url + "/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=min(timeout, 30.0))) as r:
            obj = await r.json(content_type=None) if r.status == 200 else None
        for m in (obj or {}).get("data") or []:
            if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]:
                return str(m["id"])
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError):
        pass
    return ""


async def prepare(session: aiohttp.ClientSession, url: str, headers: dict[str, str], wl: Workload,
                  timeout: float = 60.0) -> Prompts:
    """Learn how to size this workload's prompts on this server; check every length fits its limit."""
    server = _Server(session, url, headers, wl.model, timeout)
    lead = await server.count(wl.endpoint, LEAD)
    if lead is None:
        guess = 3 if wl.endpoint == "completions" else 12  # BOS (+ a chat template) + the lead word
        prompts = Prompts(wl.endpoint, "usage", guess, GUESS_TOKENS_PER_WORD, await server.max_model_len())
        prompts.notes.append(f"{url} has no /tokenize (or did not answer it): prompt lengths are approximate, "
                             f"built from text at {GUESS_TOKENS_PER_WORD} tokens per word and refitted from the "
                             "answers' usage.prompt_tokens (records keep requested and actual counts)")
    else:
        prompts = await _learn(server, wl.endpoint, lead)
        await _check(server, prompts, wl)
        await _check_corpus(server, prompts, wl)
    _check_limits(prompts, wl)
    return prompts


async def _learn(server: _Server, endpoint: str, lead: dict[str, Any]) -> Prompts:
    limit = lead.get("max_model_len") if isinstance(lead.get("max_model_len"), int) else None
    counts: list[int] = []
    total = 0
    marked = True
    for start in range(0, len(VOCAB), SLICE):
        words = VOCAB[start:start + SLICE]
        got = await server.tokenize(prompt=" " + " ".join(words), add_special_tokens=False, return_token_strs=True)
        if got is None:
            raise WorkloadError(f"{server.url}/tokenize stopped answering while the bench learned its tokenizer")
        total += got["count"]
        strs = got.get("token_strs")
        starts = [i for i, s in enumerate(strs or []) if isinstance(s, str) and s.startswith(WORD_STARTS)]
        if not strs or len(starts) != len(words):
            marked = False
            continue
        counts += [b - a for a, b in zip(starts, starts[1:] + [len(strs)])]
    per_word = total / len(VOCAB)
    if marked:
        return Prompts(endpoint, "tokenize", lead["count"], per_word, limit, word_tokens=counts)
    p = Prompts(endpoint, "ratio", lead["count"], per_word, limit)
    p.notes.append(f"{server.url}/tokenize shows no word boundaries in its token strings: prompts are sized at "
                   f"the measured {per_word:.3f} tokens per word (within a few %, not exact)")
    return p


async def _check(server: _Server, prompts: Prompts, wl: Workload) -> None:
    """Build each class's shortest and longest prompt and count them; a miss means the words do not add up."""
    if prompts.method != "tokenize":
        return
    for ci, c in enumerate(wl.classes):
        if c.corpus:
            continue
        d = LengthDist.parse(c.prompt, PROMPT_PRESETS, "prompt")
        for n in sorted({d.low, d.high}):
            if n < prompts.lead_tokens:
                raise WorkloadError(f"class {c.name!r}: a prompt of {n} tokens is shorter than what every prompt "
                                    f"starts with on this server ({prompts.lead_tokens} tokens: BOS, chat template, "
                                    "one word)")
            text, _ = prompts.make(PlannedRequest(c.name, -1, n, 1, (wl.seed, ci, 1 << 30, n)))
            got = await server.count(wl.endpoint, text)
            if got is None or abs(got["count"] - n) > 1:
                prompts.method, prompts.word_tokens = "ratio", None
                prompts.notes.append(f"a {n}-token prompt built from this tokenizer's word counts has "
                                     f"{got and got['count']} tokens: its words do not add up, so prompts are sized "
                                     f"at {prompts.tokens_per_word:.3f} tokens per word (within a few %, not exact)")
                return


async def _check_corpus(server: _Server, prompts: Prompts, wl: Workload) -> None:
    """Count a corpus' prompts (the first CORPUS_CHECKED of each) against the limit: they are sent as they are."""
    limit = prompts.max_model_len
    if limit is None:
        return
    for c in wl.classes:
        if not c.corpus:
            continue
        output = LengthDist.parse(c.output, OUTPUT_PRESETS, "output").high
        for n, (text, max_tokens) in enumerate(load_corpus(c.corpus)[:CORPUS_CHECKED], 1):
            got = await server.count(wl.endpoint, text)
            want = int(max_tokens) if max_tokens else output
            if got is not None and got["count"] + want > limit:
                raise WorkloadError(f"{c.corpus}: prompt {n} has {got['count']} tokens + {want} output tokens, over "
                                    f"the server's max_model_len of {limit}: the server would answer 400")


def _check_limits(prompts: Prompts, wl: Workload) -> None:
    """Stop before the run when a class can ask for more than the server's max_model_len."""
    limit = prompts.max_model_len
    if limit is None:
        return
    for c in wl.classes:
        if c.corpus:
            continue
        prompt = LengthDist.parse(c.prompt, PROMPT_PRESETS, "prompt").high
        if c.shared_prefixes:  # the system prompt comes in front of the class's own prompt
            prompt += LengthDist.parse(c.prefix_len, PROMPT_PRESETS, "prefix_len").high
        output = LengthDist.parse(c.output, OUTPUT_PRESETS, "output").high
        if prompt + output > limit:
            raise WorkloadError(f"class {c.name!r}: prompts up to {prompt} tokens + outputs up to {output} tokens = "
                                f"{prompt + output} tokens, over the server's max_model_len of {limit}: the server "
                                "would answer 400; shorten the class or start the server with a larger "
                                "--max-model-len")
