"""Settings for `pdproxy serve`: vLLM's toy-proxy flags unchanged, plus pdproxy's own.

Every setting can come from (highest first) a command-line flag, an environment variable
`PDPROXY_<FLAG>` named after the flag (e.g. `PDPROXY_READ_TIMEOUT=30`, `PDPROXY_NO_TRACING=1`,
lists comma-separated), a YAML config file (`--config FILE`, keys are the flag names with `_` or
`-`), or the built-in default.

Instances are given either with the toy proxy's paired flags (`--prefiller-hosts a b
--prefiller-ports 8100 8101`), with the demo/router URL forms (`--prefill URL [BOOTSTRAP_PORT]`,
repeatable; `host:port` also accepted), or both. With no instance flag at all, the toy proxy's
defaults apply (prefill localhost:8100, decode localhost:8200). With decode instances but no
prefill instance, pdproxy forwards straight to them: the single-instance baseline.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import yaml

ENV_HELP = ("Every flag can also be set as an environment variable PDPROXY_<FLAG> named after it "
            "(--read-timeout 30 is PDPROXY_READ_TIMEOUT=30, --no-tracing is PDPROXY_NO_TRACING=1, lists "
            "comma-separated) or as a key of the --config YAML file (read-timeout: 30). A flag wins over the "
            "environment, which wins over the file.")
TOY_DEFAULTS = {"prefiller_hosts": ["localhost"], "prefiller_ports": [8100], "decoder_hosts": ["localhost"], "decoder_ports": [8200]}
# routing policies, one module each in pdproxy/policies/ (a test keeps the two lists equal)
POLICIES = ("round_robin", "random", "least_inflight", "power_of_two", "consistent_hash", "cache_aware", "load_aware",
            "precise_prefix")
DEFAULT_HASH_KEY = "header:X-Session-Id,body:user"
# flags named other than their setting: the flag's name works in the environment and the file too
FLAG_NAMES = {"resource_attrs": "resource_attr", "shadow_prefill_urls": "shadow_prefill",
              "kv_events_instances": "kv_events_instance", "kv_events_replay_instances": "kv_events_replay_instance",
              "pd_disaggregation": "vllm_pd_disaggregation"}
NEGATED_FLAGS = {"tracing": "no_tracing", "stall_attribution": "no_stall_attribution",  # PDPROXY_NO_TRACING=1 is tracing off
                 "admin_api": "no_admin_api"}
# settings that name a membership source finding instances at run time (pdproxy/membership): with one set,
# the pools may start empty, and the toy proxy's default instances do not apply
DISCOVERY_SETTINGS = ("instances_file", "service_discovery", "dns_prefill", "dns_decode")


class _Ignored(argparse.Action):
    """A vllm-router flag that has no effect here: recorded, so start-up can say so."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        seen = list(getattr(namespace, self.dest, None) or [])
        seen.append(option_string or self.dest)
        setattr(namespace, self.dest, seen)


