"""Why a stream stalled: the attribution rule, and the live record of what each instance was doing.

The rule (shared with the bench's offline attribution, pdproxy/bench/attribution.py, docs/reference/report.md):
a stall — a gap between token-bearing events above the stall threshold — is put down to what
happened on the same instance within the gap, ± TOLERANCE: another request's KV arriving (P/D
decode), another request's prefill (single instance), a preemption the instance reported, or none.
With several candidates the first of PRIORITY wins; the coinciding requests are listed largest
prompt first.

Live, the proxy keeps per instance a bounded record of those activities, seen from its side:

* kv_arrival (P/D decode): from the request's hand-off (its prefill answered) to its first token
  from the decode — the proxy's pd.kv_transfer span;
* prefill (single instance): from sending the request to its first token — the proxy's pd.prefill.

An activity is opened when it starts and closed when the request's first token comes (the flow
says so; a continuation's is read from its stream), so a stall is attributed at the end of the
stalled stream with the activities that overlapped it, including ones still going on. Recording
is O(1) per request; a time window and a hard bound on entries keep memory bounded under any load,
and SCAN_LIMIT / SCAN_STEPS bound the work per stall.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Iterable, Protocol, Sequence, TypeVar


# -- the rule -----------------------------------------------------------------------------------

PRIORITY = ("preemption", "kv_arrival", "prefill")
# causes the proxy reports live: migration is marked by the request flow itself (a splice gap), the
# others come from the rule; vLLM 0.23 reports no preemption to the proxy, so that one stays at zero
LIVE_CAUSES = ("kv_arrival", "prefill", "migration", "preemption", "none")
TOLERANCE = 0.010  # s: clocks of client, proxy and instance, and the step that delivers both tokens
TOLERANCE_NS = int(TOLERANCE * 1e9)
# Live, per stall: the cause is read from at most SCAN_LIMIT coinciding activities, found among at most
# SCAN_STEPS recorded ones (an instance serves one kind of activity, so a few show the cause; the
# culprits named are the largest of those). A request's attribution costs a bounded time however many
# requests its instance holds (5,000 streams on one decode, each gap a stall: tens of microseconds each).
SCAN_LIMIT = 32
SCAN_STEPS = 256


class Candidate(Protocol):
    kind: str
    request_id: str
    tokens: int


C = TypeVar("C", bound=Candidate)


def window(start: float, end: float, tolerance: float = TOLERANCE) -> tuple[float, float]:
    """Where to look for a stall's cause: the gap widened by the tolerance on both sides."""
    return start - tolerance, end + tolerance


def pick(found: Iterable[C], request_id: str) -> tuple[str, list[C]]:
    """The cause among the activities that overlap a stall's window, and the requests behind it.

    Another request's activity only (a request's own KV arrival or prefill precedes its stream);
    a preemption counts whoever it hit.
    """
    best, hits = len(PRIORITY), []
    for a in found:
        rank = _RANK.get(a.kind, best + 1)
        if rank > best or (a.request_id == request_id and a.kind != "preemption"):
            continue
        if rank < best:
            best, hits = rank, [a]
        else:
            hits.append(a)
    if not hits:
        return "none", []
    hits.sort(key=lambda a: -a.tokens)
    return PRIORITY[best], hits


_RANK = {kind: i for i, kind in enumerate(PRIORITY)}


# -- the live record ----------------------------------------------------------------------------


class Stream(Protocol):
    """The culprit's response scan: its first token ends its KV arrival or prefill."""

    @property
    def first_token_ns(self) -> int | None: ...


class Activity:
    """One request's KV arrival or prefill on one instance, monotonic ns; `end` None while going on."""

    __slots__ = ("kind", "request_id", "start", "end", "tokens", "trace_id", "span_id", "stream")

    def __init__(self, kind: str, request_id: str, start: int, trace_id: bytes | None, span_id: bytes | None,
                 stream: Stream | None) -> None:
        self.kind, self.request_id, self.start = kind, request_id, start
        self.end: int | None = None
        self.tokens = 0  # prompt tokens, known once the request has ended (its usage)
        # of the span a link points at, as the span carries them (16 and 8 bytes); None when unsampled
        self.trace_id, self.span_id = trace_id, span_id
        self.stream = stream

    def end_ns(self) -> int | None:
        """The end once known: closed, or the stream's first token has come."""
        if self.end is not None:
            return self.end
        return self.stream.first_token_ns if self.stream is not None else None

    def close(self, end: int) -> None:
        self.end = end
        self.stream = None  # the record must not keep a finished request's scan alive


