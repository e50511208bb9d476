"""The cluster in virtual time: simulated instances, the proxy's routing and P/D flow, a replayed client.

Every instance is the simulator's own `Engine` (pdproxy/sim/engine.py: batching, chunked prefill,
prefill-decode interference, KV blocks, prefix caching, the KV-arrival stall) on a `VirtualClock`;
KV transfers use the simulator's `KVLeases` and `TransferLink` (FIFO queueing on the prefill's
outgoing link) and its timing functions. What `pdproxy sim` adds around them (HTTP, tokenisation,
rendering) is replaced by the same delays it costs there: the preset's front-end time and one
loopback per HTTP leg. Routing uses pdproxy's policies (pdproxy.policies) exactly as the proxy
does: prefill and decode instance chosen when the request is admitted, in-flight counts per leg,
`load_aware` fed the engines' waiting/running/KV-usage every `load_metrics_interval` seconds. An instance may
die mid-replay (`Death`, a recorded run's failure): the proxy then retries, ejects and health-checks as pdproxy
does (pd.py, legs.py, pool.py), with pdproxy's own settings.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

from pdproxy import policies
from pdproxy.config import Settings
from pdproxy.legs import MAX_BACKOFF
from pdproxy.policies.load_aware import LoadAware, Reading
from pdproxy.sim.engine import Engine, Sequence
from pdproxy.sim.kv import PullOutcome, PullRejected, RemoteKV, SharedKVPath, TransferLink
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
    # the proxy's retries, ejection, health checks and --migrate-mid-stream: what it does when an instance dies
    proxy: Settings = field(default_factory=Settings)
    seed: int = 0  # of the API servers' jitter (preset frontend_jitter_ms), each instance its own stream
    # `pdproxy sim --time-scale`: the simulated instances that made a recording ran this many times slower than
    # their preset (the demo's 4), so a replay of their recording runs at that scale too
    time_scale: float = 1.0


@dataclass(frozen=True)
class Death:
    """An instance that dies (its process killed) `at` seconds into the replay: `role` prefill, decode or single,
    `index` its place in its pool. Its requests' connections break; the proxy does the rest (`_Cluster.serve`)."""

    role: str
    index: int
    at: float


class _Failed(Exception):
    """The request fails: the proxy has no attempt left (the client gets this error)."""


class _Broken(Exception):
    """One leg's connection failed because its instance is dead; `reached`: the instance had the request (a
    decode may have read its KV), else the connection was refused."""

    def __init__(self, message: str, reached: bool) -> None:
        super().__init__(message)
        self.reached = reached


