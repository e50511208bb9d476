"""Span, attribute and metric names: the contract documented in docs/telemetry.md."""

# span names
QUEUE_SPAN, PREFILL_SPAN, KV_TRANSFER_SPAN, DECODE_SPAN = "pd.queue", "pd.prefill", "pd.kv_transfer", "pd.decode"

# root-span attributes beyond the GenAI semantic conventions
REQUEST_ID = "pd.request_id"
MODE = "pd.mode"
DEPLOYMENT = "pd.deployment"
RUN = "pd.run"
E2E = "pd.e2e"
TPOT = "pd.tpot"
ITL_UNIT = "pd.itl.unit"
ITL_COUNT = "pd.itl.count"
ITL_MEAN, ITL_P50, ITL_P99, ITL_MAX = "pd.itl.mean", "pd.itl.p50", "pd.itl.p99", "pd.itl.max"
STALLS = "pd.stalls"
CHUNKS = "pd.chunks"
FAILED_STAGE = "pd.failed_stage"
PREFILL_INSTANCE, DECODE_INSTANCE = "pd.prefill.instance", "pd.decode.instance"
PREFILL_ATTEMPTS, DECODE_ATTEMPTS = "pd.prefill.attempts", "pd.decode.attempts"
REQUESTED_MODEL = "pd.request.model"  # the client's model name when it is not a known one (bounded: see models.py)
KV_PARAMS = "pd.kv_transfer_params"  # "received" | "missing": did prefill hand over KV coordinates
MIGRATIONS = "pd.migrations"  # decode attempts that replaced a failed one (pdproxy/migration/)
PREFILL_RERUNS = "pd.prefill.reruns"  # prefills run again for fresh KV coordinates
HANDOFFS_ABANDONED = "pd.handoffs.abandoned"  # KV hand-offs left to the prefill's abort timeout
MIGRATION_INELIGIBLE = "pd.migration.ineligible"  # why a stream could not be continued elsewhere

# pd.decode span events: each failed decode attempt, and each prefill run again for a migration
ATTEMPT_EVENT = "pd.decode.attempt_failed"
ATTEMPT_NUMBER = "pd.decode.attempt"
MIGRATION_REASON = "pd.migration.reason"  # the failed attempt's error type
MIGRATION_STAGE = "pd.migration.stage"  # before_first_token | mid_stream
ABANDONED = "pd.handoff.abandoned"  # its KV coordinates may have been read: never given out again
PREFILL_RERUN_EVENT = "pd.prefill.rerun"
# each failed prefill attempt (retried on another instance, or the request's last): on pd.prefill, or on
# pd.decode for a re-prefill of a migration; with the leg's server.address/port and error.type
PREFILL_ATTEMPT_EVENT = "pd.prefill.attempt_failed"
PREFILL_ATTEMPT_NUMBER = "pd.prefill.attempt"
# leg-span attributes: the routing decision that chose the leg's instance (pdproxy/policies/)
ROUTE_POLICY, ROUTE_REASON = "pd.route.policy", "pd.route.reason"
ROUTE_MATCHED, ROUTE_MATCHED_UNIT = "pd.route.matched_prefix", "pd.route.matched_prefix.unit"
ROUTE_SCORES = "pd.route.scores"  # ["host:port=score", ...] of the instances the policy compared

# pd.decode span events: each stall (a gap above the stall threshold), at the gap's start
STALL_EVENT = "pd.stall"
STALL_DURATION = "pd.stall.duration"  # seconds
STALL_TOKENS = "pd.stall.tokens"  # tokens the late event carried
MAX_STALL_EVENTS = 16  # per request: the longest ones
# ... with their cause, live (pdproxy/telemetry/stalls.py): kv_arrival | prefill | migration | preemption | none
STALL_CAUSE = "pd.stall.cause"
STALL_CULPRITS = "pd.stall.culprits"  # how many other requests' activities coincided
STALL_CULPRIT_IDS = "pd.stall.culprit_ids"  # their request ids, largest prompt first
MAX_STALL_CULPRIT_IDS = 4
MAX_STALL_LINKS = 8  # per pd.decode span: links to the culprits' pd.decode (P/D) or pd.prefill (single)
MAX_ATTRIBUTED_STALLS = 256  # per request, the longest: what the by-cause metrics count
# pd.decode attributes: the request's stall seconds and stalls per cause (the collector sums them by cause)
STALL_TIME = "pd.stall.time."  # + cause
STALL_COUNT = "pd.stall.count."  # + cause

# kv_transfer span attributes
HANDOFF_GAP = "pd.handoff.gap"
DECODE_HEADERS_WAIT = "pd.decode.headers_wait"
DECODE_QUEUE_TIME = "pd.decode.queue_time"
KV_ESTIMATED = "pd.kv_transfer.estimated"
KV_DEFINITION = "pd.kv_transfer.definition"

# Prometheus buckets (seconds): dense where TTFT and ITL SLOs live
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15,
    0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0,
    30.0, 60.0, 120.0, 300.0,
)
GAP_BUCKETS = (
    0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025,
    0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
)
