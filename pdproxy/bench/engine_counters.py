"""The instances' own prefix-cache counters, read before and after a run (a separate addition to the bench).

With `--engine-metrics URL ...` the bench reads each vLLM instance's /metrics (vLLM 0.23 names, summed
over its engines) just before the first request and after the last one; the differences go into the
run's summary as `engine_counters`, and the report shows the prefix-cache hit rate (cached prompt tokens
over queried ones) and the prompt tokens the instances computed. The counters are the instances', so
they also count whatever else those instances served meanwhile: point them at instances only the run
uses. An instance that cannot be read is reported as such, never guessed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {  # our name -> (sample name, required labels)
    "queries": ("vllm:prefix_cache_queries_total", {}),
    "hits": ("vllm:prefix_cache_hits_total", {}),
    "computed": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "prompt_tokens": ("vllm:prompt_tokens_total", {}),
}


def parse(text: str) -> dict[str, float]:
    wanted = [line for line in text.splitlines() if line.startswith(tuple(n for n, _ in COUNTERS.values()))]
    out = {name: 0.0 for name in COUNTERS}
    for family in text_string_to_metric_families("\n".join(wanted) + "\n"):
        for sample in family.samples:
            for name, (sample_name, labels) in COUNTERS.items():
                if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    out[name] += sample.value
    return out


async def snapshot(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, dict[str, float] | str]:
    """Each instance's counters, or why they could not be read."""
    async def one(url: str) -> dict[str, float] | str:
        try:
            async with session.get(url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    return f"HTTP {r.status}"
                return parse(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            return type(exc).__name__

    return dict(zip(urls, await asyncio.gather(*(one(u) for u in urls))))


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The run's share of the counters, per instance and in total, with the hit rate."""
    instances: dict[str, Any] = {}
    total = {name: 0.0 for name in COUNTERS}
    for url, b in before.items():
        a = after.get(url)
        if not isinstance(b, dict) or not isinstance(a, dict):
            instances[url] = {"error": b if isinstance(b, str) else a}
            continue
        d = {name: a[name] - b[name] for name in COUNTERS}
        d["hit_rate"] = d["hits"] / d["queries"] if d["queries"] else None
        instances[url] = d
        for name in COUNTERS:
            total[name] += d[name]
    return {"instances": instances, **total, "hit_rate": total["hits"] / total["queries"] if total["queries"] else None}
