"""The simulator's automatic prefix caching, on a real simulated instance: vLLM's counters and the
engine's busy time (simulated GPU time, so independent of the host's speed) tell what was computed."""

from __future__ import annotations

import httpx
import pytest

from ledgers import counter
from procs import start_sim


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


class Instance:
    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.Client(timeout=60)

    def complete(self, prompt, **extra) -> dict:
        r = self.client.post(self.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def chat(self, messages) -> int:
        r = self.client.post(self.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    def metric(self, name: str, **labels: str) -> float:
        return counter(self.client.get(self.url + "/metrics").text, name, **labels)

    def busy(self) -> float:
        return self.client.get(self.url + "/sim/state").json()["busy_seconds"]


@pytest.fixture
def sim():
    proc, url = start_sim("single", "--num-gpu-blocks", "600")  # 9600 tokens of KV: small enough to evict
    yield Instance(url)
    proc.stop()


def test_a_shared_prefix_is_computed_once_and_counted_as_vllm_does(sim):
    system = ids(1000, 2000)
    busy0 = sim.busy()
    sim.complete(system + [5, 6])
    busy1 = sim.busy()
    sim.complete(system + [7, 8])
    busy2 = sim.busy()
    assert busy2 - busy1 < (busy1 - busy0) / 4  # prefill time only for the uncached tail

    queries = sim.metric("vllm:prefix_cache_queries_total")
    hits = sim.metric("vllm:prefix_cache_hits_total")
    assert queries == 2002 * 2
    assert hits == 2000 // 16 * 16  # whole blocks only, and never the whole prompt
    assert sim.metric("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == hits
    assert sim.metric("vllm:prompt_tokens_by_source_total", source="local_compute") == queries - hits
    assert sim.metric("vllm:prompt_tokens_total") == queries  # vLLM counts cached prompt tokens as processed


def test_token_ids_and_chat_prompts_hit_too_and_a_changed_prefix_does_not(sim):
    ids = list(range(1000, 1800))
    sim.complete(ids)
    before = sim.metric("vllm:prefix_cache_hits_total")
    sim.complete(ids + [5, 6, 7])
    assert sim.metric("vllm:prefix_cache_hits_total") - before == 800
    sim.complete([999] + ids)  # one token in front: no block matches (the hashes are chained)
    assert sim.metric("vllm:prefix_cache_hits_total") - before == 800

    messages = [{"role": "system", "content": words("chat", 500)}, {"role": "user", "content": "hello"}]
    sim.chat(messages)
    before = sim.metric("vllm:prefix_cache_hits_total")
    tokens = sim.chat(messages[:1] + [{"role": "user", "content": "goodbye"}])
    hit = sim.metric("vllm:prefix_cache_hits_total") - before
    assert tokens - 16 - 24 <= hit < tokens  # all whole blocks before the user's turn (template and all)


def test_cached_blocks_are_evicted_least_recently_used_within_the_kv_capacity(sim):
    first = ids(1000, 3000)
    sim.complete(first)
    for k in range(4):  # 4 × 3000 tokens through a 9600-token cache push the first prompt out
        sim.complete(ids(10_000 * (k + 1), 3000))
    before = sim.metric("vllm:prefix_cache_hits_total")
    sim.complete(first + [5])
    assert sim.metric("vllm:prefix_cache_hits_total") == before
    sim.complete(first + [6])  # computed again just now, so cached again
    assert sim.metric("vllm:prefix_cache_hits_total") - before == 3000 // 16 * 16


def test_prefix_caching_can_be_turned_off():
    proc, url = start_sim("single", "--no-enable-prefix-caching")
    try:
        sim = Instance(url)
        prompt = ids(1000, 500)
        sim.complete(prompt)
        sim.complete(prompt)
        assert sim.metric("vllm:prefix_cache_hits_total") == 0
        assert sim.metric("vllm:prefix_cache_queries_total") == 0
        assert sim.metric("vllm:prompt_tokens_by_source_total", source="local_compute") == 1000
    finally:
        proc.stop()
