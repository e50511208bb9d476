"""Which model names may label metrics and name spans: the ones the instances serve.

A request's `model` is whatever its client wrote. Used verbatim as a metric label or in a span
name, every made-up name would open ~130 new series in `/metrics` and as many in the collector's
span metrics: anyone who can reach the proxy could exhaust its memory and Prometheus's. So a
name labels telemetry only when it is known, and it is known only from two sources the client
cannot write:

* given by the operator (`--served-model-name`, and `--model`);
* listed by an instance's `GET /v1/models` (read by pdproxy/served.py: at start, then with the health
  checks but at most every `MIN_REFRESH_SECONDS`, and every `MIN_REFRESH_SECONDS` with health checks
  off; also, at most once a second, for a request naming a model no instance lists).

The `model` field of an answer never adds a name: some OpenAI-compatible servers echo whatever
model was requested, so an answer is the client's own text coming back. It can still pick among
known names (a request for an alias, or without a model, answered by a listed model).

Names listed by instances are capped at `MAX_LEARNED`; the operator's own names are not. Every
other name is labelled `OTHER`. Names are only ever added: a series once exposed stays.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger("pdproxy.models")

OTHER = "other"  # the label of every model name that is not known
MAX_LEARNED = 100  # names listed by instances; beyond this they are labelled OTHER
MAX_NAME_LENGTH = 256  # longer is not a model name anyone serves
MIN_REFRESH_SECONDS = 30.0  # /v1/models is asked no more often than this, whatever the health-check interval


class ModelNames:
    """The set of model names that get their own label; everything else is `OTHER`."""

    def __init__(self, allowed: Iterable[str] = (), max_learned: int = MAX_LEARNED) -> None:
        self.allowed = frozenset(name for name in allowed if name)
        self.learned: set[str] = set()
        self.max_learned = max_learned
        self._full_warned = False

    def known(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.allowed or name in self.learned)

    def learn(self, name: object) -> None:
        """An instance lists `name` in its /v1/models: give it its own label (while the cap allows).
        Never called with a name from a request or an answer: those are the client's to choose."""
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH or self.known(name):
            return
        if len(self.learned) >= self.max_learned:
            if not self._full_warned:
                self._full_warned = True
                log.warning("more than %d model names listed by the instances; %r and any further ones are "
                            "labelled %r (name them with --served-model-name to give them their own label)",
                            self.max_learned, name[:80], OTHER)
            return
        self.learned.add(name)

    def label(self, requested: object, answered: object = None) -> str:
        """The label of a request for `requested` that the instance answered as `answered` (None when it
        did not answer successfully): the requested name when known, else the answering model when known
        (a request without a model, or for an alias), else `OTHER`. Learns nothing from either."""
        if self.known(requested):
            return requested  # type: ignore[return-value]
        if answered is not None and self.known(answered):
            return answered  # type: ignore[return-value]
        return OTHER

    def describe(self) -> dict[str, object]:
        """For `/status`: which names get their own label."""
        return {"given": sorted(self.allowed), "learned": sorted(self.learned), "max_learned": self.max_learned,
                "others": OTHER}
