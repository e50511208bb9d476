"""Where one request goes: its token ids, decode-only or not, the decode, then the prefill, decided in one place.

`Proxy.forward` asks `Router.place` once and reads the `Placement`; a retried or migrated leg asks `Router` for its
next instance. The pools (pdproxy/pool.py) say which instances are in rotation, their policies (pdproxy/policies)
pick among those, given the request; selective disaggregation (selective.py) needs the decode chosen first, since
what the decode already holds decides whether a prefill is worth it.

"""

from __future__ import annotations

from typing import Any, cast

from pdproxy.errors import DECODE, PREFILL
from pdproxy.policies import Decision, RequestView
from pdproxy.pool import Instance, Pool


class Placement:
    """The instances of one request, the disaggregation verdict, and each leg's decision (for its span)."""

    __slots__ = ("decode", "prefill", "decisions", "verdict")

    def __init__(self, decode: Instance, prefill: Instance | None, decisions: dict[str, Decision],
                 verdict: Any = None) -> None:
        self.decode = decode
        self.prefill = prefill  # None: no prefill pool, or decode only
        self.decisions = decisions  # leg -> the decision that chose its instance
        self.verdict = verdict  # pdproxy.routing.selective.Verdict; None: selective disaggregation off


class Router:
    def __init__(self, prefill: Pool | None, decode: Pool, tokens: Any = None, selective: Any = None) -> None:
        # the prefill pool, even empty: its instances may be found at run time (membership); none there: 503
        self.prefill = prefill
        self.decode = decode
        self.tokens = tokens  # tokens.LocalTokenizer / RemoteTokenizer: when a rule routes by token ids
        self.selective = selective  # selective.SelectiveDisaggregation, with a prefill pool only

    async def place(self, view: RequestView) -> Placement:
        if self.tokens is not None:
            await self.tokens.fill(view)
        decode, decision = self.decode.policy.choose(self.decode.candidates(), view)
        verdict = self.selective.decide(view, decode.address) if self.selective is not None else None
        placement = Placement(cast(Instance, decode), None, {DECODE: decision}, verdict)
        if self.prefill is not None and (verdict is None or not verdict.decode_only):
            prefill, placement.decisions[PREFILL] = self.prefill.policy.choose(self.prefill.candidates(), view)
            placement.prefill = cast(Instance, prefill)
        return placement

    def next_prefill(self, exclude: Instance | None = None) -> Instance:
        """A prefill for a leg run again (fresh KV for a moved decode), by load, away from `exclude`."""
        assert self.prefill is not None
        return self.prefill.choose(exclude)

    def next_decode(self, exclude: Instance) -> Instance:
        """A decode to continue a broken stream on, by load, away from the one that broke."""
        return self.decode.choose(exclude)
