"""What the bench sends: traffic classes, length distributions and the seeded request stream.

A workload is one or more *traffic classes* sent at the same time (for example 8 closed-loop
streams with short prompts plus one long prompt per second), each with its own prompt-length and
output-cap distribution and its own load pattern (a concurrency, or an arrival rate that is
constant or Poisson). Everything random comes from one seed, so two runs with the same workload
send identical request bodies in the same per-class order (request ids differ: they carry a
per-run prefix so runs never collide in a shared trace file).

Lengths are tokens of the target's tokenizer: this module draws each request's prompt length and
output cap and a seed for its words; `bench/prompts.py` turns that into text of exactly that many
tokens, learned from the server's `/tokenize`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import yaml

# Presets are (low, high) inclusive, uniform. Shapes follow the measured H200 load
# (research/real-vllm-h200.md): ~200-token stream prompts, ~3000-token long prompts.
PROMPT_PRESETS: dict[str, tuple[int, int]] = {
    "short": (64, 256),
    "medium": (512, 1024),
    "long": (2048, 4096),
}
OUTPUT_PRESETS: dict[str, tuple[int, int]] = {
    "short": (16, 64),
    "medium": (128, 256),
    "long": (256, 512),
}


class WorkloadError(ValueError):
    """A workload that cannot be run; the message is meant for the user."""


@dataclass(frozen=True)
class LengthDist:
    """A length in tokens: a fixed value, a uniform range, or a named preset."""

    low: int
    high: int
    spec: str

    @classmethod
    def parse(cls, spec: Any, presets: dict[str, tuple[int, int]], what: str) -> "LengthDist":
        text = str(spec).strip()
        if text in presets:
            lo, hi = presets[text]
            return cls(lo, hi, text)
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", text)
        if not m:
            names = ", ".join(presets)
            raise WorkloadError(f"{what}: {spec!r} is not N, LOW-HIGH or a preset ({names})")
        lo = int(m.group(1))
        hi = int(m.group(2) or lo)
        if lo < 1 or hi < lo:
            raise WorkloadError(f"{what}: {spec!r} needs 1 <= LOW <= HIGH")
        return cls(lo, hi, text)

    def draw(self, rng: np.random.Generator) -> int:
        return int(self.low if self.low == self.high else rng.integers(self.low, self.high + 1))


@dataclass
class TrafficClass:
    """One kind of request and how it arrives."""

    name: str = "default"
    prompt: str = "short"
    output: str = "short"
    concurrency: int | None = None
    rate: float | None = None
    arrival: str = "constant"  # or "poisson"; only with rate
    requests: int | None = None  # per-class cap (optional)
    corpus: str | None = None  # JSONL/text file of fixed prompts, used in order, cycling
    shared_prefixes: int = 0  # prompts start with one of this many system prompts (pdproxy/bench/prefixes.py)
    prefix_len: str = "medium"  # tokens of each system prompt (before `prompt`'s): N, LOW-HIGH or a preset
    sessions: int = 0  # multi-turn: this many conversations side by side, each turn repeating the ones before
    turns: int = 4  # turns per conversation

    def validate(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.]+", self.name):
            raise WorkloadError(f"class name {self.name!r}: use letters, digits, '_' or '.'")
        if (self.concurrency is None) == (self.rate is None):
            raise WorkloadError(f"class {self.name!r}: give exactly one of concurrency or rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise WorkloadError(f"class {self.name!r}: concurrency must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise WorkloadError(f"class {self.name!r}: rate must be > 0 requests/s")
        if self.arrival not in ("constant", "poisson"):
            raise WorkloadError(f"class {self.name!r}: arrival must be constant or poisson")
        if self.requests is not None and self.requests < 1:
            raise WorkloadError(f"class {self.name!r}: requests must be >= 1")
        LengthDist.parse(self.prompt, PROMPT_PRESETS, f"class {self.name!r} prompt")
        LengthDist.parse(self.output, OUTPUT_PRESETS, f"class {self.name!r} output")
        LengthDist.parse(self.prefix_len, PROMPT_PRESETS, f"class {self.name!r} prefix_len")
        if self.shared_prefixes < 0 or self.sessions < 0 or self.turns < 1:
            raise WorkloadError(f"class {self.name!r}: shared_prefixes and sessions must be >= 0, turns >= 1")


@dataclass
class Workload:
    """Everything that decides which requests are sent and when (not where)."""

    model: str = ""  # empty: the model the target serves (its /v1/models), learnt when the run starts
    endpoint: str = "completions"  # or "chat"
    temperature: float = 0.0
    ignore_eos: bool = True
    min_tokens: bool = True  # send min_tokens = max_tokens (vLLM's extension), so outputs are exactly max_tokens
    continuous_usage: bool = True
    seed: int = 0
    requests: int | None = None
    duration: float | None = None
    warmup_requests: int = 0
    warmup_seconds: float = 0.0
    classes: list[TrafficClass] = field(default_factory=lambda: [TrafficClass(concurrency=1)])

    def validate(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise WorkloadError("endpoint must be completions or chat")
        if self.requests is None and self.duration is None and not all(c.requests for c in self.classes):
            raise WorkloadError("give a request count or a duration (or a request cap on every class)")
        if self.requests is not None and self.requests < 1:
            raise WorkloadError("requests must be >= 1")
        if self.duration is not None and self.duration <= 0:
            raise WorkloadError("duration must be > 0 seconds")
        if self.warmup_requests < 0 or self.warmup_seconds < 0:
            raise WorkloadError("warm-up must be >= 0")
        if not self.classes:
            raise WorkloadError("a workload needs at least one traffic class")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise WorkloadError(f"traffic class names must be unique: {names}")
        for c in self.classes:
            c.validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Workload":
        if not isinstance(data, dict):
            raise WorkloadError("a workload must be a mapping")
        data = dict(data)
        raw_classes = data.pop("classes", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise WorkloadError(f"unknown workload keys: {sorted(unknown)} (known: {sorted(known)})")
        wl = cls(**data)
        if raw_classes is not None:
            if not isinstance(raw_classes, list):
                raise WorkloadError("classes must be a list")
            ckeys = {f.name for f in dataclasses.fields(TrafficClass)}
            wl.classes = []
            for i, rc in enumerate(raw_classes):
                if not isinstance(rc, dict):
                    raise WorkloadError(f"classes[{i}] must be a mapping")
                bad = set(rc) - ckeys
                if bad:
                    raise WorkloadError(f"classes[{i}]: unknown keys {sorted(bad)} (known: {sorted(ckeys)})")
                wl.classes.append(TrafficClass(**{"name": f"c{i}", **rc}))
        return wl


@dataclass(frozen=True)
class PlannedRequest:
    """One request before it is sent: its lengths and what its words are drawn from."""

    cls: str
    index: int  # position within its class
    prompt_tokens: int | None  # the prompt's length in the server's tokens; None for a corpus prompt
    max_tokens: int
    seed: tuple[int, ...]  # seeds this request's words (bench/prompts.py)
    text: str | None = None  # a corpus prompt, sent as it is

    def body(self, wl: Workload, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            **({"model": wl.model} if wl.model else {}),  # none known: the server's own model
            "max_tokens": self.max_tokens,
            "temperature": wl.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if wl.continuous_usage:
            body["stream_options"]["continuous_usage_stats"] = True
        if wl.ignore_eos:
            body["ignore_eos"] = True
        if wl.min_tokens:
            body["min_tokens"] = self.max_tokens  # exactly max_tokens: the output is what the workload says
        if wl.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


def _vocabulary() -> list[str]:
    """A fixed list of 1 000 short pseudo-words (deterministic, no data files)."""
    cons, vows = "bdfgklmnprstvz", "aeiou"
    words = [a + b + c + d for a in cons for b in vows for c in cons for d in vows]
    return words[::5][:1000]


VOCAB = _vocabulary()


def load_corpus(path: str) -> list[tuple[str, int | None]]:
    """Fixed prompts: JSONL with `prompt` (and optional `max_tokens`), or one prompt per text line."""
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"corpus file not found: {path}")
    items: list[tuple[str, int | None]] = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix in (".jsonl", ".json"):
            try:
                obj = json.loads(line)
                items.append((str(obj["prompt"]), obj.get("max_tokens")))
            except (ValueError, KeyError, TypeError):
                raise WorkloadError(f"{path}:{n}: expected a JSON object with a 'prompt' key") from None
        else:
            items.append((line, None))
    if not items:
        raise WorkloadError(f"corpus file is empty: {path}")
    return items


def class_requests(wl: Workload, class_index: int) -> Iterator[PlannedRequest]:
    """The endless, seeded request sequence of one class (same seed → same sequence)."""
    c = wl.classes[class_index]
    rng = np.random.default_rng([wl.seed, class_index])
    prompt_d = LengthDist.parse(c.prompt, PROMPT_PRESETS, "prompt")
    out_d = LengthDist.parse(c.output, OUTPUT_PRESETS, "output")
    corpus = load_corpus(c.corpus) if c.corpus else None
    i = 0
    while True:
        max_tokens = out_d.draw(rng)
        if corpus:
            text, mt = corpus[i % len(corpus)]
            yield PlannedRequest(c.name, i, None, int(mt) if mt else max_tokens, (wl.seed, class_index, i), text)
        else:
            yield PlannedRequest(c.name, i, prompt_d.draw(rng), max_tokens, (wl.seed, class_index, i))
        i += 1


def arrival_times(wl: Workload, class_index: int) -> Iterator[float]:
    """Send offsets (seconds from start) of a rate-driven class; seeded for Poisson."""
    c = wl.classes[class_index]
    assert c.rate is not None
    rng = np.random.default_rng([wl.seed, class_index, 1])
    t = 0.0
    while True:
        yield t
        t += float(rng.exponential(1.0 / c.rate)) if c.arrival == "poisson" else 1.0 / c.rate


def load_yaml(path: str) -> dict[str, Any]:
    """Read a workload/bench YAML file into a mapping (errors are for people, not tracebacks)."""
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"workload file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise WorkloadError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise WorkloadError(f"{path}: the top level must be a mapping")
    return data


SWEEP_AXES = ("prompt", "output", "concurrency", "rate")


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """`AXIS=v1,v2,...` → (axis, values)."""
    axis, sep, values = spec.partition("=")
    axis = axis.strip()
    if not sep or axis not in SWEEP_AXES:
        raise WorkloadError(f"--sweep {spec!r}: expected AXIS=v1,v2,... with AXIS one of {', '.join(SWEEP_AXES)}")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not vals:
        raise WorkloadError(f"--sweep {spec!r}: no values")
    return axis, vals


def apply_sweep(wl: Workload, axis: str, value: str) -> Workload:
    """A copy of the workload with one axis set on every class it applies to."""
    new = Workload.from_dict(json.loads(json.dumps(wl.to_dict())))
    touched = 0
    for c in new.classes:
        if axis in ("prompt", "output"):
            setattr(c, axis, value)
            touched += 1
        elif axis == "concurrency" and c.concurrency is not None:
            try:
                c.concurrency = int(value)
            except ValueError:
                raise WorkloadError(f"sweep concurrency value {value!r} is not an integer") from None
            touched += 1
        elif axis == "rate" and c.rate is not None:
            try:
                c.rate = float(value)
            except ValueError:
                raise WorkloadError(f"sweep rate value {value!r} is not a number") from None
            touched += 1
    if not touched:
        raise WorkloadError(f"sweep axis {axis!r} applies to no traffic class of this workload")
    new.validate()
    return new
