"""Span, attribute and metric names: the contract documented in docs/reference/telemetry.md.

Final: the compiled modules (pdproxy/compiled.py) use their values as constants, not module lookups."""

from typing import Final

# span names
QUEUE_SPAN: Final = "pd.queue"
PREFILL_SPAN: Final = "pd.prefill"
KV_TRANSFER_SPAN: Final = "pd.kv_transfer"
DECODE_SPAN: Final = "pd.decode"

# root-span attributes beyond the GenAI semantic conventions
REQUEST_ID: Final = "pd.request_id"
MODE: Final = "pd.mode"
DEPLOYMENT: Final = "pd.deployment"
RUN: Final = "pd.run"
E2E: Final = "pd.e2e"
TPOT: Final = "pd.tpot"
ITL_UNIT: Final = "pd.itl.unit"
ITL_COUNT: Final = "pd.itl.count"
ITL_MEAN: Final = "pd.itl.mean"
ITL_P50: Final = "pd.itl.p50"
ITL_P99: Final = "pd.itl.p99"
ITL_MAX: Final = "pd.itl.max"
STALLS: Final = "pd.stalls"
CHUNKS: Final = "pd.chunks"
FAILED_STAGE: Final = "pd.failed_stage"
PREFILL_INSTANCE: Final = "pd.prefill.instance"
DECODE_INSTANCE: Final = "pd.decode.instance"
PREFILL_ATTEMPTS: Final = "pd.prefill.attempts"
DECODE_ATTEMPTS: Final = "pd.decode.attempts"
# the client's model name when it is not a known one (bounded: see models.py)
REQUESTED_MODEL: Final = "pd.request.model"
KV_PARAMS: Final = "pd.kv_transfer_params"  # "received" | "missing": did prefill hand over KV coordinates
MIGRATIONS: Final = "pd.migrations"  # decode attempts that replaced a failed one (pdproxy/migration/)
PREFILL_RERUNS: Final = "pd.prefill.reruns"  # prefills run again for fresh KV coordinates
HANDOFFS_ABANDONED: Final = "pd.handoffs.abandoned"  # KV hand-offs left to the prefill's abort timeout
MIGRATION_INELIGIBLE: Final = "pd.migration.ineligible"  # why a stream could not be continued elsewhere

# pd.decode span events: each failed decode attempt, and each prefill run again for a migration
ATTEMPT_EVENT: Final = "pd.decode.attempt_failed"
ATTEMPT_NUMBER: Final = "pd.decode.attempt"
MIGRATION_REASON: Final = "pd.migration.reason"  # the failed attempt's error type
MIGRATION_STAGE: Final = "pd.migration.stage"  # before_first_token | mid_stream
ABANDONED: Final = "pd.handoff.abandoned"  # its KV coordinates may have been read: never given out again
PREFILL_RERUN_EVENT: Final = "pd.prefill.rerun"
# each failed prefill attempt (retried on another instance, or the request's last): on pd.prefill, or on
# pd.decode for a re-prefill of a migration; with the leg's server.address/port and error.type
PREFILL_ATTEMPT_EVENT: Final = "pd.prefill.attempt_failed"
PREFILL_ATTEMPT_NUMBER: Final = "pd.prefill.attempt"
# leg-span attributes: the routing decision that chose the leg's instance (pdproxy/policies/)
ROUTE_POLICY: Final = "pd.route.policy"
ROUTE_REASON: Final = "pd.route.reason"
ROUTE_MATCHED: Final = "pd.route.matched_prefix"
ROUTE_MATCHED_UNIT: Final = "pd.route.matched_prefix.unit"
ROUTE_SCORES: Final = "pd.route.scores"  # ["host:port=score", ...] of the instances the policy compared
# why an event-based decision fell back to the approximate index (pdproxy.routing.FALLBACK_REASONS)
ROUTE_FALLBACK_REASON: Final = "pd.route.fallback_reason"
# pd.prefill of a request sent decode-only (selective disaggregation): its prompt was computed on the decode
PREFILL_ON_DECODE: Final = "pd.prefill.on_decode"

# pd.decode span events: each stall (a gap above the stall threshold), at the gap's start
STALL_EVENT: Final = "pd.stall"
STALL_DURATION: Final = "pd.stall.duration"  # seconds
STALL_TOKENS: Final = "pd.stall.tokens"  # tokens the late event carried
MAX_STALL_EVENTS: Final = 16  # per request: the longest ones
# ... with their cause, live (pdproxy/telemetry/stalls.py): kv_arrival | prefill | migration | preemption | none
STALL_CAUSE: Final = "pd.stall.cause"
STALL_CULPRITS: Final = "pd.stall.culprits"  # how many other requests' activities coincided
STALL_CULPRIT_IDS: Final = "pd.stall.culprit_ids"  # their request ids, largest prompt first
MAX_STALL_CULPRIT_IDS: Final = 4
MAX_STALL_LINKS: Final = 8  # per pd.decode span: links to the culprits' pd.decode (P/D) or pd.prefill (single)
MAX_ATTRIBUTED_STALLS: Final = 256  # per request, the longest: what the by-cause metrics count
# pd.decode attributes: the request's stall seconds and stalls per cause (the collector sums them by cause)
STALL_TIME: Final = "pd.stall.time."  # + cause
STALL_COUNT: Final = "pd.stall.count."  # + cause

# kv_transfer span attributes
HANDOFF_GAP: Final = "pd.handoff.gap"
DECODE_HEADERS_WAIT: Final = "pd.decode.headers_wait"
DECODE_QUEUE_TIME: Final = "pd.decode.queue_time"
KV_ESTIMATED: Final = "pd.kv_transfer.estimated"
KV_DEFINITION: Final = "pd.kv_transfer.definition"

# Prometheus buckets (seconds): dense where TTFT and ITL SLOs live
LATENCY_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15,
    0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0,
    30.0, 60.0, 120.0, 300.0,
)
GAP_BUCKETS: Final = (
    0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025,
    0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
)
