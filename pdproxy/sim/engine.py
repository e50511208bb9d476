"""The simulated engine core: a continuous-batching step loop in the manner of vLLM's V1 scheduler.

Each iteration ("step") the scheduler builds a batch under a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):

1. running sequences first, in admission order: one token for each decoding sequence, the next
   prompt chunk for one that is still prefilling;
2. then waiting sequences in FCFS order, as long as budget, KV blocks and the sequence cap allow.
   With chunked prefill a prompt is cut to the remaining budget; without it a prompt must fit
   whole, except that a prompt longer than the entire budget runs whole in a step of its own
   prefill (vLLM would refuse to start with such a budget; the simulator lets it run, which is
   what "one big step" means).

A request that computes its prompt locally first looks up its longest cached prefix
(pdproxy/sim/prefix_cache.py, vLLM's automatic prefix caching): those tokens count as computed
and cost no step time. KV blocks are allocated as tokens are computed. When a running sequence needs a block and none
is free, the newest running sequence is preempted (its blocks freed, recomputed later), as V1
does; waiting sequences simply queue until blocks are free.

The step then "runs" for the cost model's time (decode time of the batch size plus the extra time
of the step's prefill tokens), and every sequence whose known tokens are all computed samples one
new token at the end of the step. Output therefore moves in lockstep, and a long prefill in a step
delays every running stream: the stall the simulator exists to show.

A decode-side request carrying remote-prefill params first gets blocks for its whole prompt, then
waits (counted as waiting, like vLLM's WAITING_FOR_REMOTE_KVS) while the KV is pulled; after a
successful pull only the last prompt token is recomputed (a one-token step), and a failed pull
finishes the request with an error. A KV that lands while a pull from another prefill is still in the
decode's hands goes through the decode's intake first (preset `kv_intake_gbps`): one at a time, at the
intake's rate, as the recorded 2P2D runs' decodes took in KV from two prefills; with `kv_intake_bursts` by
batches, each released when its last KV is in.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from pdproxy.sim.kv import BlockPool, KVLeases, KVPuller, PullOutcome, RemoteKV, TransferLink
from pdproxy.sim.metrics import SimMetrics
from pdproxy.sim.prefix_cache import UNBOUNDED_BLOCKS, PrefixCache
from pdproxy.sim.settings import SimSettings
from pdproxy.sim.timing import PreciseClock, SharedGPU, kv_link_seconds

# Steps follow an ideal timeline (each starts where the previous one ended), so the host's
# scheduling hiccups do not slow the simulated GPU down: a late wake-up is made up by the next
# steps. Behind by more than this (the process is overloaded), the timeline restarts from now.
LAG_RESET_S = 0.05

log = logging.getLogger("pdproxy.sim")

WAITING, LOADING_KV, RUNNING, FINISHED = "waiting", "loading_kv", "running", "finished"


class Sequence:
    """One request inside the engine, plus the hooks its HTTP handler waits on."""

    __slots__ = ("request_id", "prompt_tokens", "target_tokens", "target_reason", "hold_kv", "remote",
                 "kv_fail", "arrival", "queued_at", "scheduled_at", "first_token_at", "last_token_at",
                 "finished_at", "num_computed", "num_generated", "blocks", "state", "finish_reason", "error",
                 "kv_loaded", "held_blocks", "pull", "pull_started", "stalls_until", "block_hashes", "cached_blocks", "shared",
                 "_waiter", "_threshold")

    def __init__(self, request_id: str, prompt_tokens: int, target_tokens: int, target_reason: str,
                 arrival: float, hold_kv: bool = False, remote: RemoteKV | None = None,
                 kv_fail: bool = False, block_hashes: list[int] | None = None) -> None:
        self.request_id = request_id  # internal id (with vLLM's random suffix)
        self.prompt_tokens = prompt_tokens
        self.target_tokens = target_tokens  # tokens to generate before finishing
        self.target_reason = target_reason  # "length" or "stop"
        self.hold_kv = hold_kv  # prefill side of P/D: keep the blocks for a remote decode
        self.remote = remote  # decode side of P/D: where to pull the prompt's KV from
        self.kv_fail = kv_fail  # injected KV load failure
        self.arrival = arrival  # at the HTTP front end
        self.queued_at = arrival
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None
        self.num_computed = 0  # tokens whose KV exists
        self.num_generated = 0
        self.blocks: list[int] = []
        self.state = WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.kv_loaded = False
        self.stalls_until = 0.0  # decode with kv_pull_stalls_decode: no step before this while its KV loads
        self.held_blocks: list[int] | None = None  # blocks left under a lease when finished
        self.pull: PullOutcome | None = None
        self.pull_started: asyncio.Event | None = None
        self.block_hashes = block_hashes or []  # the prompt's full blocks, chained (prefix caching)
        self.cached_blocks = 0  # leading blocks of the prompt already in the prefix cache
        self.shared = 0  # of those, found cached when it was admitted: vLLM shares them, it holds no copy of its own
        self._waiter: asyncio.Future[None] | None = None
        self._threshold = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_generated

    @property
    def finished(self) -> bool:
        return self.state is FINISHED

    def wait(self, threshold: int) -> asyncio.Future[None] | None:
        """A future that resolves once `threshold` tokens exist or the sequence finished (None if so now)."""
        if self.num_generated >= threshold or self.state is FINISHED:
            return None
        self._threshold = threshold
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def _notify(self, force: bool = False) -> None:
        waiter = self._waiter
        if waiter is not None and (force or self.num_generated >= self._threshold):
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


class IntakeBatch:
    """KV a decode's intake copies in together and releases to its scheduler together."""

    __slots__ = ("pending", "done")

    def __init__(self) -> None:
        self.pending = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def release(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class Engine:
    """One engine core. `run()` is the step loop; handlers `submit()` and `abort()` sequences."""

    def __init__(self, settings: SimSettings, metrics: SimMetrics, clock: PreciseClock,
                 puller: KVPuller | None, gpu: SharedGPU | None = None) -> None:
        self.settings = settings
        p = settings.preset
        self.cost = settings.cost_model()
        self.metrics = metrics
        self.clock = clock
        self.block_size = p.block_size
        self.budget = p.max_num_batched_tokens
        self.max_num_seqs = p.max_num_seqs
        self.chunked = p.enable_chunked_prefill
        self.lookahead = p.async_scheduling
        self.pool = BlockPool(0 if settings.instant else p.num_gpu_blocks)  # instant: no capacity limits
        self.prefix_cache = PrefixCache(settings.enable_prefix_caching)
        self.leases = KVLeases(settings.engine_id, self.pool, settings.kv_lease_seconds, metrics,
                               on_free=self._wake) if settings.has_connector else None
        self.puller = puller
        # instances time-sharing one GPU stretch each other's steps (preset gpu_share; None: a GPU of its own)
        self.gpu = gpu if gpu is not None and p.gpu_share > 0 and not p.instant else None
        self.gpu_slot = self.gpu.slot() if self.gpu is not None else 0
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.ready: collections.deque[Sequence] = collections.deque()  # KV loaded, one token to go
        self.running: list[Sequence] = []
        self.loading: set[Sequence] = set()
        # several prefills feeding this decode at once: KV taken in one at a time (None: no such intake)
        intake = p.kv_intake_gbps * 1e9 / settings.time_scale
        self.intake = TransferLink(intake, 0.0, clock) if puller is not None and intake > 0 and not p.instant \
            else None
        self.taking_from: collections.Counter[str] = collections.Counter()  # prefill engine -> KVs in our hands
        self.intake_bursts = p.kv_intake_bursts
        self._copying: IntakeBatch | None = None  # the batch of KV the intake copies now
        self._next: IntakeBatch | None = None  # KV that arrived meanwhile: copied, and released, as the next batch
        if self.intake is not None:  # same-GPU NIXL: the copy-in time-shares the GPU like a step
            self.intake.share_gpu(self.gpu, self.gpu_slot)
        self._wakeup = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.steps = 0
        self.preemptions = 0
        self.requests_total = 0
        self.busy_seconds = 0.0
        # steps that started more than LAG_RESET_S after the timeline's ideal end, and the time so lost: the host
        # did not keep up (pdproxy/sim/cli.py warns)
        self.late_steps = 0
        self.late_seconds = 0.0
        # called with (sequence, time) for every token sampled, before the sequence's own bookkeeping; the
        # virtual-time model (pdproxy/whatif) reads each request's token times through it
        self.on_token: Callable[[Sequence, float], None] | None = None

    # ---- requests in and out ---------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        self.requests_total += 1
        seq.queued_at = self.clock.now()
        if self.settings.instant:
            self._run_instantly(seq)
            return
        self.waiting.append(seq)
        self._publish()
        self._wake()

    def abort(self, seq: Sequence) -> None:
        """The client went away: drop the sequence wherever it is and free its blocks."""
        if seq.state is FINISHED:
            return
        if seq.state is RUNNING and seq in self.running:
            self.running.remove(seq)
        for queue in (self.waiting, self.ready):
            try:
                queue.remove(seq)
            except ValueError:
                pass
        self.loading.discard(seq)
        self._finish(seq, "abort", self.clock.now())

    def kill(self, message: str) -> None:
        """The instance's process died (the what-if replaying a recorded failure): its KV pulls stop, the KV it
        held for decodes is gone, it stops sharing the GPU, and every request in it fails. The caller stops
        `run()`."""
        for task in list(self._tasks):
            task.cancel()
        if self.leases is not None:
            self.leases.release_all()
        if self.gpu is not None:
            self.gpu.leave(self.gpu_slot, self.clock.now())
        self._fail_all(message)

    def _wake(self) -> None:
        self._wakeup.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- the step loop -------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not leave every request hanging: fail them and go on
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all("internal simulator error")
                await asyncio.sleep(0.01)

    def _fail_all(self, message: str) -> None:
        now = self.clock.now()
        for seq in [*self.running, *self.waiting, *self.ready, *self.loading]:
            if seq.state is not FINISHED:
                self._finish(seq, "error", now, error=message)
        self.running.clear()
        self.waiting.clear()
        self.ready.clear()
        self.loading.clear()

    async def _loop(self) -> None:
        ideal_end: float | None = None
        step_start = 0.0
        stall_on_pull = self.settings.preset.kv_pull_stalls_decode
        while True:
            now = self.clock.now()
            if stall_on_pull and self.loading:
                # the KV being copied in holds the GPU for the transfer's own link time: no step now
                until = max(seq.stalls_until for seq in self.loading)
                if self.intake is not None and self.intake.in_flight:
                    until = max(until, self.intake.busy_until)
                if until > now:
                    ideal_end = None
                    await self.clock.sleep_until(until)
                    continue
            now = self.clock.now()
            # async scheduling: the step after the one just run was scheduled when that one started, so a prompt
            # submitted since waits a step more; with nothing else to run the GPU would idle, and vLLM schedules it now
            ahead = self.lookahead and ideal_end is not None and bool(self.running or self.ready)
            batch, prefill_tokens = self._schedule(now, step_start if ahead else now)
            if not batch:
                ideal_end = None
                self._publish()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            duration = self.cost.step_seconds(len(batch), prefill_tokens)
            start = now if ideal_end is None or now - ideal_end > LAG_RESET_S else ideal_end
            if ideal_end is not None and start == now and now > ideal_end:  # the lag is lost: said by `pdproxy sim`
                self.late_steps += 1
                self.late_seconds += now - ideal_end
            if self.gpu is not None:
                duration = self.gpu.stretch(self.gpu_slot, start, duration)
            ideal_end = start + duration
            step_start = start
            await self.clock.sleep_until(ideal_end)
            self.steps += 1
            self.busy_seconds += duration
            self._complete(batch, self.clock.now())
            self._publish()
            await asyncio.sleep(0)  # let handlers write what this step produced

    def _link_seconds(self, tokens: int) -> float:
        if self.settings.instant:
            return 0.0
        return kv_link_seconds(self.settings.preset, tokens, self.settings.time_scale)

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _schedule(self, now: float, cutoff: float) -> tuple[list[tuple[Sequence, int]], int]:
        """The next step's batch; a waiting prompt submitted after `cutoff` is not admitted to it."""
        budget = self.budget
        batch: list[tuple[Sequence, int]] = []
        prefill_tokens = 0
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.num_tokens - seq.num_computed
            if n > budget:
                if self.chunked:
                    n = budget
                elif prefill_tokens or batch:
                    i += 1
                    continue
            need = self._blocks_for(seq.num_computed + n) - len(seq.blocks)
            while need > self.pool.num_free and self.running:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.state is not RUNNING:
                break  # seq preempted itself: nothing later in the list is left either
            if need > 0:
                seq.blocks.extend(self.pool.allocate(need))
            batch.append((seq, n))
            budget -= n
            if n > 1:
                prefill_tokens += n
            i += 1

        if preempted:  # like V1: no new admissions in a step that had to preempt
            return batch, prefill_tokens

        while self.ready and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.ready[0]
            need = self._blocks_for(seq.num_computed + 1) - len(seq.blocks)
            if need > self.pool.num_free:
                break
            self.ready.popleft()
            seq.blocks.extend(self.pool.allocate(need))
            self._admit(seq, now)
            batch.append((seq, 1))
            budget -= 1

        while self.waiting:
            seq = self.waiting[0]
            if seq.remote is not None and not seq.kv_loaded and self.puller is not None:
                need = self._blocks_for(seq.prompt_tokens)
                if need > self.pool.num_free:
                    if seq.pull_started is None:  # queued here: keep the prefill's lease alive
                        seq.pull_started = asyncio.Event()
                        self._spawn(self.puller.keep_alive(seq.remote, seq.pull_started))
                    break
                self.waiting.popleft()
                seq.blocks = self.pool.allocate(need)
                self._read_uncached(seq)
                seq.state = LOADING_KV
                seq.stalls_until = now + self._link_seconds(seq.prompt_tokens)
                self.loading.add(seq)
                self._spawn(self._load_remote_kv(seq))
                continue
            if budget <= 0 or len(self.running) >= self.max_num_seqs or seq.queued_at > cutoff:
                break
            hit_blocks = self.prefix_cache.cached_blocks(seq.block_hashes) if seq.num_computed == 0 else 0
            start = seq.num_computed or min(hit_blocks * self.block_size, seq.prompt_tokens - 1)
            n = seq.num_tokens - start
            if n > budget:
                if self.chunked:
                    n = budget
                elif prefill_tokens or n <= self.budget:
                    break  # must fit whole; a prompt longer than the whole budget runs alone
            need = self._blocks_for(start + n) - len(seq.blocks)
            if need > self.pool.num_free:
                break
            self.waiting.popleft()
            seq.blocks.extend(self.pool.allocate(need))
            if seq.num_computed == 0:  # vLLM looks the prompt up when first scheduled (and after a preemption)
                self._queried(seq, start)
                seq.num_computed, seq.cached_blocks, seq.shared = start, hit_blocks, hit_blocks
                self.prefix_cache.touch(seq.block_hashes[:hit_blocks])
            self._admit(seq, now)
            batch.append((seq, n))
            budget -= n
            if n > 1:
                prefill_tokens += n
        self._trim_cache()
        return batch, prefill_tokens

    def _read_uncached(self, seq: Sequence) -> None:
        """A decode reads only the prompt blocks its prefix cache lacks (vLLM 0.23's NIXL connector: the scheduler
        counts the local hit as computed, `get_num_new_matched_tokens`, and the worker reads the rest of the remote
        blocks, `_apply_prefix_caching`), up to the last prompt token, which is always computed."""
        if not self.settings.preset.kv_pull_cached or not seq.block_hashes or seq.remote is None:
            return
        hit = min(self.prefix_cache.cached_blocks(seq.block_hashes), (seq.prompt_tokens - 1) // self.block_size)
        if hit:
            self.prefix_cache.touch(seq.block_hashes[:hit])
            seq.cached_blocks = hit
            read = max(self._blocks_for(seq.prompt_tokens) - hit, 0)
            ids = seq.remote.block_ids
            seq.remote = dataclasses.replace(seq.remote, block_ids=ids[len(ids) - read:] if read < len(ids) else ids,
                                             read_blocks=read)

    def _queried(self, seq: Sequence, hit: int) -> None:
        if self.prefix_cache.enabled:  # vLLM without prefix caching looks nothing up and counts no queries
            self.metrics.prompt_queried(seq.prompt_tokens, hit)

    def _trim_cache(self) -> None:
        """Cached blocks live in the free ones: what running requests and leases take is no longer cached."""
        self.prefix_cache.trim(UNBOUNDED_BLOCKS if self.pool.total == 0 else self.pool.num_free)

    def _admit(self, seq: Sequence, now: float) -> None:
        seq.state = RUNNING
        self.running.append(seq)
        if seq.scheduled_at is None:
            seq.scheduled_at = now
            self.metrics.queue.observe(now - seq.queued_at)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0  # recompute prompt and generated tokens when re-admitted
        seq.kv_loaded = True  # a preempted decode recomputes locally, it does not pull again
        seq.state = WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
        self.metrics.preemptions.inc()

    def _complete(self, batch: list[tuple[Sequence, int]], now: float) -> None:
        m = self.metrics
        for seq, n in batch:
            if seq.state is not RUNNING:
                continue  # aborted while the step ran
            prefill_before = seq.num_computed < seq.prompt_tokens
            seq.num_computed += n
            if prefill_before:
                m.prompt_computed(min(seq.num_computed, seq.prompt_tokens) - (seq.num_computed - n))
                self._cache_computed(seq)
            if seq.num_computed < seq.num_tokens:
                continue  # a prompt chunk: no token yet
            self._emit_token(seq, now)

    def _cache_computed(self, seq: Sequence) -> None:
        """The prompt's newly computed full blocks become reusable (vLLM caches blocks as they fill)."""
        full = min(seq.num_computed, seq.prompt_tokens) // self.block_size
        if full > seq.cached_blocks:
            self.prefix_cache.touch(seq.block_hashes[seq.cached_blocks:full])
            seq.cached_blocks = full

    def _emit_token(self, seq: Sequence, now: float) -> None:
        if self.on_token is not None:
            self.on_token(seq, now)
        m = self.metrics
        seq.num_generated += 1
        m.generation_tokens.inc()
        if seq.first_token_at is None:
            seq.first_token_at = now
            m.ttft.observe(now - seq.arrival)
        else:
            m.itl.observe(now - seq.last_token_at)  # type: ignore[operator]
        seq.last_token_at = now
        if seq.num_generated >= seq.target_tokens:
            if seq in self.running:
                self.running.remove(seq)
            self._finish(seq, seq.target_reason, now)
        else:
            seq._notify()

    def _finish(self, seq: Sequence, reason: str, now: float, error: str | None = None) -> None:
        seq.state = FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finished_at = now
        if seq.pull_started is not None:
            seq.pull_started.set()
        if seq.hold_kv and reason in ("length", "stop") and self.leases is not None:
            if not seq.blocks:  # instant mode allocates only when KV has to be held
                seq.blocks = self.pool.allocate(self._blocks_for(seq.prompt_tokens))
            # the blocks its prompt found cached stay the cache's (vLLM shares them between requests): the lease holds
            # the ones it computed, and the decode reads the prompt's blocks from both (RemoteKV.num_tokens)
            shared = min(seq.shared, len(seq.blocks) - 1) if self.settings.preset.kv_pull_cached else 0
            if shared > 0:
                self.pool.free(seq.blocks[:shared])
                seq.blocks = seq.blocks[shared:]
            self.leases.hold(seq.request_id, seq.blocks, seq.prompt_tokens)
            seq.held_blocks = seq.blocks
        else:
            self.pool.free(seq.blocks)
        seq.blocks = []
        m = self.metrics
        m.success[reason].inc()
        m.e2e.observe(now - seq.arrival)
        if seq.scheduled_at is not None:
            m.inference.observe(now - seq.scheduled_at)
        if seq.first_token_at is not None and seq.scheduled_at is not None:
            m.prefill.observe(seq.first_token_at - seq.scheduled_at)
            m.decode.observe(now - seq.first_token_at)
            if seq.num_generated > 1:
                m.tpot.observe((now - seq.first_token_at) / (seq.num_generated - 1))
        seq._notify(force=True)
        self._wake()

    # ---- P/D: the decode's side of a remote prefill ----------------------------------------
    async def _load_remote_kv(self, seq: Sequence) -> None:
        assert seq.remote is not None and self.puller is not None
        if seq.pull_started is not None:
            seq.pull_started.set()
        source = seq.remote.engine_id
        self.taking_from[source] += 1
        try:
            outcome = await self.puller.pull(seq.remote, fail=seq.kv_fail)
            if outcome.ok and self.intake is not None and seq.state is not FINISHED and self._fed_by_others(source):
                if self.intake_bursts:
                    await self._take_in_batch(outcome.nbytes)
                else:
                    await self.intake.transfer(outcome.nbytes)
        finally:
            self.taking_from[source] -= 1
        seq.pull = outcome
        if seq.state is FINISHED:
            return  # aborted during the pull; blocks already freed
        self.loading.discard(seq)
        if outcome.ok:
            seq.kv_loaded = True
            seq.num_computed = seq.prompt_tokens - 1  # only the last prompt token is recomputed
            self._cache_computed(seq)  # the pulled blocks are in the cache now (vLLM: a KV arrival's BlockStored)
            seq.state = WAITING
            if self.settings.instant:
                self._run_instantly(seq)
                return
            self.ready.append(seq)
            self.metrics.prompt_transferred(seq.prompt_tokens - 1)
        else:
            self._finish(seq, "error", self.clock.now(), error=f"KV load failed: {outcome.message}")
        self._publish()
        self._wake()

    async def _take_in_batch(self, nbytes: int) -> None:
        """Copy a KV in with the batch it joins and return when the whole batch is in: a KV that arrives while a
        batch is copied goes with the next (run A's vLLM decodes took no request in for seconds at a time, then
        released the KV loads of that stretch in one step)."""
        assert self.intake is not None
        if self._copying is None:
            batch = self._copying = IntakeBatch()
        else:
            batch = self._next = self._next or IntakeBatch()
        batch.pending += 1
        try:
            await self.intake.transfer(nbytes)
        finally:
            batch.pending -= 1
            while self._copying is not None and self._copying.pending == 0:  # a batch emptied by cancels goes too
                self._copying.release()
                self._copying, self._next = self._next, None
        await batch.done

    def _fed_by_others(self, source: str) -> bool:
        """Whether a pull from another prefill is in flight or being taken in (the intake's condition)."""
        return any(n > 0 for engine_id, n in self.taking_from.items() if engine_id != source)

    # ---- instant preset: no loop at all ----------------------------------------------------------
    def _run_instantly(self, seq: Sequence) -> None:
        if seq.remote is not None and self.puller is not None and not seq.kv_loaded:
            seq.state = LOADING_KV
            self.loading.add(seq)
            self._spawn(self._load_remote_kv(seq))
            return
        now = self.clock.now()
        seq.scheduled_at = now
        seq.first_token_at = seq.last_token_at = now
        seq.num_computed = seq.prompt_tokens
        seq.num_generated = seq.target_tokens
        m = self.metrics
        m.queue.observe(now - seq.queued_at)
        m.ttft.observe(now - seq.arrival)
        hit_blocks = self.prefix_cache.cached_blocks(seq.block_hashes)
        hit = min(hit_blocks * self.block_size, seq.prompt_tokens - 1)
        self._queried(seq, hit)
        m.prompt_computed(seq.prompt_tokens - hit)
        self.prefix_cache.touch(seq.block_hashes)
        self._trim_cache()
        m.generation_tokens.inc(seq.target_tokens)
        self._finish(seq, seq.target_reason, now)

    def warm(self, hashes: list[int]) -> None:
        """Blocks already in the prefix cache before the first request (left by an earlier run)."""
        self.prefix_cache.touch(hashes)
        self._trim_cache()

    # ---- observability -------------------------------------------------------------------------
    def _publish(self) -> None:
        m = self.metrics
        m.running.set(len(self.running))
        m.waiting.set(len(self.waiting) + len(self.ready) + len(self.loading))
        m.kv_usage.set(self.pool.usage)

    def state(self) -> dict[str, Any]:
        leases = self.leases
        return {
            "running": len(self.running),
            "waiting": len(self.waiting) + len(self.ready) + len(self.loading),
            "waiting_for_remote_kv": len(self.loading),
            "kv_blocks_total": self.pool.total,
            "kv_blocks_used": self.pool.used,
            "kv_blocks_free": None if self.pool.total == 0 else self.pool.num_free,
            "kv_cache_usage": self.pool.usage,
            "leases_held": len(leases.held) if leases else 0,
            "leases_expired_total": leases.expired_total if leases else 0,
            "stale_kv_reads_total": leases.stale_reads if leases else 0,
            "kv_pulls_active": self.puller.active if self.puller else 0,
            "steps": self.steps,
            "busy_seconds": round(self.busy_seconds, 6),
            "late_steps": self.late_steps,
            "late_seconds": round(self.late_seconds, 6),
            "preemptions": self.preemptions,
            "prefix_cache_blocks": len(self.prefix_cache),
            "requests_total": self.requests_total,
        }

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.leases:
            self.leases.release_all()

