"""Workload definition: seeded request streams, presets, YAML and flag errors (no processes)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from pdproxy.bench.prompts import LEAD, Prompts, fill
from pdproxy.sim.tokens import Tokenizer
from pdproxy.bench.workload import (
    PROMPT_PRESETS,
    VOCAB,
    TrafficClass,
    Workload,
    WorkloadError,
    apply_sweep,
    arrival_times,
    class_requests,
)


TOK = Tokenizer(2.3)  # the simulator's rule stands in for a server's tokenizer


def sized(endpoint: str = "completions") -> Prompts:
    """What bench/prompts.prepare learns from a server that tokenizes like the simulator."""
    lead = len(TOK.encode_chat([{"role": "user", "content": LEAD}])) if endpoint == "chat" else 1 + TOK.count(LEAD)
    return Prompts(endpoint, "tokenize", lead, 2.3, 8192, word_tokens=[TOK.count(" " + w) for w in VOCAB])


def bodies(wl: Workload, ci: int = 0, n: int = 20) -> list[dict]:
    p = sized(wl.endpoint)
    return [r.body(wl, p.make(r)[0]) for r in itertools.islice(class_requests(wl, ci), n)]


def test_same_seed_same_requests_different_seed_different() -> None:
    wl = Workload(seed=7, requests=10, classes=[TrafficClass(prompt="short", output="10-40", concurrency=2)])
    a, b = bodies(wl), bodies(Workload.from_dict(wl.to_dict()))
    assert a == b
    wl2 = Workload.from_dict({**wl.to_dict(), "seed": 8})
    assert bodies(wl2) != a
    # prompts are distinct from each other (no accidental prefix-cache hits between requests)
    assert len({x["prompt"] for x in a}) == len(a)


def test_lengths_follow_presets_and_ranges() -> None:
    wl = Workload(requests=1, classes=[TrafficClass(prompt="medium", output="5-9", concurrency=1)])
    lo, hi = PROMPT_PRESETS["medium"]
    reqs = list(itertools.islice(class_requests(wl, 0), 200))
    lengths = [r.prompt_tokens for r in reqs]
    assert all(lo <= n <= hi for n in lengths) and len(set(lengths)) > 20
    assert {r.max_tokens for r in reqs} == {5, 6, 7, 8, 9}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompts_have_exactly_the_asked_tokens(endpoint: str) -> None:
    wl = Workload(endpoint=endpoint, requests=1, classes=[TrafficClass(prompt="20-3000", concurrency=1)])
    p = sized(endpoint)
    for r in itertools.islice(class_requests(wl, 0), 60):
        text, words = p.make(r)
        n = TOK.count(text) + 1 if endpoint == "completions" else len(TOK.encode_chat([{"role": "user",
                                                                                       "content": text}]))
        assert n == r.prompt_tokens and words == len(text.split()) < n


def test_fill_reaches_every_total_or_says_it_cannot() -> None:
    rng = np.random.default_rng(0)
    for total in (0, 2, 3, 4, 5, 7, 101):
        picks = fill(rng, total, [2, 3, 3])
        assert picks is not None and sum([2, 3, 3][i] for i in picks) == total
    assert fill(rng, 1, [2, 3]) is None and fill(rng, 7, [2, 4]) is None and fill(rng, -1, [1]) is None


def test_classes_have_independent_streams() -> None:
    wl = Workload(requests=1, classes=[TrafficClass(name="a", prompt="10", concurrency=1),
                                       TrafficClass(name="b", prompt="10", concurrency=1)])
    assert bodies(wl, 0, 3) != bodies(wl, 1, 3)


def test_poisson_arrivals_seeded_and_near_rate() -> None:
    wl = Workload(seed=3, requests=1, classes=[TrafficClass(rate=20.0, arrival="poisson")])
    a = list(itertools.islice(arrival_times(wl, 0), 2000))
    assert a == list(itertools.islice(arrival_times(wl, 0), 2000))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert len(set(gaps)) > 100  # not constant
    assert 0.045 < sum(gaps) / len(gaps) < 0.055
    const = Workload(requests=1, classes=[TrafficClass(rate=4.0)])
    assert list(itertools.islice(arrival_times(const, 0), 3)) == [0.0, 0.25, 0.5]


def test_chat_body_and_stream_options() -> None:
    wl = Workload(endpoint="chat", requests=1, classes=[TrafficClass(prompt="40", output="3", concurrency=1)])
    body = bodies(wl, n=1)[0]
    assert body["messages"][0]["role"] == "user" and body["messages"][0]["content"].startswith(LEAD)
    assert body["stream"] is True and body["max_tokens"] == body["min_tokens"] == 3 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("data, msg", [
    ({"classes": [{"concurrency": 1, "rate": 2}], "requests": 1}, "exactly one of concurrency or rate"),
    ({"classes": [{"concurrency": 1, "prompt": "huge"}], "requests": 1}, "is not N, LOW-HIGH or a preset"),
    ({"classes": [{"concurrency": 1, "prompt": "9-3"}], "requests": 1}, "LOW <= HIGH"),
    ({"classes": [{"concurrency": 1}]}, "request count or a duration"),
    ({"classes": [{"concurrency": 1}], "requests": 1, "bogus": 1}, "unknown workload keys"),
    ({"classes": [{"concurrency": 1, "colour": 1}], "requests": 1}, "unknown keys"),
])
def test_bad_workloads_explain_themselves(data: dict, msg: str) -> None:
    with pytest.raises(WorkloadError, match=msg):
        Workload.from_dict(data).validate()


def test_sweep_applies_to_matching_classes_only() -> None:
    wl = Workload(requests=5, classes=[TrafficClass(name="s", concurrency=2), TrafficClass(name="l", rate=1.0)])
    c = apply_sweep(wl, "concurrency", "8")
    assert [k.concurrency for k in c.classes] == [8, None] and wl.classes[0].concurrency == 2
    p = apply_sweep(wl, "prompt", "long")
    assert [k.prompt for k in p.classes] == ["long", "long"]
    with pytest.raises(WorkloadError):
        apply_sweep(Workload(requests=1, classes=[TrafficClass(rate=1.0)]), "concurrency", "2")


def test_cli_rejects_bad_input_without_traceback(tmp_path) -> None:
    bad = tmp_path / "w.yaml"
    bad.write_text("classes: [{concurrency: 0}]\nrequests: 3\n")
    for args in (["--url", "http://127.0.0.1:9", "--workload", str(bad)],
                 ["--url", "127.0.0.1:9", "--requests", "1", "--concurrency", "1"],
                 ["--url", "http://127.0.0.1:9", "--concurrency", "1"],
                 ["--url", "http://127.0.0.1:9", "--requests", "2", "--concurrency", "1", "--sweep", "depth=1,2"],
                 ["--url", "http://127.0.0.1:9", "--workload", str(tmp_path / "missing.yaml")]):
        p = subprocess.run([sys.executable, "-m", "pdproxy", "bench", *args], capture_output=True, text=True,
                           timeout=30)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr and "pdproxy bench:" in p.stderr
