"""The simulator's `/metrics`: vLLM's metric names, definitions, buckets and labels.

Names and buckets follow vLLM v0.33 (research/vllm-proxy.md §5.2 and §8) so that dashboards
and the proxy's tests can treat a simulated instance like a real one. Labels are
`model_name` and `engine` (vLLM's engine index, "0" for a single engine core).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
NIXL_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_BYTES_BUCKETS = tuple(float(2 ** e) for e in range(11, 34, 2))  # 2 KiB .. 8 GiB, 12 buckets

FINISH_REASONS = ("stop", "length", "abort", "error")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vLLM 0.23's `source` label


class SimMetrics:
    """One registry per simulated instance; children are bound once so observing is cheap."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str, engine: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name", "engine")
        values = (model, engine)
        reg = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS).labels(*values)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS).labels(*values)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS).labels(*values)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS).labels(*values)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS).labels(*values)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.",
                              REQUEST_LATENCY_BUCKETS).labels(*values)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.",
                            REQUEST_LATENCY_BUCKETS).labels(*values)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.",
                           REQUEST_LATENCY_BUCKETS).labels(*values)

        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             labels, registry=reg).labels(*values)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             labels, registry=reg).labels(*values)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              labels, registry=reg).labels(*values)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=reg).labels(*values)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=reg).labels(*values)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.", labels, registry=reg).labels(*values)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens.", labels, registry=reg).labels(*values)
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            (*labels, "source"), registry=reg)
        self.prompt_by_source = {source: by_source.labels(*values, source) for source in PROMPT_SOURCES}
        self.prompt_cached = Counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + "
                                     "external).", labels, registry=reg).labels(*values)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   labels, registry=reg).labels(*values)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*labels, "finished_reason"), registry=reg)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}

        self.nixl_xfer_time = hist("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV"
                                   " Cache transfers.", NIXL_XFER_BUCKETS).labels(*values)
        self.nixl_bytes = hist("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV"
                               " Cache transfers.", NIXL_BYTES_BUCKETS).labels(*values)
        self.nixl_failed = Counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache"
                                   " transfers.", labels, registry=reg).labels(*values)
        self.nixl_expired = Counter("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV"
                                    " expire.", labels, registry=reg).labels(*values)

    def prompt_computed(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)
        self.prompt_by_source["local_compute"].inc(tokens)

    def prompt_queried(self, tokens: int, hit: int) -> None:
        """A request's lookup in the local prefix cache: `hit` of its `tokens` were cached."""
        self.prefix_queries.inc(tokens)
        self.prefix_hits.inc(hit)
        if hit:
            self.prompt_tokens.inc(hit)  # vLLM counts cached prompt tokens as processed too
            self.prompt_by_source["local_cache_hit"].inc(hit)
            self.prompt_cached.inc(hit)

    def prompt_transferred(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)
        self.prompt_by_source["external_kv_transfer"].inc(tokens)
        self.prompt_cached.inc(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
