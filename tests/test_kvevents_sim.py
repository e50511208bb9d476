"""The simulator publishes vLLM 0.23's KV events: a prefill's stores and evictions, a decode's KV arrivals.

Real processes: a simulated prefill and decode with --kv-events-config, pdproxy in P/D mode in front, and this
test subscribing with the proxy's own subscriber."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

from procs import HOST, free_port, start_proxy, start_sim
from waits import scaled

from pdproxy.kvevents import BlockStored, chain_hashes
from pdproxy.kvevents.subscriber import KVEvents, Source


def events_config(pub: int, replay: int, topic: str) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{HOST}:{pub}",
                       "replay_endpoint": f"tcp://{HOST}:{replay}", "topic": topic})


def complete(url: str, prompt: list[int]) -> None:
    body = json.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 3}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=scaled(20)) as r:
        assert r.status == 200


def test_sim_publishes_prefill_stores_evictions_and_decode_arrivals():
    ports = {name: (free_port(), free_port()) for name in ("p0", "d0")}
    procs = []
    try:
        p, p_url = start_sim("prefill", "--kv-events-config", events_config(*ports["p0"], "kv@p0"),
                             "--time-scale", "0.1", "--num-gpu-blocks", "40", "--max-model-len", "512")
        procs.append(p)
        d, d_url = start_sim("decode", "--kv-events-config", events_config(*ports["d0"], "kv@d0"),
                             "--time-scale", "0.1")
        procs.append(d)
        proxy, url = start_proxy("--prefill", p_url, "--decode", d_url)
        procs.append(proxy)
        prompts = [[1000 * n + k for k in range(16 * 10 + 5)] for n in range(6)]  # 10 full blocks each

        async def scenario():
            complete(url, prompts[0])  # before subscribing: the replay brings it
            events = KVEvents([Source(name, f"tcp://{HOST}:{pub}", f"tcp://{HOST}:{replay}", f"kv@{name}")
                               for name, (pub, replay) in ports.items()], probe_interval=0.5)
            stores: list[tuple[str, bool, int]] = []
            events.add_listener(lambda address, batch, live: stores.extend(
                (address, live, len(e.block_hashes)) for e in batch.events if isinstance(e, BlockStored)))
            events.start()
            p0, d0 = events.get("p0"), events.get("d0")
            keys = [chain_hashes(prompt, 16) for prompt in prompts]

            async def until(what, condition):
                deadline = time.monotonic() + scaled(15)
                while not condition():
                    assert time.monotonic() < deadline, f"{what}: {events.status()}"
                    await asyncio.sleep(0.02)

            try:
                await until("catch-up", lambda: p0.index.matched_blocks(keys[0]) == 10
                            and d0.index.matched_blocks(keys[0]) == 10)
                for prompt in prompts[1:]:
                    await asyncio.to_thread(complete, url, prompt)
                await until("the decode's arrivals", lambda: all(d0.index.matched_blocks(k) == 10 for k in keys))
                # the prefill's 40-block cache cannot hold 6 prompts of 10 blocks: it evicted the oldest
                assert p0.counts["events"] > 6 and p0.index.removed >= 20
                assert p0.index.matched_blocks(keys[-1]) == 10 and p0.index.matched_blocks(keys[0]) == 0
                # every live store on the decode is one prompt's whole KV, arriving
                assert [n for a, live, n in stores if a == "d0" and live] == [10] * 5
                for sub in (p0, d0):
                    assert sub.flowing and sub.counts["gaps"] == 0 and sub.counts["decode_errors"] == 0
                    assert sub.index.block_size == 16 and sub.index.orphans == 0
            finally:
                await events.stop()

        asyncio.run(scenario())
    finally:
        for proc in procs:
            proc.stop()


def test_sim_says_where_it_publishes():
    """What `pdproxy serve --kv-events-*` has to be given, printed at start (and said when nothing is)."""
    pub, replay = free_port(), free_port()
    procs = []
    try:
        p, _ = start_sim("prefill", "--kv-events-config", events_config(pub, replay, "kv@p0"))
        procs.append(p)
        q, _ = start_sim("prefill", "--kv-events-config", events_config(free_port(), free_port(), ""),
                         "--no-enable-prefix-caching")
        procs.append(q)
        assert (f"pdproxy sim: KV events on tcp://{HOST}:{pub} (replay tcp://{HOST}:{replay}, topic kv@p0)"
                in p.output()), p.output()
        assert "pdproxy sim: no KV events: --kv-events-config is given but prefix caching is off" in q.output()
    finally:
        for proc in procs:
            proc.stop()
