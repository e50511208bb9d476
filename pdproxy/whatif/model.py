"""The cluster in virtual time: simulated instances, the proxy's routing and P/D flow, a replayed client.

Every instance is the simulator's own `Engine` (pdproxy/sim/engine.py: batching, chunked prefill,
prefill-decode interference, KV blocks, prefix caching, the KV-arrival stall) on a `VirtualClock`;
KV transfers use the simulator's `KVLeases` and `TransferLink` (FIFO queueing on the prefill's
outgoing link) and its timing functions. What `pdproxy sim` adds around them (HTTP, tokenisation,
rendering) is replaced by the same delays it costs there: the preset's front-end time and one
loopback per HTTP leg. Routing uses pdproxy's policies (pdproxy.policies) exactly as the proxy
does: prefill and decode instance chosen when the request is admitted, in-flight counts per leg,
`load_aware` fed the engines' waiting/running/KV-usage every `load_metrics_interval` seconds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

from pdproxy import policies
from pdproxy.policies.load_aware import LoadAware, Reading
from pdproxy.sim.engine import Engine, Sequence
from pdproxy.sim.kv import PullOutcome, PullRejected, RemoteKV, TransferLink
from pdproxy.sim.prefix_cache import block_hashes
from pdproxy.sim.presets import SIM_LOOPBACK_MS, Preset
from pdproxy.sim.settings import SimSettings
from pdproxy.sim.timing import FrontEnd, SharedGPU, kv_bytes
from pdproxy.whatif import virtual
from pdproxy.whatif.setups import Setup
from pdproxy.whatif.workload import Request, Workload


@dataclass(frozen=True)
class ModelParams:
    preset: Preset
    single_policy: str = "cache_aware"
    prefill_policy: str = "cache_aware"
    decode_policy: str = "load_aware"
    policy_params: dict[str, Any] = field(default_factory=dict)
    loopback_ms: float = SIM_LOOPBACK_MS  # one HTTP leg's cost (request and first answer), left out of the curves


@dataclass
class Outcome:
    """One request as the model saw it (seconds, virtual clock)."""

    request: Request
    seq: int
    start: float
    first_token: float | None = None
    end: float | None = None
    token_times: list[float] = field(default_factory=list)
    prefill_instance: str | None = None
    decode_instance: str | None = None
    queue: float = 0.0  # engine queue of the first leg
    frontend: float = 0.0  # the API server's time of the leg that streams (pdproxy.sim.timing.FrontEnd)
    prefill_done: float | None = None  # P/D: the prefill's answer reached the proxy
    kv_queued: float | None = None  # P/D: wait for the prefill's link
    kv_transfer: float | None = None  # P/D: the transfer itself, queueing included
    decode_queue: float | None = None  # P/D: decode arrival -> scheduled (KV pull included, as vLLM's)
    error: str | None = None


class _Instance:
    """One simulated instance: what routing policies read (url, address, inflight) and its engine."""

    def __init__(self, name: str, role: str, preset: Preset, clock: virtual.VirtualClock,
                 cluster: _Cluster) -> None:
        self.url = f"http://{name}"
        self.address = name
        self.inflight = 0
        self.role = role
        self.settings = SimSettings(role=role, preset=preset, engine_id=f"whatif-{name}")
        self.clock = clock
        self.puller = _Puller(cluster, clock, self.settings) if role == "decode" else None
        self.engine = Engine(self.settings, virtual.NullMetrics(), clock, self.puller,  # type: ignore[arg-type]
                             cluster.gpu)
        bandwidth = preset.kv_bandwidth_gbps * 1e9
        self.link = TransferLink(bandwidth if bandwidth > 0 else 0.0, self.settings.scaled(preset.kv_latency_ms),
                                 clock)  # type: ignore[arg-type]
        self.link.share_gpu(cluster.gpu)
        self.frontend = FrontEnd(preset, self.settings.time_scale)
        self.loopback = cluster.params.loopback_ms / 1000.0

    async def generate(self, request_id: str, prompt_tokens: int, target: int, hashes: list[int],
                       hold_kv: bool = False, remote: RemoteKV | None = None) -> tuple[Sequence, float]:
        """One HTTP leg, as SimServer.generate times it: transit, front end, engine until done.

        Also returns the leg's front-end time (the API server's, loopback not included)."""
        arrival = self.clock.now()
        await self.clock.sleep(self.loopback)
        frontend = self.frontend.intake(self.clock.now())
        await self.clock.sleep(frontend)
        self.frontend.in_flight += 1
        try:
            seq = Sequence(request_id, prompt_tokens, target, "length", arrival, hold_kv=hold_kv, remote=remote,
                           block_hashes=[] if remote is not None else hashes)
            self.engine.submit(seq)
            waiter = seq.wait(target)
            if waiter is not None:
                await waiter
        finally:
            self.frontend.in_flight -= 1
        return seq, frontend


class _Puller:
    """The decode's KV read (pdproxy.sim.kv.KVPuller's part) without HTTP: claim, queue on the link, free."""

    def __init__(self, cluster: _Cluster, clock: virtual.VirtualClock, settings: SimSettings) -> None:
        self.cluster = cluster
        self.clock = clock
        self.engine_id = settings.engine_id
        self.overhead = settings.scaled(settings.preset.kv_pull_overhead_ms)
        self.heartbeat_interval = settings.kv_lease_seconds / 6
        self.active = 0

    async def pull(self, remote: RemoteKV, fail: bool = False) -> PullOutcome:
        self.active += 1
        try:
            # the overhead, then the simulated read's HTTP round trip (both in `pdproxy sim`'s hand-off)
            await self.clock.sleep(self.overhead + self.cluster.params.loopback_ms / 1000.0)
            prefill = self.cluster.by_engine[remote.engine_id]
            leases = prefill.engine.leases
            assert leases is not None
            try:
                lease = leases.claim(remote.engine_id, remote.request_id, remote.block_ids)
            except PullRejected as exc:
                return PullOutcome(False, reason=exc.reason, message=exc.message)
            nbytes = kv_bytes(prefill.settings.preset, len(lease.blocks))
            try:
                queued, total = await prefill.link.transfer(nbytes)
            finally:
                if not lease.stale:
                    leases.release(lease.request_id)
            self.cluster.transfers[remote.request_id] = (queued, total)
            return PullOutcome(True, nbytes=nbytes, seconds=total)
        finally:
            self.active -= 1

    async def keep_alive(self, remote: RemoteKV, started: asyncio.Event) -> None:
        leases = self.cluster.by_engine[remote.engine_id].engine.leases
        while True:
            try:
                await asyncio.wait_for(started.wait(), self.heartbeat_interval)
                return
            except TimeoutError:
                if leases is not None:
                    leases.heartbeat(remote.engine_id, remote.request_id)


class _Cluster:
    def __init__(self, setup: Setup, params: ModelParams, clock: virtual.VirtualClock) -> None:
        self.setup = setup
        self.params = params
        self.clock = clock
        self.transfers: dict[str, tuple[float, float]] = {}
        preset = params.preset
        self.gpu = SharedGPU(preset.gpu_share)  # every instance on the recorded GPUs (when gpu_share > 0)
        if setup.chunk is not None:
            preset = replace(preset, enable_chunked_prefill=True, max_num_batched_tokens=setup.chunk)
        self.preset = preset
        if setup.mode == "pd":
            self.prefills = [_Instance(f"prefill-{i}", "prefill", preset, clock, self) for i in range(setup.prefills)]
            self.decodes = [_Instance(f"decode-{i}", "decode", preset, clock, self) for i in range(setup.decodes)]
            self.prefill_policy = policies.create(params.prefill_policy, params.policy_params)
            self.decode_policy = policies.create(params.decode_policy, params.policy_params)
        else:
            self.prefills = []
            self.decodes = [_Instance(f"single-{i}", "single", preset, clock, self) for i in range(setup.singles)]
            self.prefill_policy = None
            self.decode_policy = policies.create(params.single_policy, params.policy_params)
        self.instances = [*self.prefills, *self.decodes]
        self.by_engine = {i.settings.engine_id: i for i in self.instances}
        self.tokens: dict[str, list[float]] = {}
        for inst in self.instances:
            inst.engine.on_token = self._on_token

    def _on_token(self, seq: Sequence, now: float) -> None:
        times = self.tokens.get(seq.request_id)
        if times is not None:
            times.append(now)

    async def feed_load(self) -> None:
        """What `load_aware` reads from /metrics, refreshed every interval of virtual time."""
        wanted = [(p, pool) for p, pool in ((self.prefill_policy, self.prefills), (self.decode_policy, self.decodes))
                  if isinstance(p, LoadAware)]
        if not wanted:
            return
        interval = min(p.interval for p, _ in wanted)
        while True:
            for policy, pool in wanted:
                for inst in pool:
                    e = inst.engine
                    policy.readings[inst.url] = Reading(
                        float(len(e.waiting) + len(e.ready) + len(e.loading)), float(len(e.running)), e.pool.usage,
                        time.monotonic())  # wall time: the policy judges staleness by it, and it is fresh
            await asyncio.sleep(interval)

    async def serve(self, req: Request, seq_no: int) -> Outcome:
        clock = self.clock
        out = Outcome(req, seq_no, clock.now())
        ids = req.token_ids()
        view = policies.RequestView({"prompt": ids})
        hashes = block_hashes(ids, self.preset.block_size) if self.preset.block_size else []
        prefill = None
        if self.prefill_policy is not None:
            prefill, _ = self.prefill_policy.choose(self.prefills, view)
        assert self.decode_policy is not None
        decode, _ = self.decode_policy.choose(self.decodes, view)
        out.prefill_instance = prefill.address if prefill else None
        out.decode_instance = decode.address
        remote = None
        if prefill is not None:
            prefill.inflight += 1
            try:
                pseq, _ = await prefill.generate(f"{req.request_id}-p", req.prompt_tokens, 1, hashes, hold_kv=True)
            finally:
                prefill.inflight -= 1
            out.queue = (pseq.scheduled_at or pseq.queued_at) - pseq.queued_at
            out.prefill_done = clock.now()  # the leg's one loopback (request and answer) was paid at its start
            if pseq.held_blocks is None:
                out.error = pseq.error or "prefill returned no KV"
                return out
            remote = RemoteKV(prefill.settings.engine_id, pseq.request_id, pseq.held_blocks, prefill.address, 0,
                              req.prompt_tokens, 1)
        rid = f"{req.request_id}-d"
        times = self.tokens[rid] = out.token_times
        decode.inflight += 1
        try:
            dseq, out.frontend = await decode.generate(rid, req.prompt_tokens, req.output_tokens, hashes, remote=remote)
        finally:
            decode.inflight -= 1
            self.tokens.pop(rid, None)
        if dseq.finish_reason not in ("length", "stop"):
            out.error = dseq.error or f"finished with {dseq.finish_reason}"
            return out
        if prefill is None:
            out.queue = (dseq.scheduled_at or dseq.queued_at) - dseq.queued_at
        else:
            out.decode_queue = (dseq.scheduled_at or dseq.queued_at) - dseq.arrival
            q = self.transfers.pop(f"{req.request_id}-p", None)
            if q is not None:
                out.kv_queued, out.kv_transfer = q
        out.first_token = times[0] if times else None
        out.end = clock.now()
        return out


async def _replay(workload: Workload, setup: Setup, params: ModelParams, clock: virtual.VirtualClock) -> list[Outcome]:
    cluster = _Cluster(setup, params, clock)
    for req in workload.warm_prompts():
        hashes = block_hashes(req.token_ids(), cluster.preset.block_size) if cluster.preset.block_size else []
        for inst in cluster.instances:
            inst.engine.warm(hashes)
    engines = [asyncio.ensure_future(i.engine.run()) for i in cluster.instances]
    feeder = asyncio.ensure_future(cluster.feed_load())
    outcomes: list[Outcome] = []
    counter = iter(range(1 << 62))

    async def one(req: Request) -> None:
        outcomes.append(await cluster.serve(req, next(counter)))

    async def open_loop(reqs: list[Request]) -> None:
        pending = []
        for req in reqs:
            await clock.sleep_until(req.arrival)
            pending.append(asyncio.ensure_future(one(req)))
        await asyncio.gather(*pending)

    async def closed_loop(reqs: list[Request], concurrency: int, duration: float) -> None:
        taken = iter(range(1 << 62))
        # each client starts when the recorded one did: a millisecond apart is a step apart, and clients that
        # start in different steps stay out of phase (one's prefill lands in the others' decode), as recorded
        starts = sorted(r.arrival for r in reqs)[:concurrency]

        async def worker(first: float) -> None:
            await clock.sleep_until(first)
            while clock.now() < duration:
                i = next(taken)
                await one(reqs[i % len(reqs)].again(i, len(reqs)))

        await asyncio.gather(*(worker(starts[k] if k < len(starts) else 0.0) for k in range(concurrency)))

    drivers = []
    for cls in workload.classes:
        if not cls.requests:
            continue
        if cls.concurrency:
            drivers.append(closed_loop(cls.requests, cls.concurrency, workload.duration or cls.requests[-1].arrival))
        else:
            drivers.append(open_loop(cls.requests))
    try:
        await asyncio.gather(*drivers)
    finally:
        feeder.cancel()
        for task in engines:
            task.cancel()
    outcomes.sort(key=lambda o: o.seq)
    return outcomes


def simulate(workload: Workload, setup: Setup, params: ModelParams) -> list[Outcome]:
    """Replay `workload` on `setup` in virtual time; one outcome per request sent."""
    return virtual.run(lambda clock: _replay(workload, setup, params, clock))


def median_gap(out: Outcome) -> float | None:
    t = out.token_times
    return statistics.median(b - a for a, b in zip(t, t[1:])) if len(t) > 1 else None
