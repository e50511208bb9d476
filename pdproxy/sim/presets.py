"""Named parameter sets for the simulator; every field can be overridden from the command line.

`h200-llama8b` (the default) is calibrated on tests/fixtures/vllm023/real-vllm-h200.md: vLLM 0.23,
a Llama-3.1-8B-shaped model (bf16) on one H200, NixlConnector between two instances that share
one GPU. How each number was derived is written next to it, so a preset for another shape can be
made the same way from the same five measurements (prefill TTFT vs prompt length, decode ITL vs
batch size, KV bytes per token, transfer time vs bytes, P/D hand-off).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdproxy.sim.timing import Points

# --- measurements (real-vllm-h200.md, medians of 5, one H200) -----------------------------------
REAL_PREFILL_TTFT_MS: dict[int, float] = {128: 17.1, 512: 19.8, 1024: 32.1, 2048: 57.0, 4096: 109.7}
REAL_DECODE_ITL_MS: dict[int, float] = {1: 4.81, 8: 4.91, 32: 5.34, 64: 6.38, 128: 6.91}
REAL_NIXL_XFER_MS: dict[int, float] = {128: 48.7, 512: 225.4, 1024: 429.6, 2048: 856.6, 4096: 1427.0}
REAL_PD_TTFT_MS: dict[int, float] = {128: 83.7, 512: 267.5, 1024: 488.3, 2048: 937.3, 4096: 1560.0}
# Two GPUs of one host (P on one H200, D on another), NIXL, one request at a time (real-vllm-h200.md)
REAL_NIXL_XFER_2GPU_MS: dict[int, float] = {128: 6.3, 512: 10.1, 1024: 14.2, 2048: 27.9, 4096: 59.4}
# The recorded 2-GPU mixed load (tests/fixtures/vllm023, bench-2gpu-pd): 16 closed-loop streams of 453-token
# prompts x 256 tokens and one 4520-token prompt x 16 every 2 s. Per-request max gap, median, of the streams
# whose decode window held a long prompt's KV arrival, and of the others (ms).
REAL_KV_ARRIVAL_STALL_MS = {"with_large_kv_arrival": 61.9, "others": 20.9}

# Part of a lone request's TTFT that is not GPU time: HTTP, tokenisation, scheduling,
# detokenisation. Applied once per request before it reaches the engine queue.
H200_FRONTEND_MS = 8.0
# The simulator's own loopback HTTP cost (request + first chunk, aiohttp on both ends), measured
# on the 2-core development machine: 1.3 ms idle, up to ~4 ms under other jobs' load; it stands
# in for part of the real HTTP cost above, so the preset subtracts a middle value.
SIM_LOOPBACK_MS = 2.0
# Decode-side cost of taking over a remote prefill, beyond the transfer itself: notification
# and scheduling of the loaded request. Chosen so that P/D TTFT = prefill + transfer + ~20 ms
# (decode front end 8 + this 4 + first step 4.8 + ~2 loopback + ~2 for the simulated read's
# HTTP round trip), inside the measured 18-27 ms hand-off, which also held the toy proxy's time.
H200_KV_PULL_OVERHEAD_MS = 4.0
# vLLM's API server under load (tests/fixtures/vllm023, `llm_request` spans: time to first token less the
# engine's queue and prefill, i.e. arrival -> engine queue plus the first output's way back): 2.0-2.4 ms for
# the lone calibration requests of 128-512 tokens, 11.4 ms (median)
# beside the 1-GPU single's 4 streams and 23.1 ms beside the 2-GPU single's 16; plus the proxy-side HTTP
# hops around it, 2.8 ms at 4 streams and 6.2 at 16. About 1 ms more per stream served. Of a lone request's
# 2 ms about half is its intake (parsing; tokenising grows it by 0.4 ms per 1k prompt tokens), done one request
# at a time; the rest is the first output's way back, which does not hold the next request's intake.
H200_FRONTEND_REQUEST_MS = 1.0
H200_FRONTEND_STREAM_MS = 1.0


def _prefill_points() -> Points:
    """Extra step time of n prefill tokens = measured TTFT(n) - frontend - one decode step - loopback.

    (0, 0) anchors the curve so that a one-token "prefill" (a decode that recomputes the last
    prompt token after a KV load) costs almost nothing.
    """
    base = H200_FRONTEND_MS + REAL_DECODE_ITL_MS[1] + SIM_LOOPBACK_MS
    return ((0, 0.0),) + tuple((n, round(ms - base, 3)) for n, ms in REAL_PREFILL_TTFT_MS.items())


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    decode_step_ms: Points  # (sequences in the step, ms of the step when all of them decode)
    prefill_extra_ms: Points  # (prefill tokens in the step, ms added to the step)
    frontend_overhead_ms: float
    kv_pull_overhead_ms: float
    kv_bytes_per_token: int
    kv_bandwidth_gbps: float  # GB/s (1e9 bytes) of the prefill instance's outgoing KV link; 0 = infinite
    kv_latency_ms: float  # per transfer, not serialised on the link
    max_model_len: int
    block_size: int
    num_gpu_blocks: int  # 0 = unbounded
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool = True
    # vLLM's async scheduling (its default: vllm/config/vllm.py resolves `async_scheduling=None` to True unless
    # a pooling model, a drafter it cannot overlap or an executor without it): the engine core schedules step
    # k+1 while step k runs (vllm/v1/engine/core.py `step_with_batch_queue`, a batch queue of two), so a prompt
    # that arrives while a step runs misses the step already scheduled and joins the one after: one step more
    # to its first token beside running streams, none on an idle engine. Seen in the recorded vLLM 0.23 singles
    # (tests/fixtures/vllm023, `llm_request` spans): a cached prompt's scheduled-to-first-token is 9.1-9.8 ms
    # at p10 beside running streams (two decode steps of 4.9-5.2 ms). Off in the presets: with it, the fitted
    # self-replays of the singles move TTFT p50 -28 -> -6 % (vllm023 2-GPU) but -2 -> +30 % (1-GPU) and
    # +26 -> +31 % (run A), docs/notes/whatif-issue40.md "Async scheduling".
    async_scheduling: bool = False
    # decode: while a remote KV pull is in flight no engine step starts for the transfer's own link time
    # (latency + bytes / bandwidth, queueing on the link not counted), so the decode's other streams
    # stall for the transfer. Seen in the recorded vLLM 0.23 traces on two H200s (tests/fixtures/vllm023):
    # streams whose decode window holds a 4.5k-token KV arrival have a max gap of 62 ms (about that
    # transfer plus one step) against 21 ms for the others, the gap inside that request's KV wait; not
    # on one GPU (1.5 s same-GPU transfers left the streams alone). On in the 2-GPU preset, whose link is
    # fitted so that the whole pull reproduces the 62 ms (benchmarks/sim_calibration.py checks it).
    kv_pull_stalls_decode: bool = False
    # decode: a remote prompt whose first blocks the decode's prefix cache already holds reads only the rest (vLLM
    # 0.23's NIXL connector: `get_num_new_matched_tokens` counts the local hit as computed and the worker's
    # `_apply_prefix_caching` trims the remote blocks to the uncomputed ones). Seen in the recorded 3P1D on one H200
    # (tests/fixtures/real-ratios-2026-12-01): the one decode, which has seen every shared system prompt, took an
    # agent's 2,085-token KV in 0.46-0.5 s where the lone link moves 2,048 tokens in 0.86 s.
    kv_pull_cached: bool = True
    # instances on one GPU: the KV rate (GB/s) all the reads on the GPU share while several decodes read (one decode
    # reads from each prefill at kv_bandwidth_gbps, side by side; pdproxy/sim/kv.py `SharedKVPath`, the what-if's
    # cluster of instances sharing a GPU). 0: no such limit.
    kv_together_gbps: float = 0.0
    # instances on one GPU: one decode's reads from one prefill, GB/s, in a running cluster (0: the prefill's link,
    # kv_bandwidth_gbps, which lone transfers measure); the what-if's `SharedKVPath` only
    kv_pair_gbps: float = 0.0
    # decode: its intake of a remote KV while several prefills feed it at once (GB/s; 0 = no such intake).
    # A KV that lands while a pull from another prefill is still in the decode's hands (in flight or being
    # taken in) is taken in one at a time, at this rate, before its request may step; with
    # kv_pull_stalls_decode no step starts meanwhile. Seen in the recorded 2P2D runs on one H200
    # (tests/fixtures/xpyd, run B): decode-0, fed by one prefill for its first 18 s, took every request into
    # its engine queue within 30 ms (five pulls in flight); from the moment a second prefill fed it, requests
    # waited up to 16 s before its engine queue (`decode_intake` in `pdproxy report`'s split), and run A's
    # decodes, fed by both prefills from the start, 3-13 s. One prefill feeding a decode (vllm023 1P1D,
    # 217 requests) never shows it. Sized by `pdproxy whatif --fit-run` on a recording with several prefills.
    kv_intake_gbps: float = 0.0
    # decode: its intake takes KV in by batches, as vLLM 0.23's decode engine did in the recorded 2P2D on one H200
    # (run A, tests/fixtures/real-xpyd-2026-12-01b): its engine core added no new request for 8-13 s at a time, then
    # released five to nine KV loads in one step. A KV arriving while a batch is copied joins the next batch; a batch
    # is released when its last KV is in. Off in every preset: it fits run A's completed requests (+70 % -> +20 %)
    # but not run B's TTFT (docs/notes/whatif-issue40.md, "The decode's intake").
    kv_intake_bursts: bool = False
    # several instances time-sharing one GPU's compute: each other instance stepping at the same time
    # stretches a step by this fraction (0: a GPU per instance; 1: full time-slicing). The simulator applies
    # it between `pdproxy sim` processes that share a --gpu-share-file; the what-if to every instance of a
    # set-up (all on the recorded GPUs). Fitted to a recording by `pdproxy whatif --fit-run`.
    gpu_share: float = 0.0
    # the what-if puts every instance of a set-up on one GPU (the recorded one): their steps share it (gpu_share) and
    # their KV reads go through one path (kv_bandwidth_gbps per prefill-decode pair, kv_together_gbps). The simulator
    # shares a GPU only between processes given one --gpu-share-file.
    shared_gpu: bool = False
    # a prefill's KV copies to a decode on the same GPU take their share of its compute (they stretch, and are
    # stretched by, the steps beside them, as one more busy instance), or run beside the steps untouched (a copy
    # engine of its own). Which one a recording shows is fitted by `pdproxy whatif --fit-run` where the first
    # does not reproduce it: vllm023's 1-GPU 1P1D (tests/fixtures/vllm023) fits the second, run A and run B's
    # 2P2D on one H200 the first (docs/notes/whatif-issue40.md, "The link's copies and the compute").
    kv_link_shares_gpu: bool = True
    # vLLM's API server under load (pdproxy/sim/timing.py `FrontEnd`): each request's intake work, one at a
    # time (requests arriving together queue for it), and the extra intake time per stream the server is
    # serving meanwhile; a lone request still takes frontend_overhead_ms. `pdproxy whatif --fit-run` fits
    # frontend_stream_ms to a single-instance recording's TTFT.
    frontend_request_ms: float = 0.0
    frontend_stream_ms: float = 0.0
    # the same event loop finishing each stream that ends, one at a time (FIFO with the intake work): streams ending
    # in one engine step reach their clients this far apart, and so do their clients' next prompts. vLLM 0.23's
    # last tokens of one step: 1.31 / 0.96 ms apart (median; 1-GPU / 2-GPU single, tests/fixtures/vllm023), where
    # the other tokens of a step arrive 0.05 ms apart. Off in every preset: at 1.0-1.3 ms the fitted singles do
    # not fit better, with or without async scheduling (docs/notes/whatif-issue40.md, "Async scheduling").
    frontend_finish_ms: float = 0.0
    # each intake up to this much longer, uniformly at random (vLLM 0.23's lone requests' API-server time, arrival to
    # the engine's queue, spans 9.9-10.7 ms at p10-p90 beside four streams, tests/fixtures/vllm023). Off in every
    # preset; `pdproxy whatif` replays the recorded set-up with 1 ms of it, seed by seed, for the model's own spread.
    frontend_jitter_ms: float = 0.0
    instant: bool = False  # no engine loop at all: every answer is produced immediately
    notes: tuple[str, ...] = field(default=())


H200_LLAMA8B = Preset(
    name="h200-llama8b",
    description="vLLM 0.23, Llama-3.1-8B shape, bf16, one H200; NIXL between two instances on one GPU",
    decode_step_ms=tuple(REAL_DECODE_ITL_MS.items()),
    prefill_extra_ms=_prefill_points(),
    frontend_overhead_ms=H200_FRONTEND_MS,
    frontend_request_ms=H200_FRONTEND_REQUEST_MS,
    frontend_stream_ms=H200_FRONTEND_STREAM_MS,
    kv_pull_overhead_ms=H200_KV_PULL_OVERHEAD_MS,
    # 32 layers x (K, V) x 8 KV heads x 128 dims x 2 bytes = 131072 B/token (16.8 MB per 128 tokens).
    kv_bytes_per_token=32 * 2 * 8 * 128 * 2,
    # Least-max-relative-error fit of latency + bytes/bandwidth to REAL_NIXL_XFER_MS:
    # 0.341 GB/s and 4.75 ms -> within +/-10.7 % at every measured point.
    kv_bandwidth_gbps=0.341,
    kv_latency_ms=4.75,
    # no decode intake: one decode fed by three prefills on one H200 took their KV fastest of all the splits
    # (tests/fixtures/real-ratios-2026-12-01, 3P1D); several decodes reading at once are what slows it: 0.15 GB/s in
    # all, `pdproxy whatif --fit-run` on that cluster's four recordings (run A's 2P2D and singles, 1P3D, 3P1D;
    # docs/explanation/whatif.md "Validation"), the link staying the lone measurement above
    kv_intake_gbps=0.0,
    kv_together_gbps=0.15,
    # one decode reading from one prefill while the cluster runs: 0.236 and 0.245 GB/s fitted on the two one-H200
    # clusters (run A's with the ratio runs; vllm023's 1P1D), each the other's out-of-sample figure, against the
    # 0.341 GB/s of a lone transfer (kv_bandwidth_gbps, what `pdproxy sim` moves)
    kv_pair_gbps=0.24,
    # instances on one GPU time-share it fully (two busy instances each at half speed): a prior, not a fit (the same
    # cluster's singles fit 0.95); `--fit-run` fits it on a recording of several single instances
    gpu_share=1.0,
    shared_gpu=True,
    max_model_len=4608,
    block_size=16,
    # 0.9 x 141 GB - 16 GB weights - ~4 GB activations ~ 106 GB; 2 MiB per 16-token block.
    num_gpu_blocks=50_000,
    max_num_batched_tokens=16384,  # the measured "single, max-num-batched-tokens 16384" set-up
    max_num_seqs=1024,
    notes=(
        "decode step: measured per-token ITL at 1/8/32/64/128 concurrent streams",
        "prefill: measured lone-request TTFT at 128..4096 tokens minus frontend, one decode step, loopback",
    ),
)

H200_LLAMA8B_2GPU = replace(
    H200_LLAMA8B,
    name="h200-llama8b-2gpu",
    description="as h200-llama8b, but prefill and decode on two GPUs of one host (NIXL ~11 GB/s); the decode "
                "stalls its streams while a KV pull is in flight, as recorded",
    # Least-max-relative-error fit of latency + bytes/bandwidth to REAL_NIXL_XFER_2GPU_MS: 11.2 GB/s and
    # 4.0 ms -> within 13 % at every measured point (4096 tokens: 51.9 ms vs 59.4; 2048: 28.0 vs 27.9).
    # A 4520-token KV then takes 57 ms and the stall it causes (the pull plus one decode step) ~62 ms,
    # the recorded effect. (Earlier 2.4 GB/s came from the mixed-load mean, queueing included.)
    kv_bandwidth_gbps=11.2,
    kv_latency_ms=4.0,
    kv_pull_stalls_decode=True,
    # a GPU per instance: none time-shared, the KV reads on their own links
    shared_gpu=False,
    gpu_share=0.0,
    kv_together_gbps=0.0,
    kv_pair_gbps=0.0,
    # no decode intake: it was fitted on one shared H200's 2P2D runs, and no recording has several prefills
    # feeding one decode across GPUs (inherited, it took 25 GB/s links' KV in at 0.13 GB/s)
    kv_intake_gbps=0.0,
)

INSTANT = Preset(
    name="instant",
    description="no delays and no capacity limits: answers as fast as the process can write",
    decode_step_ms=((1, 0.0), (2, 0.0)),
    prefill_extra_ms=((0, 0.0), (1, 0.0)),
    frontend_overhead_ms=0.0,
    kv_pull_overhead_ms=0.0,
    kv_bytes_per_token=H200_LLAMA8B.kv_bytes_per_token,
    kv_bandwidth_gbps=0.0,
    kv_latency_ms=0.0,
    max_model_len=32768,
    block_size=16,
    num_gpu_blocks=0,
    max_num_batched_tokens=16384,
    max_num_seqs=1024,
    instant=True,
)

PRESETS: dict[str, Preset] = {p.name: p for p in (H200_LLAMA8B, H200_LLAMA8B_2GPU, INSTANT)}
DEFAULT_PRESET = H200_LLAMA8B.name