class ConfigError(ValueError):
    """A setting that cannot work; reported at start-up as one clear line."""


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    model: str | None = None
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 18
    hash_key: str = DEFAULT_HASH_KEY
    hash_load_factor: float = 1.25
    load_metrics_interval: float = 2.0
    connect_timeout: float = 10.0
    read_timeout: float = 600.0
    upstream_keep_alive: float = 4.0
    prefill_retries: int = 1
    decode_retries: int = 1
    first_token_timeout: float = 300.0  # docs/reference/protocol.md: far above a real long prefill, below --read-timeout
    decode_deadline: float = 60.0
    migrate_mid_stream: bool = False
    retry_backoff: float = 0.05
    max_retry_wait: float = 2.0
    health_check_interval: float = 5.0
    health_check_timeout: float = 2.0
    health_check_path: str = "/health"
    eject_after_failures: int = 3
    eject_seconds: float = 10.0
    max_ejection_percent: float = 50.0
    max_inflight: int = 0
    max_queue: int = 1024
    queue_timeout: float = 30.0
    max_body_bytes: int = 8 * 1024 * 1024  # worst JSON shape: ~27 MB RSS per body MB (benchmarks/body_memory.py)
    body_timeout: float = 30.0
    write_timeout: float = 60.0
    keep_alive_timeout: float = 75.0
    client_kv_params: str = "reject"
    api_key: str | None = None
    upstream_api_key: str | None = None
    debug_endpoints: bool = False
    stall_threshold: float = 0.1
    stall_attribution: bool = True
    tracing: bool = True
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    trace_file: str | None = None
    trace_file_max_bytes: int = 256 * 1024 * 1024
    trace_file_backups: int = 3
    trace_rejected_rate: float = 10.0
    span_queue_size: int = 8192
    run_label: str = ""
    served_model_name: list[str] = field(default_factory=list)
    resource_attrs: dict[str, str] = field(default_factory=dict)
    gpu_count: int = 0  # GPUs of the set-up (resource attribute gpu.count, as bench's --gpu-count); 0: not said
    capture_content: bool = False
    shadow_url: str | None = None
    shadow_prefill_urls: list[str] = field(default_factory=list)
    shadow_sample_rate: float = 1.0
    shadow_max_inflight: int = 32
    shadow_timeout: float = 120.0
    workers: int = 1
    log_level: str = "info"
    # vLLM's KV-cache events (pdproxy/kvevents): endpoint templates on each instance's host, per-instance overrides
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_instances: dict[str, str] = field(default_factory=dict)
    kv_events_replay_instances: dict[str, str] = field(default_factory=dict)
    kv_events_ports: list[int] = field(default_factory=list)  # one per instance, prefills then decodes
    kv_events_replay_ports: list[int] = field(default_factory=list)
    kv_events_max_blocks: int = 1 << 18
    tokenizer_file: str | None = None  # precise_prefix: the served model's tokenizer.json for text prompts
    pd_min_prefill_tokens: int = 0  # selective disaggregation: at most this many to compute -> decode only; 0 off
    # DNS membership (pdproxy/membership/dns.py): names whose records are the instances of a role
    dns_prefill: list[str] = field(default_factory=list)
    dns_decode: list[str] = field(default_factory=list)
    dns_port: str = "http"  # a number: A/AAAA records on that port; a name: SRV _NAME._tcp.<dns name>
    dns_interval: float = 5.0
    dns_server: list[str] = field(default_factory=list)  # HOST[:PORT]; none: /etc/resolv.conf's
    dns_kv_events_port: str | None = None  # SRV port name giving each instance's KV-event PUB port
    # Kubernetes service discovery (vllm-router's flags; pdproxy/membership/kubernetes.py)
    service_discovery: bool = False
    selector: dict[str, str] = field(default_factory=dict)  # single mode's pods
    prefill_selector: dict[str, str] = field(default_factory=dict)
    decode_selector: dict[str, str] = field(default_factory=dict)
    service_discovery_namespace: str | None = None  # None: every namespace (vllm-router's default)
    service_discovery_port: int | None = None  # None: the pod's container port named http, else 80
    service_discovery_resync: float = 60.0
    # membership at run time (pdproxy/membership; docs/reference/membership.md)
    bootstrap_ports: dict[str, int] = field(default_factory=dict)  # prefill URL -> its bootstrap port, as given
    ignored_flags: list[str] = field(default_factory=list)  # vllm-router's, accepted with no effect
    pd_disaggregation: bool = False  # P/D even with no prefill instance given (they are discovered or added)
    instances_file: str | None = None
    instances_file_interval: float = 1.0
    admin_api: bool = True
    admin_api_key: str | None = None
    drain_timeout: float = 30.0
    instance_series_retention: float = 300.0

    @property
    def mode(self) -> str:
        return "pd" if self.prefill_urls or self.pd_disaggregation or self.prefill_selector or self.dns_prefill \
            else "single"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags. Defaults are suppressed so that env vars and the config file can fill gaps."""
    parser.argument_default = argparse.SUPPRESS
    parser.epilog = ENV_HELP
    parser.add_argument("--config", help="YAML file with any of these settings (flag names as keys)")

    toy = parser.add_argument_group("vLLM toy-proxy flags (same names and pairing)")
    toy.add_argument("--host", help="address to bind (default 127.0.0.1)")
    toy.add_argument("--port", type=int, help="port to bind (default 8000)")
    toy.add_argument("--prefiller-hosts", "--prefiller-host", nargs="+", help="prefill hosts, paired with --prefiller-ports")
    toy.add_argument("--prefiller-ports", "--prefiller-port", nargs="+", type=int, help="prefill ports (default 8100)")
    toy.add_argument("--decoder-hosts", "--decoder-host", nargs="+", help="decode hosts, paired with --decoder-ports")
    toy.add_argument("--decoder-ports", "--decoder-port", nargs="+", type=int, help="decode ports (default 8200)")

    urls = parser.add_argument_group("instances as URLs (vllm-router / demo proxy forms)")
    urls.add_argument("--prefill", "-p", nargs="+", action="append", metavar="URL",
                      help="prefill instance URL or host:port (repeatable: one flag per instance); vllm-router's "
                           "bootstrap port (or 'none') may follow the URL: accepted and ignored (NIXL needs none)")
    urls.add_argument("--decode", "-d", nargs="+", action="append", metavar="URL",
                      help="decode instance URL (repeatable); with no prefill instance this is the single-instance baseline")
    urls.add_argument("--model", "-m",
                      help="the model the toy proxy was started with: /v1/models names it when no instance answers, "
                           "and it labels metrics (for more names, or aliases, see --served-model-name)")

    route = parser.add_argument_group("routing (which instance gets a request)")
    route.add_argument("--policy", choices=POLICIES, help="routing policy for both pools (default round_robin)")
    route.add_argument("--prefill-policy", choices=POLICIES, help="routing policy for prefill instances")
    route.add_argument("--decode-policy", choices=POLICIES, help="routing policy for decode instances")
    route.add_argument("--cache-threshold", type=float,
                       help="cache_aware: a request goes to the instance that already holds the longest part of its "
                            "prompt when that part is at least this fraction of the prompt (0.3: 30%%); otherwise "
                            "to the instance whose prefix index is smallest (default 0.3)")
    route.add_argument("--balance-abs-threshold", type=int,
                       help="cache_aware: load is imbalanced when max - min in-flight exceeds this (and the "
                            "relative threshold): then the least loaded instance goes (default 64)")
    route.add_argument("--balance-rel-threshold", type=float,
                       help="cache_aware: ... and when max in-flight exceeds this times the min (default 1.5)")
    route.add_argument("--max-tree-size", type=int,
                       help="cache_aware: entries of each pool's prefix index (least recently used evicted; "
                            "per worker process) (default 262144)")
    route.add_argument("--hash-key",
                       help="consistent_hash: where the session key comes from, first present wins: "
                            f"header:NAME and body:FIELD, comma-separated (default {DEFAULT_HASH_KEY})")
    route.add_argument("--hash-load-factor", type=float,
                       help="consistent_hash: no instance gets a keyed request while it has more than this times "
                            "the mean in flight; it goes on along the ring (bounded loads); 0 = no bound (default 1.25)")
    route.add_argument("--load-metrics-interval", type=float,
                       help="load_aware: seconds between reads of each instance's /metrics (default 2)")
    conn = parser.add_argument_group("connections and timeouts to the instances")
    conn.add_argument("--connect-timeout", type=float, help="seconds to open a connection to an instance (default 10)")
    conn.add_argument("--read-timeout", "--request-timeout-secs", type=float,
                      help="seconds an instance may stay silent mid-response (default 600)")
    conn.add_argument("--upstream-keep-alive", type=float,
                       help="seconds an idle connection to an instance is kept for reuse; keep it below the instances' "
                            "own idle timeout (vLLM's uvicorn: 5); 0: a new connection per request (default 4)")
    retry = parser.add_argument_group("retries and migration (what the client does not see)")
    retry.add_argument("--prefill-retries", type=int, help="extra prefill attempts on another instance after 5xx/connect errors (default 1)")
    retry.add_argument("--decode-retries", type=int,
                       help="extra decode attempts on another instance per request: before its first token (the client "
                            "sees nothing of them) and, with --migrate-mid-stream, after (default 1)")
    retry.add_argument("--first-token-timeout", type=float,
                       help="seconds a streamed decode may take to its first token before the request moves to another "
                            "decode instance, also when it keeps sending events without a token; 0 = no limit (default 300: "
                            "far above the prefill of a long prompt, see docs/reference/protocol.md)")
    retry.add_argument("--decode-deadline", type=float,
                       help="seconds after the first decode attempt within which another may start; 0 = no limit "
                            "(default 60)")
    retry.add_argument("--migrate-mid-stream", action="store_true",
                       help="continue a stream whose decode dies after tokens reached the client on another decode "
                            "(greedy requests only: temperature 0, no logprobs, n=1, no stop strings; see docs/reference/protocol.md)")
    retry.add_argument("--retry-backoff", type=float, help="base of the jittered exponential backoff between attempts, seconds (default 0.05)")
    retry.add_argument("--max-retry-wait", type=float,
                       help="longest Retry-After (from a 429/503) the proxy waits out to retry; a longer one is relayed "
                            "to the client (default 2)")
    health = parser.add_argument_group("health checks and ejection")
    health.add_argument("--health-check-interval", "--health-check-interval-secs", type=float,
                        help="seconds between active health checks; 0 disables (default 5)")
    health.add_argument("--health-check-timeout", "--health-check-timeout-secs", type=float,
                        help="seconds a health check may take (default 2)")
    health.add_argument("--health-check-path", "--health-check-endpoint",
                        help="instance path probed by health checks (default /health)")
    health.add_argument("--eject-after-failures", type=int,
                       help="consecutive failures an instance is to blame for (connect errors and timeouts, dropped "
                            "connections, 5xx; not read timeouts) that eject it; 0 disables (default 3)")
    health.add_argument("--eject-seconds", type=float,
                       help="how long an ejected instance stays out, times its ejections in a row (max 6x) (default 10)")
    health.add_argument("--max-ejection-percent", type=float,
                       help="largest share of a pool's instances that failures may eject at once; at least one always "
                            "stays in rotation (default 50, as Envoy's max_ejection_percent)")
    limits = parser.add_argument_group("admission and client limits")
    limits.add_argument("--max-inflight", "--max-concurrent-requests", type=int, help="requests served at once (completions, chat, /tokenize and /detokenize); 0 = unlimited (default 0)")
    limits.add_argument("--max-queue", type=int,
                        help="requests waiting for a slot beyond --max-inflight before 503; only with --max-inflight "
                             "set (without it nothing waits) (default 1024)")
    limits.add_argument("--queue-timeout", type=float, help="seconds a request may wait for a slot before 503 (default 30)")
    limits.add_argument("--max-body-bytes", "--max-payload-size", type=int, help="largest request body accepted; larger gets 413 (default 8 MiB: '[{},{},...]' costs 27x its size in memory)")
    limits.add_argument("--body-timeout", type=float, help="seconds a client may take to send its request body; then 408 (default 30)")
    limits.add_argument("--write-timeout", type=float,
                       help="seconds a client may leave streamed data unread before it is cut off and its decode "
                            "aborted (default 60)")
    limits.add_argument("--keep-alive-timeout", type=float,
                       help="seconds a client connection may stay idle, or take to send its request line and headers, "
                            "before it is closed (default 75)")
    limits.add_argument("--client-kv-params", choices=("reject", "strip"),
                       help="a client's own kv_transfer_params: 'reject' with 400 or 'strip' silently; never forwarded "
                            "(default reject)")
    procs = parser.add_argument_group("server processes")
    procs.add_argument("--workers", type=workers_count,
                       help="server processes sharing the port; 'auto': one per CPU this process may run on (default 1: "
                            "admission limits, ejections and /status are per worker)")

    sec = parser.add_argument_group("authentication")
    sec.add_argument("--api-key", help="require 'Authorization: Bearer KEY' from clients")
    sec.add_argument("--upstream-api-key",
                     help="key sent to instances as 'Authorization: Bearer KEY' (env OPENAI_API_KEY, as vLLM's proxies). "
                          "Without it the client's Authorization header is forwarded, unless --api-key is set")
    sec.add_argument("--debug-endpoints", action="store_true",
                     help="serve GET /debug/runtime (tasks, open files, connections, memory); behind --api-key when set")

    tel = parser.add_argument_group("telemetry")
    tel.add_argument("--no-tracing", dest="tracing", action="store_false", help="do not create spans (metrics stay on)")
    tel.add_argument("--otlp-endpoint", "--otlp-traces-endpoint", help="OTLP collector endpoint (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)")
    tel.add_argument("--otlp-protocol", choices=("grpc", "http/protobuf"), help="OTLP protocol (default: OTEL_EXPORTER_OTLP_PROTOCOL or grpc)")
    tel.add_argument("--trace-file", help="also write spans as OTLP-JSON lines (the Collector file-exporter format) to this file")
    tel.add_argument("--trace-file-max-bytes", type=int,
                     help="size bound of --trace-file: a write that would pass it first rotates the file to FILE.1 "
                          "(FILE.1 to FILE.2, ...); 0 = unbounded, else at least 1 MiB (default 256 MiB)")
    tel.add_argument("--trace-file-backups", type=int,
                     help="rotated trace files kept (FILE.1 ... FILE.N), the oldest deleted; 0 keeps none "
                          "(default 3)")
    tel.add_argument("--trace-rejected-rate", type=float,
                     help="requests refused before admission (401, 400, 413, 415, 429, 503...) traced per second at "
                          "most; the rest are counted in /metrics but not traced; 0 traces none (default 10)")
    tel.add_argument("--span-queue-size", type=int, help="spans buffered for export before new ones are dropped and counted (default 8192)")
    tel.add_argument("--stall-threshold", type=float, help="a token gap above this many seconds counts as a stall (default 0.1)")
    tel.add_argument("--no-stall-attribution", dest="stall_attribution", action="store_false",
                     help="do not attribute stalls live (pd.stall causes, culprit links, pdproxy_stall_seconds by cause)")
    tel.add_argument("--served-model-name", nargs="+", metavar="NAME",
                     help="model names (one or more) that label metrics and name spans and that requests may ask "
                          "for, besides those the instances list in /v1/models (--model: one name, also shown by "
                          "/v1/models); any other requested name is labelled 'other' (bounds the series a client "
                          "can create)")
    tel.add_argument("--run-label", help="label of this run: resource attribute pd.run and metric label run")
    tel.add_argument("--gpu-count", type=int, metavar="N",
                     help="GPUs this set-up runs on, all its instances together: resource attribute gpu.count on every "
                          "span, as bench's --gpu-count records it (the report compares set-ups of equal GPU totals)")
    tel.add_argument("--resource-attr", dest="resource_attrs", action="append", metavar="KEY=VALUE",
                     help="fixed condition recorded on every span, e.g. vllm.version=0.23.0 gpu.kind=H200 (repeatable)")
    tel.add_argument("--capture-content", action="store_true", help="record prompt and completion text in spans (off: never recorded)")
    tel.add_argument("--log-level", choices=("debug", "info", "warning", "warn", "error", "critical"),
                     help="log level (default info; 'warn' and 'critical' as vllm-router's CLIs spell them)")

    _discovery_arguments(parser)

    kv = parser.add_argument_group("KV-cache events (vLLM --kv-events-config; docs/explanation/kv-events.md)")
    kv.add_argument("--kv-events-endpoint", metavar="TEMPLATE",
                    help="each instance's KV-event PUB endpoint, {host} and {port} being the instance's and {index} "
                         "its place among all instances (prefills first, as given, from 0), e.g. tcp://{host}:5557 "
                         "(off when neither this nor --kv-events-ports is given)")
    kv.add_argument("--kv-events-ports", nargs="+", type=int, metavar="PORT",
                    help="one PUB port per instance on the instance's host, in instance order (prefills first, as "
                         "given), e.g. --kv-events-ports 5557 5558 5559 5560 for 2P2D on one host")
    kv.add_argument("--kv-events-replay-ports", nargs="+", type=int, metavar="PORT",
                    help="one replay (ROUTER) port per instance, in the same order")
    kv.add_argument("--kv-events-replay-endpoint", metavar="TEMPLATE",
                    help="each instance's replay (ROUTER) endpoint, e.g. tcp://{host}:5567: repairs gaps, catches up")
    kv.add_argument("--kv-events-topic", help="topic prefix to subscribe to (default: every topic)")
    kv.add_argument("--kv-events-instance", dest="kv_events_instances", action="append", metavar="HOST:PORT=ENDPOINT",
                    help="this instance's PUB endpoint instead of the template's or the port list's (repeatable)")
    kv.add_argument("--kv-events-replay-instance", dest="kv_events_replay_instances", action="append",
                    metavar="HOST:PORT=ENDPOINT",
                    help="this instance's replay endpoint instead of the template's or the port list's (repeatable)")
    kv.add_argument("--tokenizer-file", metavar="PATH",
                    help="precise_prefix and --pd-min-prefill-tokens: the served model's tokenizer.json (Hugging Face "
                         "tokenizers), to turn text prompts into token ids in the proxy (chat then routes without token "
                         "ids: no chat template here); without it text and chat prompts are sent to the decode "
                         "instances' /tokenize")
    kv.add_argument("--pd-min-prefill-tokens", type=int, metavar="N",
                    help="selective disaggregation: a prompt leaving at most N tokens to compute after what its "
                         "decode already holds (from its KV events) goes straight to the decode, no prefill leg "
                         "(default 0: off)")
    kv.add_argument("--kv-events-max-blocks", type=int,
                    help="blocks kept in each instance's event index, oldest forgotten first; ~140 bytes each (default 262144)")

    dns = parser.add_argument_group("instances from DNS (a headless Service's records; docs/reference/membership.md)")
    dns.add_argument("--dns-prefill", nargs="+", metavar="NAME[:PORT]",
                     help="DNS name whose A/AAAA (or SRV) records are the prefill instances, re-resolved while the "
                          "proxy runs, e.g. vllm-prefill.default.svc.cluster.local; a name starting with _ is an SRV "
                          "name asked as it is (_http._tcp.NAME); :PORT as --dns-port for this name")
    dns.add_argument("--dns-decode", nargs="+", metavar="NAME[:PORT]",
                     help="DNS name of the decode instances (alone, without prefill: the single-instance baseline)")
    dns.add_argument("--dns-port", metavar="PORT|NAME",
                     help="the instances' HTTP port: a number uses the names' A/AAAA records on that port; a name "
                          "asks the SRV records of that named Service port, _NAME._tcp.<dns name> (default http)")
    dns.add_argument("--dns-interval", type=float,
                     help="seconds between resolutions; shorter when the answers' TTL is, never under 1 s (default 5)")
    dns.add_argument("--dns-server", nargs="+", metavar="HOST[:PORT]",
                     help="nameserver(s) to ask, IP addresses (default: /etc/resolv.conf's, with its search list)")
    dns.add_argument("--dns-kv-events-port", metavar="NAME",
                     help="named Service port whose SRV records (_NAME._tcp.<dns name>) give each instance's KV-event "
                          "PUB port, e.g. kv-events (default: --kv-events-endpoint's template)")

    mem = parser.add_argument_group("membership: instances found, drained and dropped at run time (docs/reference/membership.md)")
    mem.add_argument("--vllm-pd-disaggregation", "--pd-disaggregation", dest="pd_disaggregation", action="store_true",
                     help="prefill/decode mode even when no prefill instance is given (vllm-router's and SGLang's "
                          "flag): prefills come from discovery or the admin API; without any, requests get 503")
    mem.add_argument("--worker-urls", nargs="+", action="append", metavar="URL",
                     help="vllm-router's regular mode: instances that serve whole requests (as --decode)")
    mem.add_argument("--instances-file", metavar="PATH",
                     help="YAML or JSON file of instances, watched (edits in place and atomic renames): "
                          "[{url, role|worker_type, bootstrap_port, kv_events_endpoint, kv_events_replay_endpoint}] "
                          "or {prefill: [...], decode: [...]}")
    mem.add_argument("--instances-file-interval", type=float,
                     help="seconds between looks at --instances-file (default 1)")
    mem.add_argument("--admin-api-key",
                     help="key the admin API (/workers, /add_worker, /remove_worker, /list_workers) requires as "
                          "'Authorization: Bearer KEY' (default: --api-key; with neither, loopback callers only)")
    mem.add_argument("--no-admin-api", dest="admin_api", action="store_false",
                     help="serve no admin API: instances change only through the flags and discovery")
    mem.add_argument("--drain-timeout", type=float,
                     help="seconds a departing instance's requests in flight get to finish before it is removed "
                          "(it gets no new request meanwhile) (default 30)")
    mem.add_argument("--instance-series-retention", type=float,
                     help="seconds a removed instance's metric series stay, so scrapes see their last values "
                          "(default 300)")
    router = parser.add_argument_group("vllm-router flags accepted for a drop-in launch line (no effect here)")
    for flag, why in (("--worker-startup-timeout-secs", "an instance enters rotation once it passes its health check"),
                      ("--worker-startup-check-interval", "health checks run every --health-check-interval"),
                      ("--eviction-interval-secs", "the prefix index is bounded by --max-tree-size instead"),
                      ("--kv-connector", "the KV connector is the instances' (NIXL: no bootstrap needed)"),
                      ("--backend", "vLLM only"), ("--prometheus-port", "metrics are on this port's /metrics"),
                      ("--prometheus-host", "metrics are on this port's /metrics"),
                      ("--enable-trace", "tracing is on unless --no-tracing")):
        takes = flag != "--enable-trace"
        aliases = ("--eviction-interval",) if flag == "--eviction-interval-secs" else ()  # the Rust CLI's name
        router.add_argument(flag, *aliases, dest="ignored_flags", action=_Ignored, nargs=1 if takes else 0, help=why,
                            **({"metavar": "VALUE"} if takes else {}))

    sh = parser.add_argument_group("shadow traffic")
    sh.add_argument("--shadow-url", help="baseline (single instance or decode of another pool) that receives a copy of sampled requests")
    sh.add_argument("--shadow-prefill", dest="shadow_prefill_urls", nargs="+", metavar="URL",
                    help="prefill instances of a shadow P/D pool (with --shadow-url as its decode)")
    sh.add_argument("--shadow-sample-rate", type=float, help="fraction of requests mirrored (default 1.0)")
    sh.add_argument("--shadow-max-inflight", type=int, help="mirrored requests in flight before new ones are dropped (default 32)")
    sh.add_argument("--shadow-timeout", type=float, help="seconds a mirrored request may take (default 120)")


def load_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """Merge flags, environment and config file into validated `Settings`."""
    env = os.environ if environ is None else environ
    given = vars(args)
    file_values = _read_config_file(given.get("config") or env.get("PDPROXY_CONFIG"))

    def pick(name: str) -> Any:
        if name in given:
            return given[name]
        for source in (env, file_values):
            for key in (name, FLAG_NAMES.get(name)):
                found = _lookup(source, key, env_style=source is env)
                if found is not None:
                    return found
            negated = _lookup(source, NEGATED_FLAGS.get(name), env_style=source is env)
            if negated is not None:
                return not _coerce(name, negated)
        return None

    values: dict[str, Any] = {}
    for f in fields(Settings):
        if f.name in ("prefill_urls", "decode_urls", "bootstrap_ports"):
            continue
        raw = pick(f.name)
        if raw is not None:
            values[f.name] = _coerce(f.name, raw)

    policy = pick("policy")
    for side in ("prefill_policy", "decode_policy"):
        values.setdefault(side, policy or "round_robin")
        if values[side] not in POLICIES:
            raise ConfigError(f"{side.replace('_', '-')} {values[side]!r} is not a routing policy; choose one "
                              f"of {', '.join(POLICIES)}")
    if "upstream_api_key" not in values and env.get("OPENAI_API_KEY"):
        values["upstream_api_key"] = env["OPENAI_API_KEY"]

    values["bootstrap_ports"] = {}
    discovered = any(values.get(name) for name in DISCOVERY_SETTINGS)
    values["prefill_urls"], values["decode_urls"] = _instances(pick, values["bootstrap_ports"], discovered)
    settings = Settings(**values)
    _validate(settings)
    return settings


def _lookup(source: Any, key: str | None, env_style: bool) -> Any:
    if key is None:
        return None
    return source.get("PDPROXY_" + key.upper() if env_style else key)


def _instances(pick, bootstrap: dict[str, int], discovered: bool) -> tuple[list[str], list[str]]:
    """The instances the flags give. With none, the toy proxy's defaults, unless instances are to be discovered
    (then the pools start empty and fill as they are found)."""
    toy_given = {k: pick(k) for k in TOY_DEFAULTS if pick(k) is not None}
    prefill = [u for group in _groups(pick("prefill")) for u in _parse_url_group(group, bootstrap)]
    decode = [u for group in _groups(pick("decode")) for u in _parse_url_group(group)]
    decode += [u for group in _groups(pick("worker_urls")) for u in _parse_url_group(group)]  # vllm-router's
    if toy_given or not (prefill or decode or discovered):
        toy = {k: _as_list(toy_given.get(k, v)) for k, v in TOY_DEFAULTS.items()}
        prefill = _pair(toy["prefiller_hosts"], toy["prefiller_ports"], "prefiller") + prefill
        decode = _pair(toy["decoder_hosts"], toy["decoder_ports"], "decoder") + decode
    if not decode and not discovered:
        raise ConfigError("no decode instance: give --decode URL or --decoder-hosts/--decoder-ports, or a source "
                          "that finds them (--instances-file, --service-discovery, DNS; docs/reference/membership.md)")
    return prefill, decode


def _pair(hosts: list[str], ports: list[Any], what: str) -> list[str]:
    if len(hosts) != len(ports):
        raise ConfigError(
            f"--{what}-hosts has {len(hosts)} value(s) but --{what}-ports has {len(ports)}: they are paired one to one"
        )
    return [_url(h, _port(p)) for h, p in zip(hosts, ports)]


def _groups(value: Any) -> list[list[str]]:
    """`--prefill` values: a list of groups from argparse, or a flat list/str from env and files."""
    if value is None:
        return []
    if isinstance(value, str):
        return [[v] for v in re.split(r"[,\s]+", value.strip()) if v]
    if all(isinstance(v, list) for v in value):
        return value
    return [[str(v)] for v in value]


def _parse_url_group(group: list[str], bootstrap: dict[str, int] | None = None) -> list[str]:
    """`URL [BOOTSTRAP_PORT|none]` (router form) or one or more `host:port` (demo-proxy form); a bootstrap port
    goes into `bootstrap` by URL (shown in /status and /workers; NIXL needs none, Mooncake does)."""
    urls: list[str] = []
    for i, token in enumerate(group):
        if re.fullmatch(r"\d+|none", token) and i > 0 and group[i - 1].startswith(("http://", "https://")):
            if token != "none" and bootstrap is not None:
                bootstrap[group[i - 1].rstrip("/")] = _port(token)
            continue
        if token.startswith(("http://", "https://")):
            urls.append(token.rstrip("/"))
        elif re.fullmatch(r"\[?[\w.:-]+\]?:\d+", token):
            urls.append("http://" + token)
        else:
            raise ConfigError(f"instance {redact_url(token)!r} is neither a URL (http://host:port) nor host:port")
    return urls


def redact_url(url: str) -> str:
    """`url` with its credentials (`user:password@`) masked, for anything that shows a URL."""
    return _USERINFO.sub(lambda m: (m.group(1) or "") + "***@", url, count=1)


_USERINFO = re.compile(r"^((?:[a-z][a-z0-9+.-]*:)?//)?[^/?#\s]*@", re.IGNORECASE)


def _url(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"http://{host}:{port}"


def _port(value: Any) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"port {value!r} is not a number") from None
    if not 0 < port < 65536:
        raise ConfigError(f"port {port} is out of range")
    return port


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [v for v in re.split(r"[,\s]+", value.strip()) if v]
    return list(value)


_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off", ""}


def _coerce(name: str, raw: Any) -> Any:
    """Convert env/file strings to the type of the Settings field."""
    default = Settings.__dataclass_fields__[name]
    kind = default.type
    try:
        if name in ("resource_attrs", "kv_events_instances", "kv_events_replay_instances"):
            return _parse_attrs(raw)
        if name in DISCOVERY_SELECTORS:
            return _parse_selector(name, raw)
        if name == "service_discovery_port":
            try:
                return _port(raw)
            except ConfigError as exc:
                raise ConfigError(f"--service-discovery-port: {exc}") from None
        if name == "workers":
            return workers_count(raw)
        if name == "shadow_prefill_urls":
            return [u for g in _groups(raw) for u in _parse_url_group(g)]
        if name in ("served_model_name", "dns_prefill", "dns_decode", "dns_server", "ignored_flags"):
            return [str(v) for v in _as_list(raw)]
        if name in ("kv_events_ports", "kv_events_replay_ports"):
            return [_port(v) for v in _as_list(raw)]
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _BOOL_TRUE | _BOOL_FALSE:
                return text in _BOOL_TRUE
            raise ValueError(raw)
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        return raw if raw is None else str(raw)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"setting {name.replace('_', '-')}: {raw!r} is not a valid {kind}") from None


def workers_count(raw: Any) -> int:
    """`--workers`: a number, or 'auto' for one per CPU in this process's affinity mask (what a
    container's cpuset or `taskset` allows, not the host's count)."""
    if str(raw).strip().lower() == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return int(raw)


def _parse_attrs(raw: Any) -> dict[str, str]:
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    items = raw if isinstance(raw, list) else re.split(r"[,\s]+", str(raw).strip())
    attrs: dict[str, str] = {}
    for item in items:
        if not item:
            continue
        key, sep, value = str(item).partition("=")
        if not sep or not key:
            raise ValueError(item)
        attrs[key.strip()] = value.strip()
    return attrs


def _read_config_file(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    known = ({f.name for f in fields(Settings)} | set(TOY_DEFAULTS) | {"prefill", "decode", "policy", "worker_urls"}
             | set(FLAG_NAMES.values()) | set(NEGATED_FLAGS.values()))
    values = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
    return values


def _validate(s: Settings) -> None:
    positive = ("connect_timeout", "read_timeout", "health_check_timeout", "queue_timeout", "shadow_timeout",
                "body_timeout", "keep_alive_timeout", "write_timeout")
    for name in positive:
        if getattr(s, name) <= 0:
            raise ConfigError(f"{name.replace('_', '-')} must be > 0")
    non_negative = ("prefill_retries", "decode_retries", "first_token_timeout", "decode_deadline", "retry_backoff",
                    "health_check_interval", "max_inflight", "max_queue", "stall_threshold", "eject_after_failures",
                    "eject_seconds", "max_retry_wait", "upstream_keep_alive")
    for name in non_negative:
        if getattr(s, name) < 0:
            raise ConfigError(f"{name.replace('_', '-')} must be >= 0")
    if not 0 <= s.max_ejection_percent <= 100:
        raise ConfigError("max-ejection-percent must be between 0 and 100")
    if s.gpu_count < 0:
        raise ConfigError("gpu-count must be >= 0")
    if s.span_queue_size < 1:
        raise ConfigError("span-queue-size must be >= 1")
    if s.trace_file_max_bytes != 0 and s.trace_file_max_bytes < 1024 * 1024:
        raise ConfigError("trace-file-max-bytes must be 0 (unbounded) or at least 1048576 (1 MiB)")
    if s.trace_file_backups < 0 or s.trace_rejected_rate < 0:
        raise ConfigError("trace-file-backups and trace-rejected-rate must be >= 0")
    if s.max_body_bytes < 1024:
        raise ConfigError("max-body-bytes must be at least 1024")
    if not 0.0 <= s.shadow_sample_rate <= 1.0:
        raise ConfigError("shadow-sample-rate must be between 0 and 1")
    for url in (*s.prefill_urls, *s.decode_urls, *s.shadow_prefill_urls, *filter(None, [s.shadow_url])):
        if "@" in urlsplit(url).netloc:  # one rule for every request to an instance: no URL credentials
            raise ConfigError(f"instance URL {redact_url(url)} carries credentials, which pdproxy does not send; "
                              "give the instances' key with --upstream-api-key or OPENAI_API_KEY")
    if s.shadow_prefill_urls and not s.shadow_url:
        raise ConfigError("--shadow-prefill needs --shadow-url (the shadow pool's decode instance)")
    if s.workers < 1:
        raise ConfigError("workers must be >= 1")
    if not 0 <= s.port < 65536:
        raise ConfigError(f"port {s.port} is out of range")
    if not 0.0 <= s.cache_threshold <= 1.0:
        raise ConfigError("cache-threshold must be between 0 and 1")
    if s.balance_abs_threshold < 0 or s.balance_rel_threshold < 1.0:
        raise ConfigError("balance-abs-threshold must be >= 0 and balance-rel-threshold >= 1")
    if s.max_tree_size < 1:
        raise ConfigError("max-tree-size must be >= 1")
    if s.hash_load_factor != 0 and s.hash_load_factor < 1:
        raise ConfigError("hash-load-factor must be >= 1, or 0 for no bound")
    if s.tokenizer_file and not Path(s.tokenizer_file).is_file():
        raise ConfigError(f"tokenizer-file {s.tokenizer_file} is not a readable file")
    if s.pd_min_prefill_tokens < 0:
        raise ConfigError("pd-min-prefill-tokens must be >= 0")
    if s.drain_timeout < 0 or s.instance_series_retention < 0 or s.instances_file_interval <= 0:
        raise ConfigError("drain-timeout and instance-series-retention must be >= 0, instances-file-interval > 0")
    if s.kv_events_max_blocks < 1:
        raise ConfigError("kv-events-max-blocks must be >= 1")
    try:
        kv_event_endpoints(s)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if s.load_metrics_interval <= 0:
        raise ConfigError("load-metrics-interval must be > 0")
    _validate_discovery(s)
    try:
        dns_queries(s), dns_nameservers(s)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        parse_hash_key(s.hash_key)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def kv_event_endpoints(s: Settings) -> list[tuple[str, str, str | None]]:
    """(instance address, PUB endpoint, replay endpoint or None) for every instance publishing KV events.

    The toy-proxy flags name instances by host and port; vLLM's --kv-events-config names ports on the same
    host. So a template with {host} (and {port}, the instance's HTTP port, or {index}, its place, for several
    instances per host) covers a uniform fleet, --kv-events-ports one port per instance in order, and
    --kv-events-instance HOST:PORT=ENDPOINT the exceptions. ValueError if bad."""
    addresses: list[tuple[str, str, int]] = []
    for url in (*s.prefill_urls, *s.decode_urls):
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if all(a[0] != f"{parts.hostname}:{port}" for a in addresses):
            addresses.append((f"{parts.hostname}:{port}", parts.hostname or "", port))
    known = {a[0] for a in addresses}

    def by_instance(given: dict[str, str]) -> dict[str, str]:
        named = {}
        for address, endpoint in given.items():
            bare = re.sub(r"^\[([^\]]*)\]", r"\1", address)  # [::1]:8200 names the instance ::1:8200
            if bare not in known:
                raise ValueError(f"kv-events override for {address}, which is not an instance "
                                 f"({', '.join(sorted(known))})")
            named[bare] = endpoint
        return named

    pub_overrides, replay_overrides = by_instance(s.kv_events_instances), by_instance(s.kv_events_replay_instances)

    for ports, flag in ((s.kv_events_ports, "--kv-events-ports"), (s.kv_events_replay_ports, "--kv-events-replay-ports")):
        if ports and len(ports) != len(addresses):
            raise ValueError(f"{flag} gives {len(ports)} port(s) for {len(addresses)} instances ("
                             f"{', '.join(a[0] for a in addresses)}): one per instance, prefills first")

    def fill(template: str, host: str, port: int, index: int, what: str) -> str:
        try:  # an IPv6 literal keeps its brackets in an endpoint: tcp://[::1]:5557
            endpoint = template.format(host=f"[{host}]" if ":" in host else host, port=port, index=index)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"{what} {template!r}: only {{host}}, {{port}} and {{index}} may be used ({exc})") from None
        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{what} {endpoint!r} is not a ZMQ endpoint (tcp://HOST:PORT)")
        return endpoint

    def listed(ports: list[int], index: int) -> str | None:
        return f"tcp://{{host}}:{ports[index]}" if ports else None

    out = []
    for index, (address, host, port) in enumerate(addresses):
        endpoint = pub_overrides.get(address) or listed(s.kv_events_ports, index) or s.kv_events_endpoint
        if endpoint:
            replay = (replay_overrides.get(address) or listed(s.kv_events_replay_ports, index)
                      or s.kv_events_replay_endpoint)
            out.append((address, fill(endpoint, host, port, index, "kv-events endpoint"),
                        fill(replay, host, port, index, "kv-events replay endpoint") if replay else None))
    return out


def parse_hash_key(spec: str) -> tuple[tuple[str, str], ...]:
    """--hash-key 'header:X-Session-Id,body:user' -> (("header", "X-Session-Id"), ("body", "user"))."""
    sources = []
    for item in (s.strip() for s in spec.split(",")):
        where, sep, name = item.partition(":")
        if not sep or where not in ("header", "body") or not name.strip():
            raise ValueError(f"hash-key source {item!r} is not header:NAME or body:FIELD")
        sources.append((where, name.strip()))
    return tuple(sources)



class DnsName(NamedTuple):
    """One DNS name the DNS source follows (pdproxy/membership/dns.py): its role, what is asked ("A": the A and
    AAAA records, on `port`; "SRV": the SRV records, which carry the ports), the name asked, and the SRV name of
    the instances' KV-event port (None: the --kv-events-endpoint template gives it)."""

    role: str
    kind: str
    qname: str
    port: int | None
    kv_events_qname: str | None


