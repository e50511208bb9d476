"""Made-up model names leave /metrics and the proxy's memory flat (benchmarks/cardinality.py, bounded).

Real processes: a simulated instance serving `sim-model` (404 for any other name) and the proxy.
The benchmark warms both up, then sends one request per distinct made-up name; the numbers it
prints for 10,000 names are in docs/telemetry.md. Before the bound, each name added ~128
series and ~37 KiB of resident memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "cardinality.py"
NAMES = 1500


def test_distinct_model_names_leave_series_and_memory_flat() -> None:
    p = subprocess.run([sys.executable, str(BENCH), "--names", str(NAMES), "--json"], capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(p.stdout)
    before, after = result["before"], result["after"]
    assert result["statuses"] == {"404": NAMES}  # the instance refused every made-up name
    assert result["served_statuses"] == {"200": 20}
    assert after["series"] == before["series"], (before["series"], after["series"])
    assert after["metrics_bytes"] < before["metrics_bytes"] * 1.05  # only counter values grow by a digit
    growth = after["rss_bytes"] - before["rss_bytes"]
    assert growth < 8 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over {NAMES} names"  # unbounded: ~55 MiB
    assert after["model_labels"] == ["other", "sim-model"]  # the served model keeps its own label


def test_learned_names_are_capped_and_given_names_are_not() -> None:
    from pdproxy.telemetry.models import OTHER, ModelNames

    names = ModelNames(["given"], max_learned=3)
    for i in range(10):  # a backend that echoes every requested name back
        names.learn(f"echoed-{i}")
    names.learn("x" * 1000)
    assert names.learned == {"echoed-0", "echoed-1", "echoed-2"}
    assert names.label("given") == "given" and names.label("echoed-1") == "echoed-1"
    assert names.label("echoed-7") == OTHER and names.label(None) == OTHER and names.label(["a"]) == OTHER
    assert names.label("alias-of-given", answered="given") == "given"  # answered by a known model
    assert names.label("made-up", answered="made-up") == OTHER  # an answer names it only once learned


def test_status_codes_outside_the_known_set_are_labelled_by_class() -> None:
    from pdproxy.telemetry.metrics import status_label

    assert [status_label(s) for s in (200, 404, 429, 499, 502)] == ["200", "404", "429", "499", "502"]
    assert [status_label(s) for s in (206, 418, 451, 507, 599, 42, 1000)] == ["2xx", "4xx", "4xx", "5xx", "5xx",
                                                                              "other", "other"]


def test_the_collector_keys_only_on_bounded_attributes() -> None:
    """span_metrics and signal_to_metrics turn attributes into series: only bounded ones may be keys."""
    import yaml

    bounded = {"gen_ai.request.model",  # a served model or `other` (pdproxy/telemetry/models.py)
               "pd.run", "service.name", "server.address",  # the operator's
               "pd.deployment", "pd.mode", "pd.failed_stage"}  # pdproxy's fixed lists
    collector = Path(__file__).resolve().parent.parent / "collector"
    for path in sorted(collector.glob("otelcol*.yaml")):
        connectors = yaml.safe_load(path.read_text()).get("connectors") or {}
        keys = {d["name"] for d in (connectors.get("span_metrics") or {}).get("dimensions") or []}
        for rule in ((connectors.get("signal_to_metrics") or {}).get("spans") or []):
            keys |= {a["key"] for a in rule.get("attributes") or []}
            keys |= {a["key"] for a in rule.get("include_resource_attributes") or []}
        assert keys <= bounded, (path.name, keys - bounded)
