"""What the two legs of a request share: how a failed attempt is classified, the step to the next
attempt, the prefill's KV coordinates, and the first-token deadline.

`pdproxy/pd.py` runs each leg as a loop whose first attempt pays for none of this: `Failure`s are
built, and `retry` awaited, only once an attempt failed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from pdproxy import jsonio
from pdproxy.errors import DECODE, PREFILL, ProxyError, UpstreamResponse, instance_message, retry_after_seconds
from pdproxy.migration import Budget
from pdproxy.pool import Instance, Pool
from pdproxy.upstream import ConnectFailed, ConnectTimeout

log = logging.getLogger("pdproxy.pd")

MAX_BACKOFF = 2.0  # seconds; the backoff between two attempts never exceeds this


class Failure:
    """One failed attempt at a leg: what the client gets if it stays failed, and what may be done about it."""

    def __init__(self, error: ProxyError | UpstreamResponse, retry: bool = True, outlier: bool = True,
                 charged: bool = True, hold: float | None = None, reached: bool = True) -> None:
        self.error = error
        self.retry = retry  # may another attempt help?
        self.outlier = outlier  # a fault, not load (a busy answer is not one: the request never started)
        self.charged = charged  # the instance is to blame: counts towards its passive ejection
        self.hold = hold  # the instance asked for this many seconds of peace (Retry-After)
        self.reached = reached  # the instance got the request (a decode may have used its KV coordinates)


async def retry(pool: Pool, instance: Instance, failure: Failure, budget: Budget, tries: int, backoff: float,
                max_wait: float) -> Instance:
    """After attempt number `tries` failed on `instance`: the instance for the next one, once its
    backoff passed, or the failure's error raised when there is to be none.

    Another instance is tried while the failure allows it and `budget` lasts, each after a jittered
    exponential backoff (`backoff` seconds the first time). An instance that answered 429/503 with
    Retry-After is held for that long; when only held instances are left, the proxy waits for one if
    that is at most `max_wait` (--max-retry-wait), else the client gets the instance's answer and its
    Retry-After."""
    if failure.hold is not None:
        pool.hold(instance, failure.hold)
    if failure.charged:
        pool.failed(instance)
    if not failure.retry or not budget.take():
        raise failure.error
    try:
        instance = pool.choose(exclude=instance)
    except ProxyError:
        raise failure.error from None
    held = pool.wait_for(instance)
    if held > max_wait:
        raise failure.error
    # exponential in the attempt, jittered ±50 % so that retries of many requests spread out
    await asyncio.sleep(max(held, min(backoff * 2 ** (tries - 1) * random.uniform(0.5, 1.5), MAX_BACKOFF)))
    return instance


def transport_failure(role: str, instance: Instance, exc: BaseException) -> Failure:
    """Connect errors and timeouts, resets and broken answers are the instance's fault; read timeouts
    are not charged to it: how long an answer takes is the request's doing (a non-streamed decode
    sends its status line after its last token, so `max_tokens` alone can outlast --read-timeout; a
    prefill's time grows with the prompt). An instance that hangs outright fails its active health
    check, which has its own short timeout; retries already steer each request away from it."""
    where = f"{role} instance {instance.address}"
    if isinstance(exc, ConnectTimeout):
        return Failure(ProxyError(504, f"{where} did not accept a connection in time", error_type="connect_timeout",
                                  stage=role), reached=False)
    if isinstance(exc, TimeoutError):
        return Failure(ProxyError(504, f"{where} timed out", error_type="timeout", stage=role), charged=False)
    if isinstance(exc, ConnectFailed):
        return Failure(ProxyError(503, f"{where} is unreachable ({type(exc).__name__})", error_type="connect_error",
                                  stage=role), reached=False)
    return Failure(ProxyError(502, f"{where} dropped the connection before answering ({type(exc).__name__})",
                              error_type="upstream_disconnect", stage=role))


def status_failure(role: str, instance: Instance, status: int, headers: dict[str, str], raw: bytes,
                   kv_sent: bool = True) -> Failure:
    """An error status from an instance. 429, and 503 with Retry-After, mean "busy": retried elsewhere
    without counting against the instance. Other 4xx are the request's fault: relayed at once. 5xx
    are the instance's fault: retried, counted, and a 502 naming the instance if they persist. A KV
    load failure is counted only when the decode got the prefill's own coordinates (`kv_sent`):
    whatever it failed to load otherwise, the proxy did not name it."""
    retry_after = headers.get("retry-after")  # the upstream client lower-cases header names
    advised = retry_after_seconds(retry_after)
    content_type = headers.get("content-type", "application/json")
    if status == 429 or (status == 503 and advised is not None):
        return Failure(UpstreamResponse(status, raw, content_type, stage=role, retry_after=retry_after),
                       outlier=False, charged=False, hold=advised)
    if status < 500:
        return Failure(UpstreamResponse(status, raw, content_type, stage=role, retry_after=retry_after),
                       retry=False, outlier=False, charged=False)
    message = instance_message(raw)
    if role == DECODE and _is_kv_load_failure(message):
        return Failure(ProxyError(502, f"{role} instance {instance.address} could not load the prompt's KV cache "
                                       f"({status}: {message})", error_type="kv_load_failed", stage=role),
                       charged=kv_sent)
    return Failure(ProxyError(502, f"{role} instance {instance.address} answered {status}: {message}",
                              error_type="upstream_5xx", stage=role))


def _is_kv_load_failure(message: str) -> bool:
    """vLLM ends a request whose KV pull failed with HTTP 500 (kv_load_failure_policy=fail); its message
    names the KV load. Told apart only for the error type: every decode 5xx is retried the same way."""
    text = message.lower()
    return "kv" in text and any(word in text for word in ("load", "transfer", "pull", "recv"))


# -- the prefill's answer ------------------------------------------------------------------------

_missing_kv_warned: set[str] = set()
_EXACT_SCALARS = frozenset({int, str, bool, type(None)})
_LOOKED_AT_ONE_BY_ONE = 16  # values of a list or dict that cost less looked at in a loop than collected in C


def kv_params(raw: bytes, instance: Instance) -> dict[str, Any] | None:
    """The prefill's `kv_transfer_params`; None when it sent none (the decode then prefills locally;
    connectors such as LMCache and Mooncake never send any, so this is a warning once, not an error).

    They go on to the decode verbatim, so they are read as `jsonio.loads_exact` reads them (every
    integer exact, `1e999` kept as infinity). orjson, ~5x faster, reads an answer the same way when
    `jsonio.loads_if_exact` says so (it nests shallowly: the exact reader would refuse one nested past
    Python's recursion limit, orjson 3.8 reads it) and the parameters it read hold no float at all:
    orjson reads integers past 64 bits as floats, and refuses what else it reads differently (NaN,
    Infinity, `1e999`, lone surrogates). Every other answer, those included, is read exactly."""
    answer: Any = read_fast(raw)
    if answer is None:
        try:
            answer = jsonio.loads_exact(raw)
        except ValueError:
            raise ProxyError(502, f"prefill instance {instance.address} sent a response that is not JSON",
                             error_type="invalid_prefill_response", stage=PREFILL) from None
    if not isinstance(answer, dict):
        raise ProxyError(502, f"prefill instance {instance.address} sent a response that is not a JSON object",
                         error_type="invalid_prefill_response", stage=PREFILL)
    params = answer.get("kv_transfer_params")
    if params is None or params == {}:
        if instance.address not in _missing_kv_warned:
            _missing_kv_warned.add(instance.address)
            log.warning("prefill instance %s returned no kv_transfer_params; decodes will compute the prompt "
                        "themselves (traces say pd.kv_transfer_params=missing)", instance.address)
        return None
    if not isinstance(params, dict):
        raise ProxyError(502, f"prefill instance {instance.address} sent malformed kv_transfer_params",
                         error_type="invalid_kv_params", stage=PREFILL)
    return params


def read_fast(raw: bytes) -> dict[str, Any] | None:
    """The prefill's answer as orjson reads it, when that is how the exact reader would read its
    parameters (see `kv_params`); None: read it exactly."""
    answer = jsonio.loads_if_exact(raw)  # its walk of the values read costs less than two counts of the brackets
    if isinstance(answer, dict) and _read_exactly(answer.get("kv_transfer_params")):
        return answer
    return None


def _read_exactly(value: Any) -> bool:
    """Whether orjson's reading of `value` is the exact reader's: it holds no float (the one type
    orjson reads differently: integers past 64 bits). A long list's types are collected in C first
    (block ids: thousands of integers); a short one, or a dict's few values, are looked at one by one."""
    if isinstance(value, dict):
        items: list[Any] = list(value.values())
    elif isinstance(value, list):
        items = value
    else:
        return type(value) is not float
    if len(items) > _LOOKED_AT_ONE_BY_ONE:
        kinds = set(map(type, items))
        if kinds <= _EXACT_SCALARS:
            return True
        if float in kinds:
            return False
    for item in items:
        kind = type(item)
        if kind is float or (kind is dict or kind is list) and not _read_exactly(item):
            return False
    return True


# -- the first token's deadline ------------------------------------------------------------------

class Deadline:
    """`asyncio.timeout(seconds)` around one await, for the decode's first token: the same cancel and
    uncancel (a client's disconnect during it still cancels the request), without the Timeout object
    and its two coroutines per use. `end()` once the await is over, whichever way."""

    __slots__ = ("_task", "_cancelling", "_handle", "_fired", "_ended")

    def __init__(self, seconds: float) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self._fired = self._ended = False
        loop = asyncio.get_running_loop()
        self._handle = loop.call_at(loop.time() + seconds, self._fire)

    def _fire(self) -> None:
        self._fired = True
        self._task.cancel()

    def end(self, cancelled: bool = False) -> bool:
        """The await is over (`cancelled`: by a CancelledError). True when the deadline cancelled it,
        and no one else did: the cancellation is then withdrawn and the caller times out instead."""
        if self._ended:
            return False
        self._ended = True
        self._handle.cancel()
        return self._fired and self._task.uncancel() <= self._cancelling and cancelled