_DNS_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_PORT_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,13}[A-Za-z0-9])?")  # IANA service name, as Kubernetes' port names


def dns_queries(s: Settings) -> list[DnsName]:
    """What --dns-prefill/--dns-decode ask, one entry per name; ValueError saying which name is wrong."""
    if s.dns_interval <= 0:
        raise ValueError("dns-interval must be > 0")
    default_port = _dns_port(s.dns_port, "--dns-port")
    kv_port = s.dns_kv_events_port
    if kv_port is not None and (not _PORT_NAME.fullmatch(kv_port) or kv_port.isdigit()):
        raise ValueError(f"--dns-kv-events-port {kv_port!r} is not a port name such as kv-events (the Service's "
                         "named port whose SRV records give the KV-event ports)")
    out: list[DnsName] = []
    for role, names in (("prefill", s.dns_prefill), ("decode", s.dns_decode)):
        for text in names:
            name, sep, port_text = text.rpartition(":") if ":" in text else (text, "", "")
            if not _dns_name(name):
                raise ValueError(f"--dns-{role} {text!r}: {name!r} is not a DNS name (NAME[:PORT], e.g. "
                                 "vllm-prefill.default.svc.cluster.local:8000)")
            base = re.sub(r"^(_[^.]+\.){2}", "", name.rstrip("."))  # the Service's own name under an SRV name
            if name.startswith("_"):
                if sep:
                    raise ValueError(f"--dns-{role} {text!r}: an SRV name carries its ports; give no :PORT")
                entry = DnsName(role, "SRV", name, None, None)
            else:
                port = _dns_port(port_text, f"--dns-{role} {text!r}") if sep else default_port
                entry = (DnsName(role, "A", name, port, None) if isinstance(port, int)
                         else DnsName(role, "SRV", f"_{port}._tcp.{name}", None, None))
            kv = f"_{kv_port}._tcp.{base}" + ("." if name.endswith(".") else "") if kv_port else None
            out.append(entry._replace(kv_events_qname=kv))
    return out


