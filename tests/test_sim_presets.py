"""The 2-GPU preset is the 1-GPU one with its links replaced: what it inherits must be chosen, not fallen into.

Why: `H200_LLAMA8B_2GPU = replace(H200_LLAMA8B, ...)` silently takes every value later fitted into the
1-GPU preset. The decode intake fitted on one shared H200 (0.13 GB/s) was inherited that way, and a 25 GB/s
link's KV then crawled into the decode (test_routing_compare's TTFT p50 went from 0.36 s to 9.4 s).
"""

from __future__ import annotations

from dataclasses import fields

from pdproxy.sim.presets import H200_LLAMA8B, H200_LLAMA8B_2GPU

# What a second GPU does not change, and why; any other field the two presets share fails the test.
INHERITED = {
    "decode_step_ms": "the same model on the same GPU type, one engine per GPU",
    "prefill_extra_ms": "as decode_step_ms",
    "frontend_overhead_ms": "vLLM's API server, on the host's CPU",
    "frontend_request_ms": "as frontend_overhead_ms",
    "frontend_stream_ms": "as frontend_overhead_ms",
    "frontend_finish_ms": "as frontend_overhead_ms (off in both: the fitted singles fit no better with it)",
    "frontend_jitter_ms": "off in both: what-if replays set it for the model's own spread",
    "kv_pull_overhead_ms": "the connector's own work per pull, not the link's",
    "kv_bytes_per_token": "the model's shape",
    "max_model_len": "the engine's configuration",
    "block_size": "the engine's configuration",
    "num_gpu_blocks": "one H200's memory per engine either way",
    "max_num_batched_tokens": "the engine's configuration",
    "max_num_seqs": "the engine's configuration",
    "enable_chunked_prefill": "the engine's configuration",
    "async_scheduling": "the engine's configuration",
    "kv_pull_cached": "vLLM's connector reads only what the decode's prefix cache lacks, on any GPUs",
    "kv_intake_gbps": "0 in both: one decode fed by three prefills on one H200 took its KV fastest (3P1D)",
    "kv_link_shares_gpu": "on in both: it only matters with a GPU sharing, which is fitted, and the fit chooses it",
    "kv_intake_bursts": "off in both: it did not fit the one-GPU recordings, and the 2-GPU preset has no intake",
    "instant": "both run the engine loop",
    "notes": "describe the curves both use",
}


def test_the_two_gpu_preset_inherits_only_what_a_second_gpu_leaves_alone():
    shared = {f.name for f in fields(H200_LLAMA8B)
              if getattr(H200_LLAMA8B, f.name) == getattr(H200_LLAMA8B_2GPU, f.name)}
    unexplained = shared - INHERITED.keys()
    assert not unexplained, (
        f"h200-llama8b-2gpu inherits {sorted(unexplained)} from h200-llama8b: set them for two GPUs, or "
        "list them in INHERITED with the reason a second GPU leaves them alone")
    # the fields that define it as a 2-GPU preset are its own
    for name in ("kv_bandwidth_gbps", "kv_latency_ms", "kv_pull_stalls_decode", "shared_gpu", "gpu_share",
                 "kv_together_gbps", "kv_pair_gbps"):
        assert name not in shared, name
