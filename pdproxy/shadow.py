"""Shadow traffic: a sampled copy of live requests sent to a baseline, compared on identical input.

The shadow (one vLLM instance, or another P/D pool) gets the same body and request id; its answer
is read and thrown away. Its trace is a child of the primary's root span and its metrics carry
`deployment="shadow"`. It can never slow or fail the primary: copies run as background tasks,
at most `--shadow-max-inflight` at once (beyond that they are dropped and counted), each within
`--shadow-timeout`, and whatever happens to them never reaches the client.

Start-up says where copies go (`describe`), and /status shows it with what became of them (`status`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import aiohttp

from pdproxy.admission import Admission
from pdproxy.config import Settings, redact_url
from pdproxy.errors import ProxyError, UpstreamResponse
from pdproxy.pd import Proxy
from pdproxy.pool import DECODE, PREFILL, Pool
from pdproxy.protocol import Route
from pdproxy.routing import Router
from pdproxy.telemetry import Recorder, RequestTrace
from pdproxy.upstream import UpstreamClient

log = logging.getLogger("pdproxy.shadow")


class Shadow:
    def __init__(self, settings: Settings, session: aiohttp.ClientSession, upstream: UpstreamClient,
                 recorder: Recorder) -> None:
        prefill = Pool(PREFILL, settings.shadow_prefill_urls) if settings.shadow_prefill_urls else None
        decode = Pool(DECODE, [settings.shadow_url])
        self.proxy = Proxy(settings, session, upstream, Router(prefill, decode), Admission(0, 0, 1.0), recorder)
        self.rate = settings.shadow_sample_rate
        self.limit = settings.shadow_max_inflight
        self.timeout = settings.shadow_timeout
        self.outcomes = recorder.metrics.shadow
        self.tasks: set[asyncio.Task] = set()
        self.settings = settings
        # what became of the requests, for /status (the same counts as pdproxy_shadow_requests_total)
        self.counts = {"sent": 0, "failed": 0, "dropped_busy": 0, "sampled_out": 0}

    def mirror(self, body: dict[str, Any], route: Route, primary: RequestTrace, headers: dict[str, str]) -> None:
        """Maybe start a copy of this request; returns at once either way."""
        counts = self.counts
        if self.rate < 1.0 and random.random() >= self.rate:
            self.outcomes.labels("sampled_out").inc()
            counts["sampled_out"] += 1
            return
        if len(self.tasks) >= self.limit:
            self.outcomes.labels("dropped_busy").inc()
            counts["dropped_busy"] += 1
            return
        self.outcomes.labels("sent").inc()
        counts["sent"] += 1
        task = asyncio.create_task(self._run(body, route, primary, headers))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, body: dict[str, Any], route: Route, primary: RequestTrace, headers: dict[str, str]) -> None:
        recorder = self.proxy.recorder
        trace = recorder.begin(route=route.name, operation=route.operation, chat=route.chat, headers=None,
                               request_id=primary.request_id, pd_mode=self.proxy.prefill is not None,
                               deployment="shadow", parent_ids=primary.ids)
        trace.set_request(body)
        try:
            await asyncio.wait_for(self.proxy.forward(body, route, trace, headers), self.timeout)
        except (ProxyError, UpstreamResponse) as err:
            trace.fail(err.status, err.error_type, err.message)
        except TimeoutError:
            trace.fail(504, "timeout", f"shadow request took longer than {self.timeout:g}s")
        except asyncio.CancelledError:
            trace.fail(499, "cancelled", "shadow request cancelled at shutdown")
            raise
        except Exception as exc:
            log.warning("shadow request %s failed: %r", trace.request_id, exc)
            trace.fail(500, "internal", str(exc))
        finally:
            if trace.error_type is not None:
                self.outcomes.labels("failed").inc()
                self.counts["failed"] += 1
            trace.finish()

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def status(self) -> dict[str, Any]:
        """`shadow` in /status: where copies go, how many, and what became of them (this process's)."""
        return {**target(self.settings), "in_flight": len(self.tasks), **self.counts}


def target(settings: Settings) -> dict[str, Any]:
    """The shadow's configuration as /status shows it."""
    return {"target": redact_url(settings.shadow_url or ""), "mode": "pd" if settings.shadow_prefill_urls else "single",
            "prefill": [redact_url(u) for u in settings.shadow_prefill_urls], "sample_rate": settings.shadow_sample_rate,
            "max_inflight": settings.shadow_max_inflight, "timeout_seconds": settings.shadow_timeout}


def describe(settings: Settings) -> str:
    """Start-up's line (with --shadow-url): where the copies go and within which bounds."""
    where = redact_url(settings.shadow_url or "")
    if settings.shadow_prefill_urls:
        where = (f"a P/D pool (decode {where}, prefill {', '.join(redact_url(u) for u in settings.shadow_prefill_urls)})")
    else:
        where = f"{where} (single instance)"
    return (f"shadow: a copy of {settings.shadow_sample_rate:.0%} of requests to {where}, at most "
            f"{settings.shadow_max_inflight} in flight, each within {settings.shadow_timeout:g} s; traced and counted "
            'with deployment="shadow", never seen by clients')
