"""Which of pdproxy's per-request modules run compiled (mypyc) and which as pure Python.

`PDPROXY_COMPILE=1 pip install .` compiles `MODULES` to C extensions (setup.py); a plain install
runs them as Python, which behaves the same and costs more CPU per request. Start-up logs which
form runs and `/status` says it (`"compiled"`), so a benchmark or a bug report names the form
measured. An in-place build (`pip install -e .`) leaves the extensions beside the sources, where
Python prefers them: a source edited after the build is reported `stale` (its old compiled form is
what runs) until the next build.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES

# What the build compiles, read by _build/pdproxy_build.py as a literal: the per-request and
# per-event code the profile names (the stream scan, span building and OTLP encoding, the
# recorder and its metrics, the request checks), each a module that mypy checks clean. A policy's
# `name` is a ClassVar: mypyc would otherwise make a class-level attribute an instance one.
MODULES = (
    "pdproxy.protocol",
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
    "pdproxy.legs",
    "pdproxy.migration.attempts",
    # the server of the inference routes
    "pdproxy.serving.lean",
)


def _form(name: str, library: str | None) -> str:
    module = sys.modules.get(name) or importlib.import_module(name)
    return form_of_file(getattr(module, "__file__", None) or "", library)


def _group_library() -> str | None:
    """The shared library that holds every compiled module's code (mypyc's group `pdproxy`), beside the
    package; each module's own extension is a small shim that a rebuild leaves alone when it did not change."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for suffix in EXTENSION_SUFFIXES:
        path = os.path.join(root, "pdproxy__mypyc" + suffix)
        if os.path.exists(path):
            return path
    return None


def form_of_file(path: str, library: str | None = None) -> str:
    """"compiled", "stale" (compiled from an older source than the one beside it) or "python". The build
    time is the newer of the module's extension and the group `library` holding its code."""
    if not path.endswith(tuple(EXTENSION_SUFFIXES)):
        return "python"
    source = path[: path.index(".", path.rindex(os.sep))] + ".py"
    try:
        built = max(os.stat(p).st_mtime for p in (path, library) if p)
        if os.stat(source).st_mtime > built:
            return "stale"
    except OSError:
        pass  # an installed wheel carries no sources: nothing to be stale against
    return "compiled"


def report() -> dict[str, object]:
    """For /status and the start-up log: the overall form and each module's."""
    library = _group_library()
    forms = {name: _form(name, library) for name in MODULES}
    values = set(forms.values())
    overall = values.pop() if len(values) == 1 else "mixed"
    return {"form": overall, "modules": forms}


def summary() -> str:
    """One line for the start-up log."""
    r = report()
    forms: dict[str, str] = r["modules"]  # type: ignore[assignment]
    if r["form"] == "compiled":
        return f"hot path compiled (mypyc): {len(forms)} modules"
    if r["form"] == "python":
        return "hot path in pure Python (not compiled: PDPROXY_COMPILE=1 pip install . compiles it)"
    odd = ", ".join(f"{name} {form}" for name, form in forms.items() if form != "compiled")
    return f"hot path partly compiled: {odd}"
