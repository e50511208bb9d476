"""Drive one workload against one endpoint and write the record file.

Clock rule: every interval is measured on this process's monotonic clock; wall-clock start
times are that clock shifted by one anchor taken at the start of the run, so records from one
run never jump with NTP and can still be lined up with trace timestamps.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp

from pdproxy import __version__
from pdproxy.bench import client, engine_counters, prefixes, prompts, records, stats
from pdproxy.bench.workload import PlannedRequest, Workload, arrival_times, class_requests

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class Target:
    """Where requests go and how."""

    url: str
    api_key: str | None = None
    timeout: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)
    engine_metrics: list[str] = field(default_factory=list)  # instances whose counters frame the run

    def auth_headers(self) -> dict[str, str]:
        """The extra headers and the bearer token every request (and every /tokenize call) carries."""
        return {**self.headers, **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}


@dataclass
class RunResult:
    path: Path
    header: dict[str, Any]
    summary: dict[str, Any]
    records: list[dict[str, Any]]


class _Run:
    """State shared by the senders of one run."""

    def __init__(self, wl: Workload, target: Target, writer: records.RecordWriter, header: dict[str, Any],
                 save_text: bool, on_done: Callable[[dict[str, Any]], None], sized: prompts.Prompts):
        self.wl, self.target, self.writer, self.header = wl, target, writer, header
        self.save_text, self.on_done = save_text, on_done
        self.run_id: str = header["run_id"]
        self.prefix: str = header["request_id_prefix"]
        self.url = target.url.rstrip("/") + ROUTES[wl.endpoint]
        self.t0 = time.perf_counter()
        self.wall0 = time.time()
        self.seq = 0
        self.per_class: dict[str, int] = {}
        self.records: list[dict[str, Any]] = []
        self.iters = [class_requests(wl, i) for i in range(len(wl.classes))]
        self.prompts = sized
        self.shapers = {c.name: prefixes.PrefixShaper.of(wl, i, sized) for i, c in enumerate(wl.classes)}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def may_send(self, ci: int) -> bool:
        c = self.wl.classes[ci]
        if self.wl.requests is not None and self.seq >= self.wl.requests:
            return False
        if self.wl.duration is not None and self.elapsed() >= self.wl.duration:
            return False
        if c.requests is not None and self.per_class.get(c.name, 0) >= c.requests:
            return False
        return True

    def take(self, ci: int) -> tuple[PlannedRequest, int]:
        req = next(self.iters[ci])
        seq = self.seq
        self.seq += 1
        self.per_class[req.cls] = self.per_class.get(req.cls, 0) + 1
        return req, seq

    async def one(self, session: aiohttp.ClientSession, req: PlannedRequest, seq: int) -> None:
        request_id = f"{self.prefix}{req.cls}-{req.index}"
        traceparent, trace_id, _ = client.new_traceparent()
        headers = {"X-Request-Id": request_id, "traceparent": traceparent, **self.target.auth_headers()}
        text, words = self.prompts.make(req)
        body, words, asked = self.shapers[req.cls].wrap(req.index, text, words, req.prompt_tokens,
                                                        req.body(self.wl, text))
        start, outcome = await client.send(
            session, self.url, body, headers,
            chat=self.wl.endpoint == "chat", timeout=self.target.timeout, save_text=self.save_text,
        )
        start_offset = start - self.t0
        warmup = seq < self.wl.warmup_requests or start_offset < self.wl.warmup_seconds
        rec = records.request_record(
            run_id=self.run_id, request_id=request_id, trace_id=trace_id, cls=req.cls, index=req.index,
            seq=seq, warmup=warmup, start_wall=self.wall0 + start_offset, start_offset=start_offset,
            prompt_words=words, prompt_tokens_requested=asked, max_tokens=req.max_tokens,
            outcome=outcome,
        )
        self.prompts.observe(words, outcome.prompt_tokens)
        self.records.append(rec)
        self.writer.write(rec)
        self.on_done(rec)

    async def closed_loop(self, session: aiohttp.ClientSession, ci: int) -> None:
        while self.may_send(ci):
            req, seq = self.take(ci)
            await self.one(session, req, seq)

    async def open_loop(self, session: aiohttp.ClientSession, ci: int) -> None:
        tasks: set[asyncio.Task[None]] = set()
        for at in arrival_times(self.wl, ci):
            delay = at - self.elapsed()
            if self.wl.duration is not None and at >= self.wl.duration:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            if not self.may_send(ci):
                break
            req, seq = self.take(ci)
            t = asyncio.ensure_future(self.one(session, req, seq))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)


def make_header(wl: Workload, target: Target, label: str, conditions: dict[str, Any],
                sweep: dict[str, Any] | None = None) -> dict[str, Any]:
    run_id = secrets.token_hex(4)
    return {
        "type": "run",
        "format": records.FORMAT,
        "run_id": run_id,
        "label": label,
        "request_id_prefix": f"bench-{run_id}-",
        "target": target.url,
        "route": ROUTES[wl.endpoint],
        "bench_version": __version__,
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "conditions": dict(conditions),
        "workload": wl.to_dict(),
        "sweep": sweep,
        "definitions": {
            "ttft": "client start -> first token-bearing SSE message",
            "itl": "gaps between token-bearing SSE messages (per token when usage is streamed per chunk)",
            "warmup": f"first {wl.warmup_requests} requests and requests started in the first {wl.warmup_seconds:g}s",
        },
    }


async def run_async(wl: Workload, target: Target, out: Path, header: dict[str, Any], *,
                    save_text: bool = False, progress: Any = None,
                    stall_threshold: float = stats.DEFAULT_STALL_THRESHOLD,
                    on_prompts: Callable[[prompts.Prompts], None] | None = None) -> RunResult:
    """Run the workload to completion (or cancellation) and write header, records and summary.

    First the prompts are sized on the server (bench/prompts.py; `on_prompts` hears how, once): a
    workload the server cannot take stops there with a WorkloadError, before any request or file."""
    counts = {"ok": 0, "failed": 0}
    interrupted = False
    tasks: list[asyncio.Task[None]] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        if not wl.model:
            wl.model = header["workload"]["model"] = await prompts.served_model(session, target.url,
                                                                                target.auth_headers(), target.timeout)
        sized = await prompts.prepare(session, target.url, target.auth_headers(), wl, target.timeout)
        header["prompts"] = sized.describe()
        if on_prompts is not None:
            on_prompts(sized)
        writer = records.RecordWriter(out)
        writer.write(header)

        def on_done(rec: dict[str, Any]) -> None:
            counts["ok" if rec["ok"] else "failed"] += 1
            if progress is not None:
                progress(state, counts)

        state = _Run(wl, target, writer, header, save_text, on_done, sized)
        if progress is not None:
            progress(state, counts)
        counters: dict[str, Any] | None = None
        try:
            before = await engine_counters.snapshot(session, target.engine_metrics) if target.engine_metrics else None
            for ci, c in enumerate(wl.classes):
                if c.concurrency is not None:
                    tasks += [asyncio.ensure_future(state.closed_loop(session, ci)) for _ in range(c.concurrency)]
                else:
                    tasks.append(asyncio.ensure_future(state.open_loop(session, ci)))
            ticker = asyncio.ensure_future(_tick(state, counts, progress))
            try:
                await asyncio.gather(*tasks)
            finally:
                ticker.cancel()
            if before is not None:
                counters = engine_counters.delta(before, await engine_counters.snapshot(session, target.engine_metrics))
        except asyncio.CancelledError:
            interrupted = True
            for t in tasks:
                t.cancel()
        finally:
            summary = {
                "type": "summary",
                "run_id": header["run_id"],
                "label": header["label"],
                "wall_s": round(state.elapsed(), 3),
                "interrupted": interrupted,
                "conditions": header["conditions"],
                "stats": stats.run_stats(state.records, stall_threshold=stall_threshold),
            }
            if counters is not None:
                summary["engine_counters"] = counters
            writer.write(summary)
            writer.close()
    if interrupted:
        raise asyncio.CancelledError
    return RunResult(out, header, summary, state.records)


async def _tick(state: _Run, counts: dict[str, int], progress: Any) -> None:
    """Refresh a duration-based progress bar even when no request finishes."""
    if progress is None:
        return
    while True:
        await asyncio.sleep(0.25)
        progress(state, counts)