def _dns_port(text: str, what: str) -> int | str:
    if text.isdigit():
        return _port(text)
    if not _PORT_NAME.fullmatch(text) or not any(c.isalpha() for c in text):
        raise ValueError(f"{what}: port {text!r} is neither a number nor a Service port name such as http")
    return text


def _dns_name(name: str) -> bool:
    bare = name[:-1] if name.endswith(".") else name
    try:
        ipaddress.ip_address(bare)
        return False  # an address is an instance (--prefill URL), not a name to follow
    except ValueError:
        pass
    return 0 < len(bare) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in bare.split("."))


def dns_nameservers(s: Settings) -> list[tuple[str, int]]:
    """--dns-server's (address, port) pairs: IP addresses, port 53 unless given; ValueError if one is not."""
    out = []
    for text in s.dns_server:
        host, port = text, "53"
        if text.startswith("["):  # [fd00::10]:53
            host, _, rest = text[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ("" if rest else "53")
        elif text.count(":") == 1:
            host, _, port = text.partition(":")
        try:
            address = str(ipaddress.ip_address(host))
        except ValueError:
            raise ValueError(f"--dns-server {text!r} is not an IP address with an optional port (10.96.0.10, "
                             "127.0.0.1:5353, [fd00::10]:53)") from None
        if not port.isdigit():
            raise ValueError(f"--dns-server {text!r}: port {port!r} is not a number")
        out.append((address, _port(port)))
    return out


# ---------------------------------------------------------------------------------------------
# Kubernetes service discovery: vllm-router's flags, same names and forms

DISCOVERY_SELECTORS = ("selector", "prefill_selector", "decode_selector")
# a label key ([DNS-subdomain prefix/]name) and value, as the API server validates them
_LABEL_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"(?:[a-z0-9](?:[-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}")
_LABEL_VALUE = re.compile(rf"(?:{_LABEL_NAME})?")
_NAMESPACE = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")


