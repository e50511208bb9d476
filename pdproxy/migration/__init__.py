"""Request migration: a decode that fails is replaced by another, at no cost to the client.

The rules (docs/reference/protocol.md, "Retries and migration", says what a client may observe):

* **Before the first token nothing is committed.** The client's status line goes out with the first
  token-bearing event of a stream (`read_head`), so a decode that fails before it — connect error,
  reset, 5xx, a stream that ends or errors without a token, silence past `--first-token-timeout` —
  is retried on another decode instance and the client never knows.
* **Which KV the next decode uses** follows vLLM 0.23 with NIXL (facts file, fact 2): hand-off
  parameters whose blocks another decode may have pulled still answer 200 on a second decode,
  which then streams from blocks that may hold someone else's KV. So the same parameters are
  reused only when the failed decode provably never got the request (`Handoff.reusable`); in every
  other case the prefill runs again and the new parameters go to the new decode. The abandoned
  hand-off's blocks stay held on the prefill until vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`.
* **Mid-stream** (`--migrate-mid-stream`): a decode that dies after tokens reached the client is
  continued on another one by prefilling the prompt's ids plus the ids already delivered (vLLM's
  `return_token_ids`), with `max_tokens` reduced by as many, and the new stream is rewritten into
  the old one (`TokenTap`): same id, no repeated or missing text, usage that adds up, one `[DONE]`.
  That is exact for greedy decoding of one text prompt only: `Continuation.refusal` names the requests
  that are not armed, `Continuation.obstacle` the streams whose ids cannot be trusted to continue from.
"""

from pdproxy.migration.attempts import (BEFORE_FIRST_TOKEN, MAX_HEAD_BYTES, MAX_HEAD_EVENTS, MID_STREAM, MIGRATABLE,
                                        Attempt, Budget, Handoff, first_token_timeout, read_head,
                                        read_whole)
from pdproxy.migration.continuation import Continuation, TokenTap, arm

__all__ = ["BEFORE_FIRST_TOKEN", "MAX_HEAD_BYTES", "MAX_HEAD_EVENTS", "MID_STREAM", "MIGRATABLE", "Attempt", "Budget",
           "Continuation", "Handoff", "TokenTap", "arm", "first_token_timeout", "read_head", "read_whole"]
