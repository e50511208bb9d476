"""Shadow traffic: a sampled copy of live requests sent to a baseline, compared on identical input.

The shadow (one vLLM instance, or another P/D pool) gets the same body and request id; its answer
is read and thrown away. Its trace is a child of the primary's root span and its metrics carry
`deployment="shadow"`. It can never slow or fail the primary: copies run as background tasks,
at most `--shadow-max-inflight` at once (beyond that they are dropped and counted), each within
`--shadow-timeout`, and whatever happens to them never reaches the client.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import aiohttp

from pdproxy.admission import Admission
from pdproxy.config import Settings
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

    def mirror(self, body: dict[str, Any], route: Route, primary: RequestTrace, headers: dict[str, str]) -> None:
        """Maybe start a copy of this request; returns at once either way."""
        if self.rate < 1.0 and random.random() >= self.rate:
            self.outcomes.labels("sampled_out").inc()
            return
        if len(self.tasks) >= self.limit:
            self.outcomes.labels("dropped_busy").inc()
            return
        self.outcomes.labels("sent").inc()
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
            trace.finish()

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