def _discovery_arguments(parser: argparse.ArgumentParser) -> None:
    kube = parser.add_argument_group(
        "Kubernetes service discovery (vllm-router's flags; docs/reference/membership.md)",
        "Watch the pods a label selector matches and keep the pools in step: a pod joins when it has an IP, "
        "serves while Ready, drains when deleted. Combines with instances given as flags, which stay.")
    kube.add_argument("--service-discovery", action="store_true",
                      help="find prefill and decode instances from Kubernetes pods (in-cluster service account, or "
                           "KUBECONFIG / ~/.kube/config); needs get, list and watch on pods")
    for flag, what in (("--prefill-selector", "prefill pods"), ("--decode-selector", "decode pods"),
                       ("--selector", "single-mode pods (no prefill pool)")):
        kube.add_argument(flag, nargs="+", metavar="KEY=VALUE",
                          help=f"labels of the {what}, all of them required, e.g. app=vllm role="
                               f"{'prefill' if 'prefill' in flag else 'decode'}")
    kube.add_argument("--service-discovery-namespace", metavar="NAMESPACE",
                      help="namespace of the pods (default: every namespace, which needs a ClusterRole)")
    kube.add_argument("--service-discovery-port", type=int, metavar="PORT",
                      help="the pods' HTTP port, unless a pod's pdproxy.io/port annotation says otherwise (default: "
                           "the container port named http, else 80 as vllm-router)")
    kube.add_argument("--service-discovery-resync", type=float, metavar="SECONDS",
                      help="each watch ends after this long with a full re-list, which also restarts a watch gone "
                           "silent (default 60)")