class _Budget:
    """pdproxy.migration.Budget on the virtual clock: attempts left, and until when."""

    def __init__(self, retries: int, deadline: float) -> None:
        self.left, self.deadline = retries, deadline

    def take(self, now: float) -> bool:
        if self.left <= 0 or now >= self.deadline:
            return False
        self.left -= 1
        return True


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
        self.settings = SimSettings(role=role, preset=preset, engine_id=f"whatif-{name}",
                                    time_scale=cluster.params.time_scale)
        self.clock = clock
        self.puller = _Puller(cluster, clock, self.settings) if role == "decode" else None
        self.engine = Engine(self.settings, virtual.NullMetrics(), clock, self.puller,  # type: ignore[arg-type]
                             cluster.gpu)
        self.link = TransferLink.outgoing(self.settings, clock, cluster.gpu)  # type: ignore[arg-type]
        self.frontend = FrontEnd(preset, self.settings.time_scale,
                                 seed=zlib.crc32(f"{cluster.params.seed}:{name}".encode()))
        self.tokens = cluster.tokens  # the client's token times, by leg id (the last one moved by its finishing)
        self.loopback = cluster.params.loopback_ms / 1000.0
        self.task: asyncio.Future[None] | None = None  # the engine's step loop
        # what pdproxy's pool knows of it (pdproxy/pool.py): dead, found down by a health check, ejected
        self.dead = False
        self.probe_failed = False
        self.failures = 0  # failures in a row it is to blame for
        self.ejections = 0
        self.ejected_until = 0.0

    def available(self, now: float) -> bool:
        return not self.probe_failed and now >= self.ejected_until

    def die(self, health_check_interval: float) -> None:
        """The process is killed: its engine stops, every request in it fails with a broken connection, and the
        proxy's next health check (every `health_check_interval` s) finds it down."""
        self.dead = True
        if self.task is not None:
            self.task.cancel()
        self.engine.kill(f"instance {self.address} died")
        now = self.clock.now()
        if self.link.gpu is not None:
            self.link.gpu.leave(self.link.gpu_slot, now)
        if health_check_interval > 0:
            check = (math.floor(now / health_check_interval) + 1) * health_check_interval
            asyncio.get_running_loop().call_at(check, setattr, self, "probe_failed", True)

    async def generate(self, request_id: str, prompt_tokens: int, target: int, hashes: list[int],
                       hold_kv: bool = False, remote: RemoteKV | None = None) -> tuple[Sequence, float]:
        """One HTTP leg, as SimServer.generate times it: transit, front end, engine until done.

        Also returns the leg's front-end time (the API server's, loopback not included). Raises `_Broken` when
        the instance is dead or dies before the leg is done."""
        if self.dead:
            raise _Broken(f"{self.address} is unreachable (connection refused)", reached=False)
        arrival = self.clock.now()
        await self.clock.sleep(self.loopback)
        frontend = self.frontend.intake(self.clock.now())
        await self.clock.sleep(frontend)
        if self.dead:
            raise _Broken(f"{self.address} dropped the connection", reached=True)
        self.frontend.in_flight += 1
        try:
            seq = Sequence(request_id, prompt_tokens, target, "length", arrival, hold_kv=hold_kv, remote=remote,
                           block_hashes=hashes)
            self.engine.submit(seq)
            waiter = seq.wait(target)
            if waiter is not None:
                await waiter
            if seq.finish_reason in ("length", "stop"):  # its last output waits for the loop's earlier finishes
                finish = self.frontend.finished(self.clock.now())
                if finish > 0:
                    times = self.tokens.get(request_id)
                    if times:
                        times[-1] += finish
                    await self.clock.sleep(finish)
        finally:
            self.frontend.in_flight -= 1
        if self.dead and seq.finish_reason not in ("length", "stop"):
            raise _Broken(f"{self.address} broke the stream (its process died)", reached=True)
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
            if prefill.dead:
                return PullOutcome(False, reason="unreachable", message=f"cannot read KV from {prefill.address}")
            leases = prefill.engine.leases
            assert leases is not None
            try:
                lease = leases.claim(remote.engine_id, remote.request_id, remote.block_ids)
            except PullRejected as exc:
                return PullOutcome(False, reason=exc.reason, message=exc.message)
            # the prompt's blocks the decode lacks: the prefill's own and those its cache shares (RemoteKV.num_tokens)
            preset = prefill.settings.preset
            blocks = remote.read_blocks if remote.read_blocks is not None else \
                -(-(remote.num_tokens or 0) // preset.block_size) or lease.blocks_read
            nbytes = kv_bytes(preset, blocks)
            try:
                if self.cluster.kv_path is not None:
                    queued, total = await self.cluster.kv_path.transfer(prefill.link, self.engine_id, nbytes)
                else:
                    queued, total = await prefill.link.transfer(nbytes)
            finally:
                if not lease.stale:
                    leases.release(lease.request_id)
            if prefill.dead:
                return PullOutcome(False, reason="unreachable", message=f"{prefill.address} died during the read")
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
        self.tokens: dict[str, list[float]] = {}
        preset = params.preset
        # every instance on the recorded GPU (preset shared_gpu), their steps sharing it by gpu_share
        self.gpu = SharedGPU(preset.gpu_share if preset.shared_gpu else 0.0)
        # instances on one GPU: their KV reads, each decode's from each prefill in turn, sharing one rate while several
        # decodes read (preset kv_together_gbps); on GPUs of their own, each prefill's outgoing link
        self.kv_path = SharedKVPath(preset.kv_together_gbps * 1e9 / params.time_scale, clock,
                                    self.gpu if preset.kv_link_shares_gpu else None,
                                    preset.kv_pair_gbps * 1e9 / params.time_scale) if preset.shared_gpu else None
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

    # -- pdproxy's pools (pdproxy/pool.py) and retries (pdproxy/legs.py), on the virtual clock ----------------------
    def _choose(self, policy: Any, pool: list[_Instance], view: policies.RequestView | None,
                exclude: _Instance | None = None) -> _Instance:
        """`Pool.candidates` then the policy: the instances in rotation, else those that pass their health check
        (panic routing), `exclude` (the one that just failed) only when nothing else is left."""
        now = self.clock.now()
        others = [i for i in pool if i is not exclude]
        found = [i for i in others if i.available(now)] or [i for i in others if not i.probe_failed]
        if not found and exclude is not None and not exclude.probe_failed:
            found = [exclude]
        if not found:
            raise _Failed(f"no healthy {pool[0].role} instance available (all fail their health checks)")
        chosen, _ = policy.choose(found, view)
        return chosen  # type: ignore[no-any-return]

    def _charge(self, pool: list[_Instance], inst: _Instance) -> None:
        """`Pool.failed`: ejected after --eject-after-failures in a row, while the pool's share allows."""
        p = self.params.proxy
        inst.failures += 1
        now = self.clock.now()
        if not p.eject_after_failures or inst.failures < p.eject_after_failures or now < inst.ejected_until:
            return
        if sum(now < i.ejected_until for i in pool) >= min(len(pool) - 1, int(len(pool) * p.max_ejection_percent / 100)):
            return
        inst.ejections += 1
        inst.ejected_until = now + p.eject_seconds * min(inst.ejections, 6)
        inst.failures = 0

    async def _retry(self, policy: Any, pool: list[_Instance], failed: _Instance, budget: _Budget, tries: int,
                     why: str) -> _Instance:
        """`legs.retry`: the instance for the next attempt, after the backoff (its mean: no jitter)."""
        self._charge(pool, failed)
        if not budget.take(self.clock.now()):
            raise _Failed(why)
        chosen = self._choose(policy, pool, None, exclude=failed)
        p = self.params.proxy
        await self.clock.sleep(min(p.retry_backoff * 2 ** (tries - 1), MAX_BACKOFF))
        return chosen

    async def _prefill(self, rid: str, prompt_tokens: int, hashes: list[int], inst: _Instance) -> tuple[_Instance,
                                                                                                     Sequence]:
        """The prefill leg, retried on another prefill when it fails (--prefill-retries)."""
        budget, tries = None, 1
        while True:
            inst.inflight += 1
            try:
                seq, _ = await inst.generate(f"{rid}{tries}", prompt_tokens, 1, hashes, hold_kv=True)
                why = None if seq.held_blocks is not None else (seq.error or "prefill returned no KV")
            except _Broken as exc:
                why = str(exc)
            finally:
                inst.inflight -= 1
            if why is None:
                inst.failures = inst.ejections = 0
                return inst, seq
            budget = budget or _Budget(self.params.proxy.prefill_retries, math.inf)
            inst = await self._retry(self.prefill_policy, self.prefills, inst, budget, tries, why)
            tries += 1

    async def serve(self, req: Request, seq_no: int) -> Outcome:
        out = Outcome(req, seq_no, self.clock.now())
        try:
            await self._serve(req, out)
        except _Failed as exc:
            out.error = str(exc)
            # the proxy's error answer takes a round trip too: a closed-loop client whose every request fails
            # at once (no instance left) must not stop the clock
            await self.clock.sleep(max(self.params.loopback_ms / 1000.0, 0.001))
        return out

    async def _serve(self, req: Request, out: Outcome) -> None:
        """pdproxy's P/D flow (pdproxy/pd.py): place, prefill, decode; a decode that fails before its first token
        is retried on another decode, with a new prefill when the failed one may have read the KV; one that
        breaks after it goes on elsewhere with --migrate-mid-stream, else the request fails."""
        clock, p = self.clock, self.params.proxy
        ids = req.token_ids()
        view = policies.RequestView({"prompt": ids})
        hashes = block_hashes(ids, self.preset.block_size) if self.preset.block_size else []
        prefill = None
        if self.prefill_policy is not None:
            prefill = self._choose(self.prefill_policy, self.prefills, view)
        decode = self._choose(self.decode_policy, self.decodes, view)
        prompt, target, legs = req.prompt_tokens, req.output_tokens, 0
        remote, pseq = None, None

        async def prefill_on(inst: _Instance) -> tuple[_Instance, RemoteKV]:
            nonlocal pseq, legs
            legs += 1
            inst, pseq = await self._prefill(f"{req.request_id}-p{legs}.", prompt, hashes, inst)
            assert pseq.held_blocks is not None
            return inst, RemoteKV(inst.settings.engine_id, pseq.request_id, pseq.held_blocks, inst.address, 0,
                                  prompt, 1)

        if prefill is not None:
            prefill, remote = await prefill_on(prefill)
            out.prefill_instance = prefill.address  # where it succeeded, as pdproxy's pd.prefill.instance says
            assert pseq is not None
            out.queue = (pseq.scheduled_at or pseq.queued_at) - pseq.queued_at
            out.prefill_done = clock.now()  # the leg's one loopback (request and answer) was paid at its start
        times = out.token_times
        budget = _Budget(p.decode_retries, clock.now() + p.decode_deadline)
        tries, spent = 1, False  # spent: a failed decode may have read the hand-off's KV, never given out again
        while True:
            if spent and prefill is not None:
                prefill, remote = await prefill_on(self._choose(self.prefill_policy, self.prefills, None,
                                                                exclude=prefill))
                spent = False
            legs += 1
            rid, before = f"{req.request_id}-d{legs}", len(times)
            self.tokens[rid] = times
            decode.inflight += 1
            try:
                dseq, out.frontend = await decode.generate(rid, prompt, target, hashes, remote=remote)
                why = None if dseq.finish_reason in ("length", "stop") else (dseq.error or
                                                                             f"finished with {dseq.finish_reason}")
                reached = True
            except _Broken as exc:
                why, reached = str(exc), exc.reached
            finally:
                decode.inflight -= 1
                self.tokens.pop(rid, None)
            if why is None:
                decode.failures = decode.ejections = 0
                break
            got = len(times) - before
            if not got:  # before its first token: nothing reached the client (pd.py `_decode`)
                spent = spent or reached
                decode = await self._retry(self.decode_policy, self.decodes, decode, budget, tries, why)
                tries += 1
                continue
            # mid-stream (pd.py `_migrate`): the prompt and the tokens delivered prefilled anew, the rest decoded
            self._charge(self.decodes, decode)
            if not p.migrate_mid_stream or not budget.take(clock.now()):
                raise _Failed(why)
            prompt, target = prompt + got, target - got
            if prefill is not None:
                prefill, remote = await prefill_on(self._choose(self.prefill_policy, self.prefills, None))
            decode = self._choose(self.decode_policy, self.decodes, None, exclude=decode)
        out.decode_instance = decode.address
        if prefill is None:
            out.queue = (dseq.scheduled_at or dseq.queued_at) - dseq.queued_at
        else:
            out.decode_queue = (dseq.scheduled_at or dseq.queued_at) - dseq.arrival
            assert pseq is not None
            q = self.transfers.pop(pseq.request_id, None)
            if q is not None:
                out.kv_queued, out.kv_transfer = q
        out.first_token = times[0] if times else None
        out.end = clock.now()


async def _replay(workload: Workload, setup: Setup, params: ModelParams, clock: virtual.VirtualClock,
                  deaths: tuple[Death, ...]) -> list[Outcome]:
    cluster = _Cluster(setup, params, clock)
    for req in workload.warm_prompts():
        hashes = block_hashes(req.token_ids(), cluster.preset.block_size) if cluster.preset.block_size else []
        for inst in cluster.instances:
            inst.engine.warm(hashes)
    engines = []
    for inst in cluster.instances:
        inst.task = asyncio.ensure_future(inst.engine.run())
        engines.append(inst.task)
    loop = asyncio.get_running_loop()
    for death in deaths:
        pool = cluster.prefills if death.role == "prefill" else cluster.decodes
        if death.index >= len(pool):
            raise ValueError(f"set-up {setup.name} has no {death.role} instance #{death.index} to die")
        loop.call_at(death.at, pool[death.index].die, params.proxy.health_check_interval)
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


def simulate(workload: Workload, setup: Setup, params: ModelParams, deaths: tuple[Death, ...] = ()) -> list[Outcome]:
    """Replay `workload` on `setup` in virtual time, with the instances in `deaths` dying on the way; one outcome
    per request sent."""
    return virtual.run(lambda clock: _replay(workload, setup, params, clock, deaths))


def median_gap(out: Outcome) -> float | None:
    t = out.token_times
    return statistics.median(b - a for a, b in zip(t, t[1:])) if len(t) > 1 else None