class InstanceRecord:
    """Activities on one instance in start order: the last `window_ns`, at most `limit` of them."""

    def __init__(self, window_ns: int, limit: int) -> None:
        self.window_ns = window_ns
        self.limit = limit
        self.closed: deque[Activity] = deque()  # at most `limit`: _keep drops the oldest first
        self.starts: deque[int] = deque()  # the same activities' starts, for bisecting
        self.open: dict[int, Activity] = {}  # by id(): going on, looked at on every query
        self.longest = 0  # ns: the longest closed activity kept bounds how far back one can start

    def begin(self, activity: Activity) -> None:
        if len(self.open) >= self.limit:  # more in flight than the bound: the oldest is forgotten
            self.open.pop(next(iter(self.open)))
        self.open[id(activity)] = activity

    def end(self, activity: Activity, end: int, tokens: int | None) -> None:
        """The request ended: its activity ends at its first token, or now if it never had one."""
        activity.tokens = tokens or 0
        if self.open.pop(id(activity), None) is not None:
            self._keep(activity, activity.end_ns() or end)

    def _keep(self, activity: Activity, end: int) -> None:
        activity.close(end)
        closed, starts = self.closed, self.starts
        horizon = end - self.window_ns
        while starts and (starts[0] < horizon or len(starts) >= self.limit):
            starts.popleft()
            closed.popleft()
        # closing order is not start order: a late closer goes back a few places to keep starts sorted
        i = len(starts)
        while i and starts[i - 1] > activity.start:
            i -= 1
        closed.insert(i, activity)
        starts.insert(i, activity.start)
        self.longest = min(max(self.longest, end - activity.start), self.window_ns)

    def around(self, lo: int, hi: int, limit: int = 0) -> list[Activity]:
        """Activities overlapping [lo, hi]: those going on (oldest first), then closed ones (latest-starting
        first); open ones whose end has come since are filed as closed. `limit`: at most that many (a stall under heavy load may coincide with
        thousands: the cause needs one, the culprits only the first few), looking at no more than
        SCAN_STEPS of the open ones (the oldest: the likeliest to overlap) and of the closed ones."""
        out, ended = [], []
        for key, a in islice(self.open.items(), SCAN_STEPS if limit else None):
            end = a.end_ns()
            if end is not None:
                ended.append((key, a, end))
            elif a.start <= hi:
                out.append(a)
                if limit and len(out) >= limit:
                    break
        for key, a, end in ended:
            del self.open[key]
            self._keep(a, end)
        starts = self.starts
        upto = bisect_right(starts, hi)
        earliest = lo - self.longest
        steps = SCAN_STEPS if limit else len(starts)
        for a in islice(reversed(self.closed), len(starts) - upto, None):
            if a.start < earliest or steps <= 0 or (limit and len(out) >= limit):
                break
            steps -= 1
            if a.end is not None and a.end >= lo:  # closed: always set
                out.append(a)
        return out


@dataclass
class Attributed:
    """One stall of a request with its cause: when (monotonic ns), how long (s), who was behind it."""

    start: int
    duration: float
    tokens: int
    cause: str
    culprits: list[Activity]


class StallRecords:
    """Every instance's record; the instances are the configured ones, so their number is bounded."""

    def __init__(self, window: float = 120.0, limit: int = 4096) -> None:
        self.window_ns = int(window * 1e9)
        self.limit = limit
        self.instances: dict[str, InstanceRecord] = {}

    def begin(self, kind: str, address: str, request_id: str, start: int, trace_id: bytes | None,
              span_id: bytes | None, stream: Stream) -> tuple[InstanceRecord, Activity]:
        """A request's KV arrival or prefill started on `address`; it ends with the stream's first token."""
        record = self.instances.get(address)
        if record is None:
            record = self.instances[address] = InstanceRecord(self.window_ns, self.limit)
        activity = Activity(kind, request_id, start, trace_id, span_id, stream)
        record.begin(activity)
        return record, activity

    def observed(self, kind: str, address: str, request_id: str, at: int, tokens: int) -> None:
        """An activity another process routed, seen at one moment (a decode's KV arrival from its events)."""
        record = self.instances.get(address)
        if record is None:
            record = self.instances[address] = InstanceRecord(self.window_ns, self.limit)
        activity = Activity(kind, request_id, at, None, None, None)
        activity.tokens = tokens
        record._keep(activity, at)

    def attribute(self, address: str | None, request_id: str, stalls: Sequence[tuple[int, float, int]],
                  marks: Sequence[tuple[int, str]] = ()) -> list[Attributed]:
        """Each stall (gap start ns, gap s, tokens after it) of one request with its cause; a stall the
        flow marked (`marks`: a moment inside the gap, its cause — e.g. a migration's splice) keeps it."""
        record = self.instances.get(address) if address else None
        out = []
        for start, gap, tokens in stalls:
            marked = marked_cause(start, gap, marks)
            if marked is not None or record is None:
                out.append(Attributed(start, gap, tokens, marked or "none", []))
                continue
            lo, hi = start - TOLERANCE_NS, start + int(gap * 1e9) + TOLERANCE_NS  # `window`, in ns
            cause, culprits = pick(record.around(lo, hi, SCAN_LIMIT), request_id)
            out.append(Attributed(start, gap, tokens, cause, culprits))
        return out


def marked_cause(start: int, gap: float, marks: Sequence[tuple[int, str]]) -> str | None:
    """The cause the flow marked inside the gap (gap start ns, gap s), if any: e.g. a migration's splice."""
    end = start + int(gap * 1e9)
    return next((cause for at, cause in marks if start <= at <= end), None)


def span_links(stalls: Iterable[Attributed], limit: int) -> list[tuple[bytes, bytes, dict[str, str]]]:
    """OTel links from the stalled request's pd.decode to its culprits' spans, each culprit once (the
    culprits' ids and the cause are on the pd.stall events; links carry only where to jump)."""
    out: list[tuple[bytes, bytes, dict[str, str]]] = []
    seen: set[bytes] = set()
    for s in stalls:
        for a in s.culprits:
            if a.trace_id is None or a.span_id is None or a.span_id in seen:
                continue
            seen.add(a.span_id)
            out.append((a.trace_id, a.span_id, {}))
            if len(out) >= limit:
                return out
    return out
