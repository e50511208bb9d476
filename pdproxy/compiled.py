"""Which of pdproxy's per-request modules run compiled (mypyc) and which as pure Python.

`PDPROXY_COMPILE=1 pip install .` compiles `MODULES` to C extensions (setup.py); a plain install
runs them as Python, which behaves the same and costs more CPU per request. Start-up logs which
form runs and `/status` says it (`"compiled"`), so a benchmark or a bug report names the form
measured. An in-place build (`pip install -e .`) leaves the extensions beside the sources, where
Python prefers them: a source edited after the build (its sha256 no longer the one the build
recorded) is reported `stale` (its old compiled form is what runs) until the next build.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES

# The build's record, beside this module (written by _build/pdproxy_build.py, read there as a literal)
BUILD_RECORD = "_build.json"

# What the build compiles, read by _build/pdproxy_build.py as a literal: the per-request and
# per-event code the profile names (the stream scan, span building and OTLP encoding, the
# recorder and its metrics, the request checks, the JSON readers), each a module that mypy checks clean. A policy's
# `name` is a ClassVar: mypyc would otherwise make a class-level attribute an instance one.
MODULES = (
    "pdproxy.protocol",
    "pdproxy.jsonio",
    "pdproxy.stream",
    "pdproxy.telemetry.clock",
    "pdproxy.telemetry.names",
    "pdproxy.telemetry.measure",
    "pdproxy.telemetry.metrics",
    "pdproxy.telemetry.otlp",
    "pdproxy.telemetry.recorder",
    "pdproxy.telemetry.stalls",
    "pdproxy.telemetry.tracing",
    "pdproxy.policies.request",
    # the legs' HTTP client, the choice of instance and the policies, admission, the errors, mid-stream taps
    "pdproxy.upstream",
    "pdproxy.pool",
    "pdproxy.admission",
    "pdproxy.errors",
    "pdproxy.policies.base",
    "pdproxy.policies.prefix_index",
    "pdproxy.policies.round_robin",
    "pdproxy.policies.random_choice",
    "pdproxy.policies.least_inflight",
    "pdproxy.policies.power_of_two",
    "pdproxy.policies.consistent_hash",
    "pdproxy.policies.cache_aware",
    "pdproxy.policies.load_aware",
    "pdproxy.policies.precise_prefix",
    "pdproxy.migration.continuation",
    # the request flow, its intake and routing, its legs' retries and the decode's first token
    "pdproxy.pd",
    "pdproxy.intake",
    "pdproxy.routing.placement",
    "pdproxy.blocks",
    # Not pdproxy.kvevents.index: compiled, its events cost the same, their time being in dict and set
    # operations and msgspec already (benchmarks/membership_scale.py); it stays mypy-clean should that change.
    "pdproxy.legs",
    "pdproxy.migration.attempts",
    # the server of the inference routes
    "pdproxy.serving.lean",
)


def build_record() -> dict[str, object]:
    """What the build that installed this package recorded (_build/pdproxy_build.py): its `mode`, the
    `error` that made an `auto` build fall back to pure Python, and the sha256 of each compiled
    source. Empty when no build wrote one (a source tree used as it is)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), BUILD_RECORD)
    try:
        with open(path, "rb") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def form_of_file(path: str, recorded_sha256: str | None) -> str:
    """"compiled", "stale" (the source beside it is not the one it was compiled from: its old compiled
    code is what runs) or "python". Decided by content, not file times, which an installed wheel
    does not keep; an extension with no recorded hash beside a source cannot be vouched for."""
    if not path.endswith(tuple(EXTENSION_SUFFIXES)):
        return "python"
    source = path[: path.index(".", path.rindex(os.sep))] + ".py"
    try:
        with open(source, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "compiled"  # no source beside it: nothing to be stale against
    return "compiled" if digest == recorded_sha256 else "stale"


def report() -> dict[str, object]:
    """For /status and the start-up log: the overall form, each module's, and the build's mode and
    fallback error."""
    record = build_record()
    sources = record.get("sources")
    hashes: dict[str, str] = sources if isinstance(sources, dict) else {}
    forms = {}
    for name in MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        recorded = hashes.get(name.replace(".", "/") + ".py")
        forms[name] = form_of_file(getattr(module, "__file__", None) or "", recorded)
    values = set(forms.values())
    overall = values.pop() if len(values) == 1 else "mixed"
    return {"form": overall, "modules": forms, "build": {"mode": record.get("mode"), "error": record.get("error")}}


def warns(r: dict[str, object]) -> bool:
    """Whether start-up says `summary` as a warning: what runs is not what the sources say (stale, mixed),
    or the build was asked to compile and fell back."""
    build: dict[str, object] = r["build"]  # type: ignore[assignment]
    return r["form"] not in ("compiled", "python") or bool(build["error"])


def summary(r: dict[str, object] | None = None) -> str:
    """One line for the start-up log."""
    r = r or report()
    forms: dict[str, str] = r["modules"]  # type: ignore[assignment]
    build: dict[str, object] = r["build"]  # type: ignore[assignment]
    if r["form"] == "compiled":
        return f"hot path compiled (mypyc): {len(forms)} modules"
    if r["form"] == "python" and build["error"]:
        return (f"hot path in pure Python: the PDPROXY_COMPILE=auto build could not compile it ({build['error']}); "
                "reinstall with PDPROXY_COMPILE=1 to see the whole failure")
    if r["form"] == "python":
        return "hot path in pure Python (not compiled: PDPROXY_COMPILE=1 pip install . compiles it)"
    odd = ", ".join(f"{name} {form}" for name, form in forms.items() if form != "compiled")
    return f"hot path partly compiled: {odd}"


if __name__ == "__main__":  # `python -m pdproxy.compiled`: the report, and which package it is about
    print(json.dumps({**report(), "package": os.path.dirname(os.path.abspath(__file__))}))