def _parse_selector(name: str, raw: Any) -> dict[str, str]:
    """`app=vllm role=prefill` (words, or one comma-separated string from the environment or a file)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(raw, dict):
        items = [f"{k}={v}" for k, v in raw.items()]
    elif isinstance(raw, str):
        items = [w for w in re.split(r"[,\s]+", raw.strip()) if w]
    else:
        items = [str(w) for w in raw]
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if key.endswith("!") or value.startswith("=") or "(" in item:
            raise ConfigError(f"{flag}: {item!r}: only equality selectors (KEY=VALUE) are supported, as in vllm-router")
        if not sep or not _LABEL_KEY.fullmatch(key) or len(key.rpartition("/")[2]) > 63:
            raise ConfigError(f"{flag}: {item!r} is not KEY=VALUE with a Kubernetes label key (e.g. app=vllm)")
        if not _LABEL_VALUE.fullmatch(value):
            raise ConfigError(f"{flag}: {item!r}: the value must be a label value (63 characters at most: letters, "
                              "digits, '-', '_', '.')")
        labels[key] = value
    return labels


def _validate_discovery(s: Settings) -> None:
    ns = s.service_discovery_namespace
    if ns is not None and not _NAMESPACE.fullmatch(ns):
        raise ConfigError(f"--service-discovery-namespace {ns!r} is not a namespace name (lowercase letters, digits "
                          "and '-', 63 at most)")
    if s.service_discovery_resync <= 0:
        raise ConfigError("service-discovery-resync must be > 0")
    if not s.service_discovery:
        return  # selectors without it do nothing, as in vllm-router (the source warns at start-up)
    if not (s.selector or s.prefill_selector or s.decode_selector):
        raise ConfigError("--service-discovery needs --prefill-selector and --decode-selector (P/D), or --selector "
                          "(single mode)")
    if s.selector and (s.prefill_selector or s.decode_selector or s.prefill_urls):
        raise ConfigError("--selector finds single-mode instances (no prefill pool); with prefill instances use "
                          "--decode-selector")
    if not (s.decode_urls or s.decode_selector or s.selector):
        raise ConfigError("no decode instance: give --decode-selector (or --decode URL) beside --prefill-selector")
