"""A recorded workload as the model replays it: who arrived when, with how many tokens, sharing what.

Read from `pdproxy bench` records (arrival offsets, prompt and output tokens as the server counted
them, the class's closed-loop concurrency, shared system prompts re-drawn from the recorded seed) or
from pdproxy's trace files (root span start, `gen_ai.usage.*`, and the router's
`pd.route.matched_prefix` for prefix sharing). What a prediction needs but the input lacks is
assumed, and each assumption is kept in `Workload.notes` so that the output can say it.

Prompts become token ids the model can hash: a shared prefix is the same ids in every request that
has it, the rest is unique to the request (or, in a multi-turn class, to its conversation).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdproxy.bench import records, traces
from pdproxy.bench.prefixes import PrefixShaper
from pdproxy.bench.prompts import Prompts
from pdproxy.bench.workload import Workload as BenchWorkload

_TPW = 2.3  # tokens per word when a record does not say (the simulator's tokenizer mean)
_STREAM = 10_000_000  # token-id range per prefix / conversation / request


class WorkloadError(ValueError):
    """Input a prediction cannot be made from; the message says what is missing."""


@dataclass(frozen=True)
class Request:
    request_id: str
    cls: str
    index: int
    arrival: float  # seconds from the workload's start (open loop) / the recorded start (closed loop)
    prompt_tokens: int
    output_tokens: int
    prompt_tokens_requested: int | None = None
    max_tokens: int | None = None
    prefix: int | None = None  # shared-prefix group
    prefix_tokens: int = 0
    stream: int = 0  # where the request's own ids come from (its conversation in a multi-turn class)

    def token_ids(self) -> list[int]:
        n = min(self.prefix_tokens, self.prompt_tokens)
        ids = list(range((self.prefix + 1) * _STREAM, (self.prefix + 1) * _STREAM + n)) if self.prefix is not None \
            else []
        base = (1 << 40) + self.stream * _STREAM
        ids.extend(range(base, base + self.prompt_tokens - n))
        return ids

    def again(self, i: int, n: int) -> Request:
        """The `i`-th request of a closed-loop class past the `n` recorded: the recorded one's shape, a new id."""
        if i < n:
            return self
        return replace(self, request_id=f"{self.request_id}~{i // n}", index=i, stream=self.stream + (i // n) * (1 << 20))


@dataclass
class ClassPlan:
    name: str
    concurrency: int | None  # closed loop: that many clients back to back; None: replay the arrivals
    requests: list[Request] = field(default_factory=list)


@dataclass
class Workload:
    source: str
    classes: list[ClassPlan]
    duration: float | None = None
    warmup_seconds: float = 0.0
    conditions: dict[str, str] = field(default_factory=dict)  # the recorded set-up's
    max_model_len: int | None = None
    label: str = ""
    notes: list[str] = field(default_factory=list)
    header: dict[str, Any] = field(default_factory=dict)  # the bench run header, when read from one
    # class -> its leading requests whose prompts the instances' prefix caches hold when the run starts (a run of
    # the same seeded workload before it on the same instances: `warm_from`)
    warm: dict[str, int] = field(default_factory=dict)

    def warm_prompts(self) -> list[Request]:
        """The requests whose prompts are cached at the start, oldest first."""
        return [r for c in self.classes for r in c.requests if r.index < self.warm.get(c.name, 0)]

    @property
    def requests(self) -> list[Request]:
        return [r for c in self.classes for r in c.requests]

    def check(self, max_model_len: int) -> None:
        over = [r for r in self.requests if r.prompt_tokens + r.output_tokens > max_model_len]
        if over:
            worst = max(over, key=lambda r: r.prompt_tokens + r.output_tokens)
            raise WorkloadError(
                f"{len(over)} request(s) need more than max-model-len {max_model_len} tokens (prompt + output), e.g. "
                f"{worst.request_id}: {worst.prompt_tokens} + {worst.output_tokens}; a real instance refuses them: "
                "pass --max-model-len as the recorded instances had it")


def _prompts(described: dict[str, Any], tokens_per_word: float) -> Prompts:
    """The run's prompt facts as far as its header keeps them: enough to re-draw its shared prefixes."""
    return Prompts(endpoint="", method="ratio", lead_tokens=int(described.get("lead_tokens") or 0),
                   tokens_per_word=tokens_per_word, max_model_len=described.get("max_model_len"))


def _prefix_tokens(drawn: int, record: dict[str, Any]) -> int:
    """The shared prefix's tokens as the server counted them: its draw, or all the server counted beyond what the
    request asked for where that is more. A bench before the prefix was sized in tokens (run A,
    tests/fixtures/real-xpyd-2026-12-01b) asked for the class's own 900 tokens only and sized the system prompt
    in words: vLLM counted 2,085-3,114 tokens, so the prefix was 1,185-2,214 tokens where its draw says 517-897,
    and a replay by the draw prefilled 2.4 times the new tokens the recording did. Not the default yet
    (`from_bench`'s `prefixes_as_counted`): docs/notes/whatif-issue40.md, "Spread"."""
    asked, counted = record.get("prompt_tokens_requested"), record.get("prompt_tokens")
    if isinstance(asked, int) and isinstance(counted, int):
        return max(drawn, counted - asked)
    return drawn


def from_bench(path: str | Path, prefixes_as_counted: bool = False) -> Workload:
    """`prefixes_as_counted`: a shared prefix at the size the server counted (`_prefix_tokens`), else its draw."""
    run = records.read_run(path)
    h = run.header
    wl_dict = h.get("workload") or {}
    notes: list[str] = []
    prompts = h.get("prompts") or {}
    tpw = float(prompts.get("tokens_per_word") or _TPW)
    class_defs = {c.get("name"): (i, c) for i, c in enumerate(wl_dict.get("classes") or [])}
    shapers: dict[str, PrefixShaper] = {}
    try:
        bench_wl = BenchWorkload.from_dict(wl_dict) if wl_dict else None
    except Exception as exc:  # an older or hand-written header: no prefix re-draw
        bench_wl = None
        notes.append(f"the run's workload could not be read back ({exc}): no shared prefixes assumed")
    by_class: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in run.requests:
        by_class[str(r.get("class"))].append(r)
    if not by_class:
        raise WorkloadError(f"{path}: no request records")
    out_missing = prompt_missing = counted = 0
    classes = []
    streams: dict[Any, int] = {}  # each request's own ids (or its conversation's), numbered in order: deterministic
    for name, recs in by_class.items():
        recs.sort(key=lambda r: int(r.get("index") or 0))
        ci, cdef = class_defs.get(name, (None, {}))
        shaper = None
        if bench_wl is not None and ci is not None and (cdef.get("shared_prefixes") or cdef.get("sessions")):
            shaper = shapers[name] = PrefixShaper.of(bench_wl, ci, _prompts(prompts, tpw))
        prefix_ids: dict[str, int] = {}
        plan = ClassPlan(name, int(cdef["concurrency"]) if cdef.get("concurrency") else None)
        drawn = 0
        for r in recs:
            idx = int(r.get("index") or 0)
            prefix, prefix_tokens, stream = None, 0, streams.setdefault((name, idx), len(streams))
            if shaper is not None:
                while drawn <= idx:  # the shaper draws in request order; replay the draws up to this one
                    text, shared_tokens, conversation = shaper.shape(drawn, "", 0)
                    drawn += 1
                if cdef.get("shared_prefixes"):  # with an empty draw of its own, the shaped text is the prefix
                    key = text.strip()
                    prefix = prefix_ids.setdefault(key, len(prefix_ids) + 1000 * (ci or 0))
                    prefix_tokens = shared_tokens or 0  # sized in the target's tokens when it was drawn
                    if prefixes_as_counted and (n := _prefix_tokens(prefix_tokens, r)) > prefix_tokens:
                        prefix_tokens, counted = n, counted + 1
                if conversation is not None:
                    stream = streams.setdefault((name, conversation), len(streams))
                    prefix, prefix_tokens = None, 0  # the conversation's own history is the shared part
            pt = r.get("prompt_tokens")
            if not pt:
                prompt_missing += 1
                pt = r.get("prompt_tokens_requested") or round((r.get("prompt_words") or 0) * tpw)
            ot = r.get("output_tokens") if r.get("ok") else None
            if not ot:
                out_missing += 1
                ot = r.get("max_tokens") or 16
            plan.requests.append(Request(str(r["request_id"]), name, idx, float(r.get("start_offset") or 0.0), int(pt),
                                         int(ot), r.get("prompt_tokens_requested"), r.get("max_tokens"), prefix,
                                         prefix_tokens, stream))
        classes.append(plan)
    if prompt_missing:
        notes.append(f"{prompt_missing} request(s) without the server's prompt token count: assumed the requested "
                     "size (or words x tokens per word)")
    if counted:
        notes.append(f"{counted} request(s) whose shared prefix the server counted longer than its draw: replayed at "
                     "the server's count (--prefixes-as-counted)")
    if out_missing:
        notes.append(f"{out_missing} request(s) without an output token count (failed or not streamed with usage): "
                     "assumed max_tokens")
    for c in classes:
        if c.concurrency:
            notes.append(f"class {c.name}: closed loop, {c.concurrency} clients back to back for the recorded "
                         f"{wl_dict.get('duration')} s (a faster set-up serves more requests, as the bench would)")
    if not wl_dict:
        notes.append("no workload in the run header: arrivals replayed as recorded (open loop)")
    return Workload(str(path), classes, duration=float(wl_dict["duration"]) if wl_dict.get("duration") else None,
                    warmup_seconds=float(wl_dict.get("warmup_seconds") or 0.0), conditions=dict(run.conditions),
                    max_model_len=int(prompts["max_model_len"]) if prompts.get("max_model_len") else None,
                    label=run.label, notes=notes, header=h)


def warm_from(wl: Workload, before: str | Path) -> None:
    """The run recorded in `before` preceded `wl`'s on the same instances: its prompts start in their caches.

    vLLM keeps a finished request's prompt blocks in its prefix cache until they are needed, and a bench run
    with the same seed and classes sends the same prompt for the same class and index; so the first requests
    of each class hit a cache the earlier run filled (the vllm023 single runs, recorded after the P/D runs:
    a 4,478-token prompt's TTFT 43 ms against ~250 ms cold)."""
    run = records.read_run(before)
    mine, theirs = wl.header.get("workload") or {}, run.header.get("workload") or {}

    def prompts(w: dict[str, Any]) -> Any:
        return w.get("seed"), [(c.get("name"), c.get("prompt"), c.get("corpus")) for c in w.get("classes") or []]

    if not mine or prompts(mine) != prompts(theirs):
        raise WorkloadError(f"{before}: not the same seeded prompts as {wl.source} (seed and classes differ): "
                            "its prompts say nothing about this run's cache")
    seen: dict[str, int] = {}
    for r in run.requests:
        if r.get("ok"):
            name = str(r.get("class"))
            seen[name] = max(seen.get(name, 0), int(r.get("index") or 0) + 1)
    wl.warm = seen
    wl.notes.append(f"prefix caches warm at the start: the prompts of the run before it ({Path(before).name}, "
                    + ", ".join(f"{n} {c}" for c, n in seen.items()) + " requests)")


def run_name(info: traces.TraceInfo) -> str:
    """Which recorded run a request trace belongs to: its proxy's run label (`pd.run`), else the proxy instance."""
    return str(info.resource.get("pd.run") or info.resource.get("service.instance.id") or "unnamed")


def one_run(idx: traces.TraceIndex, wanted: str | None, request_ids: list[str] | None = None) -> traces.TraceIndex:
    """The index narrowed to one proxy's run (`run_name`). Trace files may hold several side by side (vllm023's: a
    P/D proxy's run and a single-mode proxy's on the same instances); a workload, its set-up, its routing and its
    self-replay are one run's: `wanted` (`--run`), else the run a bench record's `request_ids` join, else the only
    one."""
    primary = [i for i in idx.by_request.values() if i.deployment == "primary"]
    runs = Counter(run_name(i) for i in primary)
    if wanted is None and request_ids is not None:
        joined = {run_name(i) for r in request_ids if (i := idx.by_request.get(r)) is not None}
        if len(joined) != 1:
            return idx  # nothing (or several runs) joined: the records are the workload, the traces stay as given
        wanted = joined.pop()
    if wanted is None and len(runs) <= 1:
        return idx
    modes = {name: Counter(str(i.attrs.get("pd.mode", "?")) for i in primary if run_name(i) == name).most_common(1)[0][0]
             for name in runs}
    held = ", ".join(f"{name} ({modes[name]}, {n} requests)" for name, n in runs.most_common())
    if wanted is None:
        raise WorkloadError(f"the trace files hold {len(runs)} runs: {held}; choose one with --run NAME")
    if wanted not in runs:
        raise WorkloadError(f"--run {wanted}: no such run in the trace files (they hold {held})")
    keep = {k: i for k, i in idx.by_request.items() if i.deployment != "primary" or run_name(i) == wanted}
    return replace(idx, by_request=keep)


def from_traces(paths: list[str], run: str | None = None) -> Workload:
    return from_index(one_run(traces.read_traces(paths), run), paths)


def from_index(idx: traces.TraceIndex, paths: list[str]) -> Workload:
    """The workload of the request traces in `idx` (read from `paths`, narrowed to one run: `one_run`)."""
    infos = [i for i in idx.by_request.values() if i.deployment == "primary"]
    if not infos:
        raise WorkloadError(f"{', '.join(paths)}: no pdproxy request traces (root spans with pd.request_id)")
    infos.sort(key=lambda i: i.start)
    t0 = infos[0].start
    notes = ["arrivals replayed as recorded (open loop): trace files do not say whether the client waited"]
    missing_in = [i for i in infos if not i.attrs.get("gen_ai.usage.input_tokens")]
    missing_out = [i for i in infos if not i.attrs.get("gen_ai.usage.output_tokens")]
    known_in = [int(i.attrs["gen_ai.usage.input_tokens"]) for i in infos if i.attrs.get("gen_ai.usage.input_tokens")]
    if missing_in and not known_in:
        raise WorkloadError("no trace has gen_ai.usage.input_tokens (the prompt's token count): a prediction needs "
                            "it; record with usage in the stream (stream_options.include_usage) or use bench records")
    fallback_in = int(statistics.median(known_in)) if known_in else 0
    if missing_in:
        notes.append(f"{len(missing_in)} trace(s) without gen_ai.usage.input_tokens: assumed the median of the others "
                     f"({fallback_in})")
    if missing_out:
        notes.append(f"{len(missing_out)} trace(s) without gen_ai.usage.output_tokens: assumed "
                     "gen_ai.request.max_tokens (16 where that is missing too)")
    matched_seen = False
    groups: dict[int, int] = {}
    reqs = []
    for n, info in enumerate(infos):
        a = info.attrs
        matched = 0
        for stage in ("prefill", "decode"):
            m = (info.stage_attrs.get(stage) or {}).get("pd.route.matched_prefix")
            unit = (info.stage_attrs.get(stage) or {}).get("pd.route.matched_prefix.unit", "tokens")
            if m is not None:
                matched_seen = True
                matched = max(matched, int(m) if unit == "tokens" else round(int(m) / 4))
        prefix = groups.setdefault(matched // 16, len(groups)) if matched >= 16 else None
        pt = int(a.get("gen_ai.usage.input_tokens") or fallback_in)
        ot = int(a.get("gen_ai.usage.output_tokens") or a.get("gen_ai.request.max_tokens") or 16)
        reqs.append(Request(info.request_id, "traced", n, info.start - t0, pt, ot, None,
                            a.get("gen_ai.request.max_tokens"), prefix, matched, n))
    if matched_seen:
        notes.append("prefix sharing from pd.route.matched_prefix (the router's estimate): requests whose matched "
                     "prefix has the same length are assumed to share it")
    else:
        notes.append("no routing attributes with a matched prefix: no shared prefixes assumed")
    conditions = traces.resource_conditions(infos)
    return Workload(",".join(paths), [ClassPlan("traced", None, reqs)], duration=None,
                    conditions={k: str(v) for k, v in conditions.items()}, label="recorded", notes=notes)


def load(bench: list[str], trace_files: list[str], prefixes_as_counted: bool = False,
         run: str | None = None) -> Workload:
    """One workload: the bench records when given (one run), else the trace files (`run`: which of their runs)."""
    if len(bench) > 1:
        raise WorkloadError("give one bench record file per prediction (one recorded workload)")
    if bench:
        return from_bench(bench[0], prefixes_as_counted)
    if trace_files:
        return from_traces(trace_files, run)
    raise WorkloadError("no input: give a bench record file (--records) or trace files (--traces)")
